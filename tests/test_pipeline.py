"""End to end: train, evaluate offline, and the official compliance checker on the log."""

import json
import subprocess
import sys

import pytest

from mlperf_grpo.cli import main
from mlperf_grpo.mllog import read_log

pytestmark = pytest.mark.slow


def official_check(log_path):
    out = subprocess.run(
        [sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training", "--ruleset", "6.1.0", str(log_path)],
        capture_output=True, text=True, cwd=log_path.parent,
    )
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "default"
    assert main(["run", "--output", str(out), "--retain-checkpoints"]) == 0
    return out


def test_default_run_log_passes_the_official_checker(default_run):
    text = official_check(default_run / "mlperf.log")
    assert "SUCCESS" in text, text


def test_default_run_backdates_run_stop_to_the_passing_checkpoint(default_run):
    log = read_log(default_run / "mlperf.log")
    stops = log.find("run_stop")
    assert len(stops) == 1 and stops[0].metadata["status"] == "success"
    evals = log.find("eval_accuracy")
    steps = [e.metadata["step"] for e in evals]
    assert steps == list(range(18, 18 + len(steps)))  # starts at S0 = 18, contiguous
    assert [e.metadata["samples_count"] for e in evals] == [s * 256 for s in steps]
    assert all(e.value <= 0.69 for e in evals[:-1]) and evals[-1].value > 0.69
    assert len(evals) >= 2, "calibration: at least one failing checkpoint before the pass"
    passing = steps[-1]
    info = json.loads((default_run / "checkpoints" / f"step_{passing}" / "training_info.json").read_text())
    assert stops[0].time_ms == info["training_step_end_time_ms"]
    assert stops[0].line_no > evals[-1].line_no  # written last, backdated
    block_stop = [e for e in log.find("block_stop") if e.metadata["step"] == passing][0]
    assert stops[0].time_ms <= block_stop.time_ms


def test_evaluate_again_writes_nothing(default_run, capsys):
    before = (default_run / "mlperf.log").read_bytes()
    assert main(["evaluate", str(default_run)]) == 0
    assert (default_run / "mlperf.log").read_bytes() == before
    assert "status: success" in capsys.readouterr().out


def test_aborted_path_train_then_evaluate(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("grpo: {max_steps: 19}\nvalidation: {target_accuracy: 0.99}\n")
    run = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--output", str(run)]) == 0
    assert read_log(run / "mlperf.log").find("run_stop") == []  # the trainer writes none
    final = json.loads((run / "checkpoints" / "step_19" / "training_info.json").read_text())
    assert main(["evaluate", str(run)]) == 3
    assert "status: aborted" in capsys.readouterr().out
    log = read_log(run / "mlperf.log")
    stop = log.find("run_stop")
    assert len(stop) == 1 and stop[0].metadata["status"] == "aborted"
    assert stop[0].time_ms == final["training_step_end_time_ms"]
    assert [e.metadata["step"] for e in log.find("eval_accuracy")] == [18, 19]
    assert not (run / "checkpoints").exists()  # removed at teardown


def test_bad_inputs_exit_2_with_one_line(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("grpo: {max_stepz: 3}\n")
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "r")]) == 2
    assert main(["evaluate", str(tmp_path / "nowhere")]) == 2
    # A run directory whose training wrote no checkpoints (stopped before step 18).
    cfg.write_text("grpo: {max_steps: 2}\n")
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "short")]) == 0
    assert main(["evaluate", str(tmp_path / "short")]) == 2
    # A log path that cannot be written.
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("MLPERF_MLLOG_FILE", str(blocker / "log.txt"))
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "r2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("mlperf-grpo: error:")]
    assert len(errors) == 4 and "Traceback" not in "\n".join(err)
    assert "unknown key 'grpo.max_stepz'" in errors[0]
    assert "no step_N checkpoints" in errors[2]
    assert "cannot write MLPerf log" in errors[3]
