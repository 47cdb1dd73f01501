"""The engine choice (``inference`` config section), the factory, the missing-extra
error, and the vLLM engine's pure conversion functions. None of these needs vLLM."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from mlperf_grpo.config.load import parse_config
from mlperf_grpo.errors import ConfigError
from mlperf_grpo.inference import factory
from mlperf_grpo.inference.base import SamplingParams
from mlperf_grpo.inference.decode import DecodeOptions
from mlperf_grpo.inference.factory import EngineUnavailableError, build_engine, check_engine_available
from mlperf_grpo.inference.hf import HFEngine
from mlperf_grpo.inference.vllm import sampled_logprobs
from mlperf_grpo.inference.vllm_worker import read_safetensors_dir
from mlperf_grpo.model.fingerprint import canary_mismatch

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None


def test_default_engine_is_hf_and_vllm_options_parse():
    assert parse_config({}).inference.engine == "hf"
    c = parse_config({"inference": {"engine": "vllm", "tensor_parallel_size": 2, "gpu_memory_utilization": 0.5,
                                    "max_model_len": 4096, "enforce_eager": False}})
    assert (c.inference.engine, c.inference.tensor_parallel_size, c.inference.max_model_len) == ("vllm", 2, 4096)


@pytest.mark.parametrize(
    "section, words",
    [
        ({"engine": "sglang"}, "inference.engine"),
        ({"engine": "vllm", "tensor_parallel_size": 0}, "inference.tensor_parallel_size"),
        ({"engine": "vllm", "gpu_memory_utilization": 1.5}, "inference.gpu_memory_utilization"),
        ({"engine": "vllm", "dtype": "float16"}, "unknown key 'inference.dtype'"),
    ],
)
def test_bad_inference_section_is_one_line(section, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")) as err:
        parse_config({"inference": section})
    assert "\n" not in str(err.value)


def test_vllm_refuses_rollout_top_p_below_one():
    """vLLM's rollout log-probs are post-top-p; the loss recomputes pre-top-p: refused."""
    with pytest.raises(ConfigError, match=r"grpo\.rollout_top_p=0\.9.*top-p truncation.*rollout_top_p: 1\.0"):
        parse_config({"inference": {"engine": "vllm"}, "grpo": {"rollout_top_p": 0.9}})
    assert parse_config({"grpo": {"rollout_top_p": 0.9}}).grpo.rollout_top_p == 0.9  # hf: fine


def test_factory_builds_the_hf_engine():
    engine = build_engine(parse_config({}), batch_size=7)
    assert isinstance(engine, HFEngine) and engine.batch_size == 7 and engine.dtype == torch.float32


@pytest.mark.parametrize("refit_only", [False, True])
def test_factory_hands_the_engine_its_top_p_candidates(monkeypatch, refit_only):
    """``inference.top_p_candidates`` and ``prefill_graphs`` reach the slot decoder on
    CUDA; the CPU keeps the full-vocabulary sampler whatever it says (its sort has no
    stable tie order), and has no graphs to capture."""
    made = {}
    real_init = HFEngine._init

    def spy(self, model, tokenizer, batch_size, model_path, decode, decoder=DecodeOptions(), **kwargs):
        made.update(top_p_candidates=decoder.top_p_candidates, prefill_graphs=decoder.prefill_graphs)
        real_init(self, model, tokenizer, batch_size, model_path, "slots", decoder, **kwargs)

    monkeypatch.setattr(HFEngine, "_init", spy)
    config = parse_config({"inference": {"top_p_candidates": 32, "prefill_graphs": True}})
    assert parse_config({}).inference.top_p_candidates == 64 and parse_config({}).inference.prefill_graphs is False
    engine = build_engine(config, batch_size=4, refit_only=refit_only)
    assert made == {"top_p_candidates": 32, "prefill_graphs": True}
    assert engine.describe()["engine"].startswith("slot decoder") and engine.describe()["top_p_candidates"] == 0
    assert engine._decoder.prefill_graphs and engine.describe()["prefill_graphs"] is False
    with pytest.raises(ConfigError, match=r"inference\.top_p_candidates"):
        parse_config({"inference": {"top_p_candidates": -1}})


