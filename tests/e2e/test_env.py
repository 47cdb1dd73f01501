"""The reference launcher's environment variables: DEFERRED_OFFLINE_EVAL, MLPERF_MLLOG_FILE."""

import yaml
from mlperf_logging.mllog import constants as C  # noqa: N812

from mlperf_grpo.cli import main
from mlperf_grpo.logs.mllog import read_log

SMALL_OPEN = {
    "division": "open",
    "grpo": {"num_prompts_per_step": 4, "max_steps": 2, "first_eval_step": 1},
    "validation": {"num_tasks": 10},  # 5 of these 10 pass at step 18: below the target
}


def _config(tmp_path):
    cfg = tmp_path / "small.yaml"
    cfg.write_text(yaml.safe_dump(SMALL_OPEN))
    return str(cfg)


def test_inline_eval_logs_every_step_and_aborts_at_the_last_eval(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DEFERRED_OFFLINE_EVAL", "0")
    run = tmp_path / "run"
    assert main(["run", "--config", _config(tmp_path), "--output", str(run)]) == 3  # aborted
    assert "note: open division" in capsys.readouterr().out
    log = read_log(run / "mlperf.log")
    evals = log.find(C.EVAL_ACCURACY)
    assert [e.metadata["samples_count"] for e in evals] == [64, 128]
    (stop,) = log.find(C.RUN_STOP)
    assert stop.metadata[C.STATUS] == C.ABORTED
    assert stop.time_ms == log.find(C.EVAL_STOP)[-1].time_ms
    assert stop.line_no > log.find(C.BLOCK_STOP)[-1].line_no
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
    assert (run / "eval" / "step_2.jsonl").is_file()


def test_mllog_file_env_gets_both_phases(tmp_path, monkeypatch):
    target = tmp_path / "elsewhere" / "launcher.log"
    monkeypatch.setenv("MLPERF_MLLOG_FILE", str(target))
    run = tmp_path / "run"
    assert main(["train", "--config", _config(tmp_path), "--output", str(run)]) == 0
    monkeypatch.delenv("MLPERF_MLLOG_FILE")
    assert main(["evaluate", str(run)]) == 3
    assert not (run / "mlperf.log").exists()
    log = read_log(target)
    assert log.find(C.RUN_START) and len(log.find(C.EVAL_ACCURACY)) == 2 and log.find(C.RUN_STOP)
