"""``benchmarks/distributed.py``'s figures and ``benchmarks/format_task.py``'s reward."""

import importlib.util
import sys
from pathlib import Path

import pytest

from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.tasks import load_suite
from mlperf_grpo.tasks.reward_names import reward_ref

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stats(grad_norm: float, loss: float, reward: float = 0.5, toks: int = 100) -> dict:
    return {"grad_norm": grad_norm, "reduced_train_loss": loss, "reward": reward, "global_valid_toks": toks}


def test_zero_gradients_give_no_grad_norm_ratio_instead_of_a_huge_one():
    bench = _module("distributed")
    # a step with no reward in one run and some in the other: the old figure was 0.48 / 1e-30
    one = [_stats(0.0, 0.0, reward=0.0), _stats(0.0, 0.0, reward=0.0)]
    many = [_stats(0.0, 0.0, reward=0.0), _stats(0.48, 0.01, reward=0.01, toks=90)]
    got = bench.agreement(one, many)
    assert got["max_grad_norm_rel_diff"] is None and got["max_loss_rel_diff"] is None
    assert got["nonzero_grad_steps"] == 0 and got["same_rollouts_steps"] == 1
    assert got["max_loss_abs_diff"] == pytest.approx(0.01)


def test_agreement_compares_the_steps_with_gradients():
    bench = _module("distributed")
    one = [_stats(2.0, 0.5), _stats(0.0, 0.0), _stats(4.0, -0.25)]
    many = [_stats(2.002, 0.5005), _stats(0.0, 0.0), _stats(3.996, -0.25, toks=101)]
    got = bench.agreement(one, many)
    assert got["max_grad_norm_rel_diff"] == pytest.approx(0.001)  # |2.002 - 2| / 2 = |3.996 - 4| / 4
    assert got["max_loss_rel_diff"] == pytest.approx(0.001)  # 0.0005 / 0.5
    assert got["max_loss_abs_diff"] == pytest.approx(0.0005)
    assert got["nonzero_grad_steps"] == 2 and got["same_rollouts_steps"] == 2


def test_format_task_rewards_any_integer_and_loads_as_an_entry_point(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    config = RunConfig.model_validate({"task": {"name": "python", "entry_point": "format_task:factory"}})
    suite = load_suite(config)
    assert reward_ref(suite.reward) == "format_task:reward"
    task = suite.train_tasks(4, 251, 1)[0]
    reward = sys.modules["format_task"].reward
    wrong = str(int(task.answer) + 1)
    assert [reward(text, task) for text in (task.answer, wrong, f" {wrong} ", "12+3", "", "=")] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert suite.validation_tasks(251) == load_suite(RunConfig()).validation_tasks(251)  # the arithmetic prompts


def test_build_model_dir_writes_a_finite_model_that_loads(tmp_path):
    import torch

    from mlperf_grpo.model.check import check_model
    from mlperf_grpo.model.load import load_model

    n = _module("checkpoint").build_model_dir(tmp_path / "m", 2e6, "bfloat16", device="cpu")
    check_model(str(tmp_path / "m"), sample_text="12+34=")
    model = load_model(str(tmp_path / "m"), "bfloat16")
    assert n == sum(p.numel() for p in model.parameters()) > 1e6
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert model.model.layers[0].mlp.up_proj.weight.float().std() > 0.01  # initialised, not zeros


@pytest.mark.parametrize("value", ["0", "-0.5", "nan"])
def test_a_learning_rate_that_is_not_positive_is_refused_before_anything_runs(value, monkeypatch, capsys):
    """``--learning-rate 0`` was dropped from the config (``if lr``), so the run trained at
    the config's 4e-6 while the JSON line reported 0; now any value AdamW would not
    train with exits 2 with one line, before a model is built."""
    bench = _module("distributed")
    monkeypatch.setattr(sys, "argv", ["distributed.py", "--device", "cpu", "--learning-rate", value])
    monkeypatch.setattr(bench, "launch", lambda *a: pytest.fail("a run was launched"))
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2
    assert f"--learning-rate {float(value)}: AdamW's learning rate must be > 0" in capsys.readouterr().err


def test_planned_bytes_are_the_planners_for_the_built_model(tmp_path):
    """The JSON line's planned figures for the model the benchmark builds: 16 bytes a
    parameter of fp32 state over N ranks (FSDP2's dim-0 chunks: at least total/N), plus
    the full rollout-dtype engine on each, and K whole checkpoints staged on rank 0."""
    n = _module("checkpoint").build_model_dir(tmp_path / "m", 2e6, "bfloat16", device="cpu")
    one = _module("distributed").planned_bytes_per_rank(tmp_path / "m", 1, "bfloat16", 1)
    assert one == {"device_bytes": 18 * n, "master_weights_bytes": 4 * n, "gradient_bytes": 4 * n, "adam_bytes": 8 * n,
                   "engine_bytes": 2 * n, "staging_bytes": 2 * n}
    two = _module("distributed").planned_bytes_per_rank(tmp_path / "m", 2, "bfloat16", 1)
    from mlperf_grpo.plan.memory import model_tensors
    from mlperf_grpo.plan.model_config import load_model_config

    row_elements = sum(t.numel // t.shape[0] for t in model_tensors(load_model_config(tmp_path / "m")))
    assert 2 * n <= two["master_weights_bytes"] <= 2 * n + 4 * row_elements  # rank 0's half, + a row of each tensor at most
    assert two["engine_bytes"] == 2 * n