def test_missing_vllm_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(factory.importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    config = parse_config({"inference": {"engine": "vllm"}})
    with pytest.raises(EngineUnavailableError) as err:
        build_engine(config)
    assert "pip install -e '.[vllm]'" in str(err.value) and "\n" not in str(err.value)
    check_engine_available(parse_config({}))  # hf needs nothing


@pytest.mark.skipif(VLLM_INSTALLED, reason="vLLM is installed here: the missing-extra path cannot be exercised")
@pytest.mark.parametrize("command", ["train", "run"])
def test_cli_without_vllm_exits_2_and_writes_nothing(tmp_path, command):
    config = tmp_path / "vllm.yaml"
    config.write_text("inference: {engine: vllm}\n")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "mlperf_grpo.cli", command, "--config", str(config), "--output", str(out)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "pip install -e '.[vllm]'" in proc.stderr
    assert not out.exists()


def test_hf_refit_from_directory_equals_refit_from_state_dict(tmp_path):
    """``load_checkpoint(step_N/)`` loads exactly what ``load_weights(state_dict)`` does."""
    a, b = HFEngine("builtin:arithmetic-tiny", "float32"), HFEngine("builtin:arithmetic-tiny", "float32")
    g = torch.Generator().manual_seed(0)
    state = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in a.model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    a.load_weights(state)
    b.load_checkpoint(tmp_path)
    assert a.weights_fingerprint(sorted(state)) == b.weights_fingerprint(sorted(state))
    params = SamplingParams(1.0, 1.0, 6)
    assert a.generate(["1+2="] * 3, params, [1, 2, 3]) == b.generate(["1+2="] * 3, params, [1, 2, 3])
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        b.load_checkpoint(tmp_path / "empty")


# ----------------------------------------------------------------- pure conversion functions

class _Logprob:
    def __init__(self, logprob):
        self.logprob = logprob


def test_sampled_logprobs_picks_the_sampled_token_of_each_position():
    positions = [{5: _Logprob(-0.5)}, {2: _Logprob(-1.25), 7: _Logprob(-0.1)}]
    assert sampled_logprobs([5, 2], positions) == [-0.5, -1.25]
    with pytest.raises(ValueError, match="position 1: no log-probability for the sampled token 3"):
        sampled_logprobs([5, 3], positions)
    with pytest.raises(ValueError, match="2 tokens but 1"):
        sampled_logprobs([5, 2], positions[:1])


def test_read_safetensors_dir_reads_every_file(tmp_path):
    save_file({"b": torch.ones(2), "a": torch.zeros(1)}, str(tmp_path / "model-00001.safetensors"))
    save_file({"c": torch.full((1,), 3.0)}, str(tmp_path / "model-00002.safetensors"))
    assert [n for n, _ in read_safetensors_dir(str(tmp_path))] == ["a", "b", "c"]


def test_canary_up_to_constant_accepts_log_softmax_and_still_catches_other_weights():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    logprobs = torch.log_softmax(logits, dim=-1).tolist()
    assert canary_mismatch(logits.tolist(), logprobs, "float32") is not None  # shifted by logsumexp
    assert canary_mismatch(logits.tolist(), logprobs, "float32", up_to_constant=True) is None
    other = torch.log_softmax(logits + torch.tensor([0.0, 0.01, 0.0, 0.0]), dim=-1).tolist()
    assert canary_mismatch(logits.tolist(), other, "float32", up_to_constant=True) is not None


def test_a_vllm_trained_runs_canary_is_what_an_hf_engine_records():
    """With vLLM the trainer records the canary from the policy cast to the checkpoint
    dtype: exactly the logits an HF engine refit with those weights gives."""
    from mlperf_grpo.model.fingerprint import canary_logits_in_dtype
    from mlperf_grpo.model.load import load_model

    policy = load_model("builtin:arithmetic-tiny", "float32")
    engine = HFEngine("builtin:arithmetic-tiny", "bfloat16")
    engine.load_weights({k: v.to(torch.bfloat16) for k, v in policy.state_dict().items()})
    assert canary_logits_in_dtype(policy, policy.config.vocab_size, torch.bfloat16) == engine.canary_logits()
    assert next(policy.parameters()).dtype == torch.float32  # the policy itself is untouched
