"""model.compile: each decoder layer compiled (torch.compile) gives the eager update."""

import shutil

import pytest
from safetensors import safe_open

from mlperf_grpo.config import parse_config
from mlperf_grpo.rundir import RunDir
from mlperf_grpo.train import loop


def _config(compile_policy: str, **model):
    return parse_config({"model": {"compile": compile_policy, **model},
                         "grpo": {"max_steps": 1, "first_eval_step": 1, "num_prompts_per_step": 2,
                                  "micro_batch_size": 8}}, "test")


def test_compile_auto_is_on_only_for_the_cuda_bfloat16_path():
    assert not _config("auto").model.compile_policy  # the CPU calibration runs eager
    assert _config("auto", device="cuda", dtype="bfloat16").model.compile_policy
    assert not _config("auto", device="cuda", dtype="bfloat16", compute_dtype="float32").model.compile_policy
    assert _config("on").model.compile_policy and not _config("off", device="cuda", dtype="bfloat16").model.compile_policy


def test_compile_on_and_off_as_yaml_writes_them_unquoted(tmp_path):
    import yaml

    for text, expected in (("on", True), ("off", False), ("auto", False)):
        data = yaml.safe_load(f"model: {{compile: {text}}}")  # bare on/off: YAML booleans
        assert parse_config(data, "c.yaml").model.compile_policy is expected
    with pytest.raises(Exception, match="'auto', 'on' or 'off'"):
        parse_config({"model": {"compile": "bogus"}}, "c.yaml")


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on the CPU needs a C compiler")
def test_compiled_layers_give_the_eager_step(tmp_path):
    eager = loop.train(_config("off"), RunDir(tmp_path / "eager"), config_filename="test", show_progress=False)
    compiled = loop.train(_config("on"), RunDir(tmp_path / "compiled"), config_filename="test", show_progress=False)
    (a,), (b,) = eager.steps, compiled.steps
    assert a.grad_norm > 0
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)  # the same math, other kernels
    assert b.loss == pytest.approx(a.loss, abs=1e-5)
    # the weight names the refit and the checkpoints use are unchanged by compilation
    assert _checkpoint_names(tmp_path / "compiled") == _checkpoint_names(tmp_path / "eager") != set()


def _checkpoint_names(run_dir) -> set[str]:
    names = set()
    for path in (run_dir / "checkpoints" / "step_1").glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            names |= set(f.keys())
    return names
