"""The evaluators' engine: built from the model's config, its weights neither read nor
initialised until the first refit (``HFEngine.for_refit``)."""

import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from mlperf_grpo.config.sections import BUILTIN_MODEL
from mlperf_grpo.errors import ModelLoadError
from mlperf_grpo.inference.base import SamplingParams
from mlperf_grpo.inference.hf import HFEngine
from mlperf_grpo.model.files import BUILTIN_MODEL_DIR
from mlperf_grpo.model.fingerprint import CANARY_TOLERANCE, canary_mismatch
from mlperf_grpo.model.load import build_model_for_refit, load_model

PROMPTS = ["12 + 7 =", "3 * 4 =", "100 - 1 ="]

# Two engines holding the same weights (equal fingerprints) in different allocations:
# MKL picks its code path by the operands' memory alignment unless MKL_CBWR is set, so
# their float32 logits may differ in the last bits (log-probabilities in the 7th digit
# seen on an AVX-512 machine, up to 9.6e-7 here from run to run). They are compared
# within the evaluator's own bar for "this engine holds the checkpoint's weights"
# (fingerprint.CANARY_TOLERANCE, 1e-4 per logit), 100 times the largest difference seen (1e-6);
# a refit that is wrong moves them by far more (the canary tests of tests/evaluate/test_faults_eval_*.py).
SAME_WEIGHTS_TOLERANCE = {"rtol": 0.0, "atol": CANARY_TOLERANCE["float32"]}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_built_model_is_the_loaded_one_apart_from_the_weights(dtype):
    loaded, built = load_model(BUILTIN_MODEL, dtype), build_model_for_refit(BUILTIN_MODEL, dtype)
    have, want = built.state_dict(), loaded.state_dict()
    assert {n: (t.shape, t.dtype) for n, t in have.items()} == {n: (t.shape, t.dtype) for n, t in want.items()}
    buffers = dict(built.named_buffers())
    expected = dict(loaded.named_buffers())
    assert "model.rotary_emb.inv_freq" in expected  # computed at construction, not read from a file
    assert {n: b.dtype for n, b in buffers.items()} == {n: b.dtype for n, b in expected.items()}
    assert all(torch.equal(buffers[n], expected[n]) for n in expected)
    assert have["lm_head.weight"].data_ptr() == have["model.embed_tokens.weight"].data_ptr()  # tied, as loaded
    assert built.generation_config.to_dict() == loaded.generation_config.to_dict()
    assert built.config.to_dict() == loaded.config.to_dict()
    assert not built.training


def test_refit_only_engine_generates_as_a_loaded_engine_after_one_refit():
    loaded = HFEngine(BUILTIN_MODEL, "float32", batch_size=2)
    engine = HFEngine.for_refit(BUILTIN_MODEL, "float32", batch_size=2)
    engine.load_weights(load_file(str(BUILTIN_MODEL_DIR / "model.safetensors")))
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=8)
    names = list(engine.model.state_dict())
    assert engine.weights_fingerprint(names) == loaded.weights_fingerprint(names)  # the same bits
    got, want = engine.generate(PROMPTS, params, [1, 2, 3]), loaded.generate(PROMPTS, params, [1, 2, 3])
    assert [(c.token_ids, c.text) for c in got] == [(c.token_ids, c.text) for c in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), **SAME_WEIGHTS_TOLERANCE)
    assert canary_mismatch(loaded.canary_logits(), engine.canary_logits(), "float32") is None


def test_refit_only_engine_reads_no_weight_file(tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(BUILTIN_MODEL_DIR, model_dir)
    (model_dir / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(Exception, match="header"):  # loading the model reads the (broken) weights
        HFEngine(str(model_dir), "float32")
    engine = HFEngine.for_refit(str(model_dir), "float32")  # reads config.json and the tokenizer only
    engine.load_weights(load_file(str(BUILTIN_MODEL_DIR / "model.safetensors")))
    assert canary_mismatch(HFEngine(BUILTIN_MODEL, "float32").canary_logits(), engine.canary_logits(), "float32") is None


def test_a_refit_that_leaves_a_weight_unfilled_is_refused():
    engine = HFEngine.for_refit(BUILTIN_MODEL, "float32")
    weights = load_file(str(BUILTIN_MODEL_DIR / "model.safetensors"))
    del weights["model.norm.weight"]
    with pytest.raises(ValueError, match="missing \\['model.norm.weight'\\]"):
        engine.load_weights(weights)


def test_refit_only_engine_refuses_a_directory_without_a_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        HFEngine.for_refit(str(tmp_path), "float32")


def test_the_ranks_module_imports_without_touching_cuda():
    """Evaluation ranks are forked from a server that imported their module
    (``evaluate/prestart.py``): a CUDA driver initialised there would break the forks."""
    code = (
        "import torch, torch.cuda\n"
        "calls = []\n"
        "def spy(name, real):\n"
        "    return lambda *a, **k: (calls.append(name), real(*a, **k))[1]\n"
        "for name in ('is_available', 'device_count', 'init', '_lazy_init', 'current_device'):\n"
        "    setattr(torch.cuda, name, spy(name, getattr(torch.cuda, name)))\n"
        "if hasattr(torch._C, '_cuda_getDeviceCount'):  # a CUDA build\n"
        "    torch._C._cuda_getDeviceCount = spy('_cuda_getDeviceCount', torch._C._cuda_getDeviceCount)\n"
        "import mlperf_grpo.evaluate.worker\n"
        "assert torch.cuda.is_available.__name__ == '<lambda>'  # the spies were in place\n"
        "print(calls)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout

