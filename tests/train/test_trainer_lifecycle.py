"""The trainer's lifecycle (issue 27): inputs checked once, and the ranks that write
nothing run the same :class:`~mlperf_grpo.train.trainer.Trainer` code with objects that
write nothing (``NoRunOutput``: ``DiscardingLogWriter``, ``NoCheckpoints``)."""

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from mlperf_grpo import tasks
from mlperf_grpo.cli import main
from mlperf_grpo.config.load import parse_config
from mlperf_grpo.config.rundir import RunDir
from mlperf_grpo.graceful_stop import GracefulStop
from mlperf_grpo.train.grpo import PGLossOptions
from mlperf_grpo.train.inputs import check_training_inputs
from mlperf_grpo.train.optimize import OptimizeSettings
from mlperf_grpo.train.outputs import NoRunOutput
from mlperf_grpo.train.trainer import Trainer, train

# two steps, both from the first eval step on: each after_step saves a checkpoint and asks
# for a stop request, the calls that differ between the writer and the other ranks
TINY = {"grpo": {"num_prompts_per_step": 4, "max_steps": 2, "first_eval_step": 1}, "validation": {"num_tasks": 20}}


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_train_loads_the_task_suite_once(tmp_path, monkeypatch):
    """``mlperf-grpo train`` checks its inputs once: the CLI's check is handed to the
    trainer (before: the trainer checked them again, loading the suite a second time)."""
    calls = []
    load = tasks.load_suite
    monkeypatch.setattr(tasks, "load_suite", lambda config: calls.append(config) or load(config))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**TINY, "grpo": {**TINY["grpo"], "max_steps": 1}}))
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--output", str(tmp_path / "r")]) == 0
    assert len(calls) == 1


@pytest.mark.parametrize("deferred", ["1", "0"], ids=["deferred", "inline"])
def test_run_loads_the_task_suite_once_per_phase(tmp_path, monkeypatch, deferred):
    """``mlperf-grpo run``: the training's inputs load the suite once; the deferred
    evaluation loads it once more (from the run directory's config) and hands it to the
    series check, the engine's warm-up and every checkpoint's validation (before: 4
    loads); inline evaluation validates with the training's inputs' suite."""
    calls = []
    load = tasks.load_suite
    monkeypatch.setattr(tasks, "load_suite", lambda config: calls.append(config) or load(config))
    monkeypatch.setenv("DEFERRED_OFFLINE_EVAL", deferred)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(TINY))
    assert main(["run", "--config", str(tmp_path / "c.yaml"), "--output", str(tmp_path / "r")]) in (0, 3)
    assert len(calls) == (2 if deferred == "1" else 1)


def test_a_rank_that_writes_nothing_trains_the_same_steps(tmp_path, monkeypatch):
    """``NoRunOutput`` (what ranks other than 0 get) through the same Trainer: the same
    step stats as rank 0's run, no checkpoint and not one file written."""
    config = parse_config(TINY)
    written = train(config, RunDir(tmp_path / "run"), config_filename="test", show_progress=False)
    assert written.checkpoint_steps == [1, 2]  # rank 0's: RunOutput, DeferredCheckpoints

    silent_root = tmp_path / "silent"
    silent_root.mkdir()
    monkeypatch.chdir(silent_root)
    monkeypatch.delenv("MLPERF_MLLOG_FILE", raising=False)
    inputs = check_training_inputs(config, RunDir(silent_root / "unused"), check_output=False)
    with GracefulStop() as stopper:
        trainer = Trainer(config, inputs, NoRunOutput(), stopper, "test", show_progress=False, inline_eval=None)
        trainer.setup()
        try:
            silent = trainer.train()
        finally:
            trainer.close()
    assert _files(silent_root) == []
    assert silent.checkpoint_steps == [] and silent.checkpoint_timings == [] and silent.stop_request is None

    def untimed(stats):
        return dataclasses.replace(stats, weight_update_time_ms=0)

    assert [untimed(s) for s in silent.steps] == [untimed(s) for s in written.steps]


def test_optimize_settings_of_a_config():
    """``OptimizeSettings.of`` reads what the trainer passed as 12 parameters before; a
    log-prob error threshold without the prev log-probs is refused when the settings are made."""
    config = parse_config({"grpo": {"micro_batch_size": 4}, "model": {"dtype": "bfloat16", "compute_dtype": "bfloat16"},
                           "distributed": {"reshard_every_micro_batch": False}})
    g = config.grpo
    assert OptimizeSettings.of(config, compiled=True) == OptimizeSettings(
        4, g.rollout_temperature, PGLossOptions.of(g), config.gradient_clip_norm, g.seq_logprob_error_threshold,
        g.needs_prev_logprobs, torch.bfloat16, width_multiple=8, reshard_every_micro_batch=False,
        micro_batch_tokens=g.micro_batch_tokens, compile_loss=True)
    assert OptimizeSettings.of(config).width_multiple == 1 and not OptimizeSettings.of(config).compile_loss
    with pytest.raises(ValueError, match="needs the prev log-probs"):
        OptimizeSettings(4, 1.0, PGLossOptions(), 1.0, seq_logprob_error_threshold=2.0)
