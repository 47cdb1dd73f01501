"""The evaluator never moves a score that a log already holds (issue 44).

A log with the passing evaluation but no ``run_stop`` is closed at the logged pass (its
checkpoint's weight-update time), not evaluated on; evaluations logged after a pass are
refused; a ``run_stop`` success that no logged evaluation supports is refused in one
line, exit 2, the log untouched.
"""

import json

import pytest
import yaml

from faults_eval_helpers import copy_run, error_lines

from mlperf_grpo.cli import main
from mlperf_grpo.logs.mllog import read_log


def lines_without(log_path, key):
    return [line for line in log_path.read_text().splitlines(keepends=True) if f'"key": "{key}"' not in line]


def test_a_logged_pass_without_run_stop_is_closed_there(finished, tmp_path, capsys):
    run = copy_run(finished, tmp_path / "run")
    (run / "eval" / "summary.json").unlink()
    (run / "mlperf.log").write_text("".join(lines_without(run / "mlperf.log", "run_stop")))
    assert main(["evaluate", str(run), "--retain-checkpoints"]) == 0
    assert "closed it there (run_stop success at its weight-update time), nothing evaluated" in capsys.readouterr().err
    (stop,) = read_log(run / "mlperf.log").find("run_stop")
    (original,) = read_log(finished / "mlperf.log").find("run_stop")
    assert (stop.time_ms, stop.metadata) == (original.time_ms, original.metadata)  # step 20's weight-update time
    assert [e.metadata["step"] for e in read_log(run / "mlperf.log").find("eval_accuracy")] == [18, 19, 20]
    assert json.loads((run / "eval" / "summary.json").read_text())["passing_step"] == 20


def test_evaluations_after_a_logged_pass_without_run_stop_are_refused(finished, tmp_path, capsys):
    run = copy_run(finished, tmp_path / "run")
    (run / "eval" / "summary.json").unlink()
    lines = lines_without(run / "mlperf.log", "run_stop")
    step_20 = [line for line in lines if '"step": 20' in line and '"eval_' in line]
    lines += [line.replace('"step": 20', '"step": 21').replace('"samples_count": 320', '"samples_count": 336')
              for line in step_20]  # an evaluation of step 21 logged after the pass
    (run / "mlperf.log").write_text("".join(lines))
    before = (run / "mlperf.log").read_bytes()
    assert main(["evaluate", str(run), "--retain-checkpoints"]) == 2
    line = error_lines(capsys.readouterr().err)
    assert "logs step 20 passing" in line and "evaluations after it (steps [21])" in line, line
    assert (run / "mlperf.log").read_bytes() == before


def test_a_run_stop_no_evaluation_supports_is_refused(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path / "run")
    stop = {"namespace": "", "time_ms": 1, "event_type": "INTERVAL_END", "key": "run_stop", "value": None,
            "metadata": {"status": "success", "step": 20, "samples_count": 320}}
    with open(run / "mlperf.log", "a") as log:
        log.write(":::MLLOG " + json.dumps(stop) + "\n")
    before = (run / "mlperf.log").read_bytes()
    assert main(["evaluate", str(run), "--retain-checkpoints"]) == 2
    line = error_lines(capsys.readouterr().err)
    assert "has a run_stop success at step 20 but no passing evaluation" in line, line
    assert (run / "mlperf.log").read_bytes() == before and not (run / "eval" / "summary.json").exists()


@pytest.mark.parametrize("content, what", [("", "is empty"), ("a launcher's own notes\n", "holds no MLPerf lines")])
def test_evaluate_of_an_empty_log_names_the_file_and_says_it_is_empty(tmp_path, capsys, content, what):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"division": "open", "validation": {"num_tasks": 8}}))
    (run / "run.json").write_text(json.dumps({"mllog_file": "mlperf.log"}))
    (run / "mlperf.log").write_text(content)
    assert main(["evaluate", str(run)]) == 2
    line = error_lines(capsys.readouterr().err)
    assert f"the MLPerf log {run / 'mlperf.log'} {what}" in line, line


def test_sigterm_after_the_run_stop_does_not_say_no_run_stop(run, capsys, monkeypatch):
    """Issue 44: SIGTERM in the teardown, once run_stop is in the log, said "no run_stop"."""
    from mlperf_grpo.evaluate import offline
    from mlperf_grpo.graceful_stop import Terminated

    def terminated(*args):
        raise Terminated()

    monkeypatch.setattr(offline, "_teardown", terminated)
    assert main(["evaluate", str(run)]) == 143
    err = capsys.readouterr().err
    assert len(read_log(run / "mlperf.log").find("run_stop")) == 1
    assert "no run_stop" not in err and "after the run_stop was logged (the result stands)" in err, err
    assert f"'mlperf-grpo evaluate {run}' finishes the teardown and reports it" in err
