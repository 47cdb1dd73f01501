"""A reward that is not a finite number stops the run (issue 26, item 1), end to end.

A ``task: python`` reward that returns NaN made ``train`` exit 0 with NaN loss, grad norm
and checkpoint tensors (as in huggingface/trl#5773), and validation counted the NaN as a
wrong answer. Each test writes its own task module (a scoring worker imports the reward by
name, so the module name differs per test) whose reward returns the bad value on chosen
task ids and the arithmetic reward elsewhere.
"""

import math
import re

import pytest
import yaml
from safetensors.torch import load_file

from mlperf_grpo.cli import main
from mlperf_grpo.config.load import load_config
from mlperf_grpo.config.rundir import RunDir
from mlperf_grpo.logs.mllog import read_log
from mlperf_grpo.tasks import arithmetic
from mlperf_grpo.train.rollout import PromptSampler

SMALL = {"division": "open", "validation": {"num_tasks": 8},
         "grpo": {"num_prompts_per_step": 2, "max_steps": 3, "first_eval_step": 1, "micro_batch_size": 32}}
CODE = {"nan": 'float("nan")', "inf": 'float("inf")', "string": '"many"'}
SHOWN = {"nan": "nan", "inf": "inf", "string": "'many'"}


def bad_reward_task(tmp_path, monkeypatch, value, bad_ids):
    """A run config whose python task's reward returns ``CODE[value]`` on ``bad_ids``."""
    module = "bad_reward_" + re.sub(r"\W", "_", tmp_path.name)
    (tmp_path / f"{module}.py").write_text(f"""
import reward_fixtures
from mlperf_grpo.tasks import arithmetic

BAD = {sorted(bad_ids)!r}


def reward(completion, task):
    return {CODE[value]} if task.task_id in BAD else arithmetic.reward(completion, task)


class Suite(reward_fixtures.ArithmeticSubset):
    reward = "{module}:reward"


def factory():
    return Suite()
""")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({**SMALL, "task": {"name": "python", "entry_point": f"{module}:factory",
                                                     "num_train_tasks": 64}}))
    return cfg, module


SEED = load_config(None).seed
VALIDATION = arithmetic.validation_tasks(SMALL["validation"]["num_tasks"])


def step_prompts(steps):
    """The training task ids of steps 1..``steps``, as the trainer's sampler draws them
    from the suite's pool (the arithmetic training tasks)."""
    sampler = PromptSampler(arithmetic.train_tasks(64, len(VALIDATION), SEED), SEED)
    return [[t.task_id for t in sampler.sample(SMALL["grpo"]["num_prompts_per_step"])] for _ in range(steps)]


def messages(capsys):
    """stderr's lines without the progress bars (``train:``/``evaluate:`` and their redraws)."""
    lines = capsys.readouterr().err.replace("\r", "\n").splitlines()
    return [line for line in lines if line.strip() and not re.match(r"(train|evaluate|checkpoint\w*): ", line)]


def error_line(module, value, task_id, count):
    return (f"mlperf-grpo: error: reward function {module}:reward returned {SHOWN[value]} on task {task_id} "
            f"({count} of 32 completions); a reward must be a finite number: fix the reward function")


def test_nan_reward_stops_training_before_its_update_and_the_published_steps_stay_evaluable(tmp_path, monkeypatch, capsys):
    step_1, step_2, step_3 = step_prompts(3)
    bad = next(t for t in step_3 if t not in step_1 + step_2)
    cfg, module = bad_reward_task(tmp_path, monkeypatch, "nan", [bad])
    run = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--output", str(run)]) == 2
    first, *rest = messages(capsys)
    assert first == error_line(module, "nan", bad, 16)  # 16 generations of the one bad prompt
    assert rest == [f"note: training ended early with checkpoints step_1..step_2 published and no run_stop: "
                    f"'mlperf-grpo evaluate {run}' evaluates them and writes the run's run_stop"]
    assert RunDir(run).published_steps() == [1, 2] and not list((run / "checkpoints").glob("tmp_step_*"))
    shards = sorted((run / "checkpoints").glob("step_*/*.safetensors"))
    assert {p.parent.name for p in shards} == {"step_1", "step_2"}
    assert all(bool(t.isfinite().all()) for p in shards for t in load_file(p).values())
    log = read_log(run / "mlperf.log")
    assert [e.metadata["step"] for e in log.find("block_stop")] == [1, 2] and not log.find("run_stop")
    stats = [e.value for e in log.find("tracked_stats")]
    assert len(stats) == 2 and all(math.isfinite(s[k]) for s in stats for k in ("reduced_train_loss", "reward", "grad_norm"))
    # The usual way on: the evaluator scores the two published steps (validation rewards are finite).
    assert main(["evaluate", str(run), "--retain-checkpoints"]) in (0, 3)
    log = read_log(run / "mlperf.log")
    assert [e.metadata["step"] for e in log.find("eval_accuracy")][0] == 1 and len(log.find("run_stop")) == 1


@pytest.mark.parametrize("value", ["inf", "string"])
def test_a_reward_that_is_not_a_finite_number_at_step_1_closes_the_run_as_aborted(tmp_path, monkeypatch, capsys, value):
    (step_1,) = step_prompts(1)
    cfg, module = bad_reward_task(tmp_path, monkeypatch, value, step_1)
    run = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--output", str(run)]) == 2
    assert messages(capsys) == [error_line(module, value, step_1[0], 32)]
    assert RunDir(run).published_steps() == []
    log = read_log(run / "mlperf.log")
    assert not log.find("block_stop")
    (stop,) = log.find("run_stop")
    assert stop.metadata["status"] == "aborted" and stop.metadata["step"] == 0


@pytest.mark.parametrize("value", ["nan", "inf", "string"])
def test_a_validation_reward_that_is_not_a_finite_number_logs_nothing_for_the_checkpoint(tmp_path, monkeypatch, capsys, value):
    cfg, module = bad_reward_task(tmp_path, monkeypatch, value, [VALIDATION[3].task_id])
    run = tmp_path / "run"
    assert main(["run", "--config", str(cfg), "--output", str(run)]) == 2
    assert messages(capsys) == [error_line(module, value, VALIDATION[3].task_id, 4)]  # 8 tasks x 4 generations
    log = read_log(run / "mlperf.log")
    assert len(log.find("block_stop")) == 3
    assert not log.find("eval_start") and not log.find("eval_accuracy") and not log.find("run_stop")
    assert RunDir(run).published_steps() == [1, 2, 3]  # nothing was evaluated, so nothing is deleted
    assert not (run / "eval" / "summary.json").exists() and not (run / "eval" / "step_1.jsonl").exists()
