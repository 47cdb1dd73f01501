"""One hung verification no longer ends the training run (issue 44), end to end.

A ``task: python`` reward hangs once, on the first completion of one step-2 prompt that
it is asked to score (a marker file records that it did); with the default
``grpo.max_reward_timeout_share`` that completion scores 0, the step's
``tracked_stats`` count it, and training goes on; with the share 0 the run stops, as
before.
"""

import re

import pytest
import yaml

from mlperf_grpo.cli import main
from mlperf_grpo.config.load import load_config
from mlperf_grpo.logs.mllog import read_log
from mlperf_grpo.tasks import arithmetic, scoring
from mlperf_grpo.train.rollout import PromptSampler

SMALL = {"division": "open", "validation": {"num_tasks": 8},
         "grpo": {"num_prompts_per_step": 2, "max_steps": 3, "first_eval_step": 1, "micro_batch_size": 32}}
TIMEOUT_S = 3.0
"""The reward timeout of these runs (the hang is 600 s: only the kill ends it; an honest reward
of a loaded 2-core machine, which took over 1 s once, must not time out)."""


def hanging_once_task(tmp_path, monkeypatch, task_id, **grpo):
    module = "hang_once_" + re.sub(r"\W", "_", tmp_path.name)
    mark = tmp_path / "hung"
    (tmp_path / f"{module}.py").write_text(f"""
import os, time
import reward_fixtures
from mlperf_grpo.tasks import arithmetic


def reward(completion, task):
    if task.task_id == {task_id!r}:
        try:  # exactly once: two workers scoring this prompt's completions at once race on an exists() check
            os.close(os.open({str(mark)!r}, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            pass
        else:
            time.sleep(600)
    return arithmetic.reward(completion, task)


class Suite(reward_fixtures.ArithmeticSubset):
    reward = "{module}:reward"


def factory():
    return Suite()
""")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(scoring, "REWARD_TIMEOUT_S", TIMEOUT_S)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({**SMALL, "grpo": {**SMALL["grpo"], **grpo},
                                   "task": {"name": "python", "entry_point": f"{module}:factory", "num_train_tasks": 64}}))
    return cfg, mark


def step_2_prompt():
    seed = load_config(None).seed
    sampler = PromptSampler(arithmetic.train_tasks(64, SMALL["validation"]["num_tasks"], seed), seed)
    step_1, step_2 = (sampler.sample(SMALL["grpo"]["num_prompts_per_step"]) for _ in range(2))
    return next(t.task_id for t in step_2 if t.task_id not in {s.task_id for s in step_1})


def test_a_timed_out_verification_scores_0_is_counted_and_training_goes_on(tmp_path, monkeypatch):
    cfg, mark = hanging_once_task(tmp_path, monkeypatch, step_2_prompt())
    run = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--output", str(run)]) == 0
    assert mark.exists()  # the reward did hang
    stats = [e.value for e in read_log(run / "mlperf.log").find("tracked_stats")]
    assert [s["reward_timeouts"] for s in stats] == [0, 1, 0]


def test_share_0_stops_the_run_at_the_first_timeout(tmp_path, monkeypatch, capsys):
    cfg, _ = hanging_once_task(tmp_path, monkeypatch, step_2_prompt(), max_reward_timeout_share=0)
    run = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--output", str(run)]) == 1
    assert f"(1 timeouts); first: timed out after {TIMEOUT_S} s" in capsys.readouterr().err
    assert [e.metadata["step"] for e in read_log(run / "mlperf.log").find("block_stop")] == [1]


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_a_share_outside_0_to_1_is_refused(tmp_path, capsys, share):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({**SMALL, "grpo": {**SMALL["grpo"], "max_reward_timeout_share": share}}))
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "run")]) == 2
    assert "max_reward_timeout_share" in capsys.readouterr().err
