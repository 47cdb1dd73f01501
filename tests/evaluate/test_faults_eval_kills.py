"""Fault injection on the offline evaluator (issue 5, evaluator side), kills: SIGKILL at chosen points
and SIGTERM / Ctrl-C, each resumed to the uninterrupted log; kills are real signals to ``python -m
mlperf_grpo.cli evaluate`` subprocesses. The runs are copies of the default run that ``conftest.py``
makes once (``finished``, ``trained``, ``run``).
"""

import json
import shutil
import signal
import time

import pytest
from faults_eval_helpers import (
    SHARD,
    copy_run,
    count_evals,
    error_lines,
    eval_steps,
    lock_held_by,
    normalized,
    read_results,
    spawn_evaluate,
    wait_for,
)

from mlperf_grpo.cli import main
from mlperf_grpo.logs.mllog import read_log

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- 1. resumable, idempotent

def test_sigkilled_evaluator_resumes_to_the_uninterrupted_log(run, finished):
    """SIGKILL at two startup delays, once the lock is held (0 evals logged), and right
    after the 1st and 2nd eval triples; then run to completion. A leftover tmp_step_31/
    is ignored with a note each time."""
    shutil.copytree(run / "checkpoints" / "step_30", run / "checkpoints" / "tmp_step_31")
    (run / "checkpoints" / "tmp_step_31" / SHARD).write_bytes(b"half-written")
    kill_points = [
        ("0.5 s after start", lambda proc, t0: time.monotonic() - t0 >= 0.5),
        ("1.5 s after start", lambda proc, t0: time.monotonic() - t0 >= 1.5),
        ("lock taken, no eval logged", lambda proc, t0: lock_held_by(run, proc.pid)),
        ("after the 1st eval triple", lambda proc, t0: count_evals(run) >= 1),
        ("after the 2nd eval triple", lambda proc, t0: count_evals(run) >= 2),
    ]
    logged, spawned = [], {}  # pid -> Unix time it was spawned
    for i, (name, ready) in enumerate(kill_points):
        t0 = time.monotonic()
        spawned_unix_s = time.time()
        proc = spawn_evaluate(run, f"killed{i}")
        spawned[proc.pid] = spawned_unix_s
        assert wait_for(lambda: ready(proc, t0), proc), f"{name}: evaluator exited before the kill point"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL, name
        log = read_log(run / "mlperf.log")
        assert not log.bad_lines and not log.find("run_stop"), name
        steps = eval_steps(run / "mlperf.log")
        assert steps == list(range(18, 18 + len(steps))), name  # a contiguous prefix, no duplicates
        logged.append(len(steps))
    # 0.5 s is still in start-up; each later kill point is at or past the previous one
    assert logged[0] == 0 and logged == sorted(logged) and logged[3] >= 1 and logged[4] >= 2, logged

    spawned_unix_s = time.time()
    proc = spawn_evaluate(run, "final")
    spawned[proc.pid] = spawned_unix_s
    assert proc.wait() == 0
    assert "note: ignoring unfinished checkpoint" in (run.parent / "final.err").read_text()
    assert "status: success" in (run.parent / "final.out").read_text()
    assert normalized(run / "mlperf.log") == normalized(finished / "mlperf.log")
    log = read_log(run / "mlperf.log")
    assert len(log.find("run_stop")) == 1
    assert log.find("run_stop")[0].time_ms == read_log(finished / "mlperf.log").find("run_stop")[0].time_ms
    for key in ("eval_start", "eval_accuracy", "eval_stop"):
        assert [e.metadata["step"] for e in log.find(key)] == [18, 19, 20]
    for step in (18, 19, 20):  # per-task results too, whichever process wrote them
        assert read_results(run / "eval" / f"step_{step}.jsonl") == read_results(finished / "eval" / f"step_{step}.jsonl")
    # eval/startup.jsonl and eval/timing.jsonl grew across the attempts; each line names its process
    for name in ("startup.jsonl", "timing.jsonl"):
        for line in map(json.loads, (run / "eval" / name).read_text().splitlines()):
            assert line["pid"] in spawned, (name, line)
            assert abs(line["process_start_unix_s"] - spawned[line["pid"]]) < 5.0, (name, line)
    startups = [json.loads(l) for l in (run / "eval" / "startup.jsonl").read_text().splitlines()]
    assert startups[-1]["pid"] == proc.pid and len({(s["pid"], s["process_start_unix_s"]) for s in startups}) == len(startups)


def test_evaluate_on_a_finished_run_reports_and_writes_nothing(finished, tmp_path, capsys):
    run = copy_run(finished, tmp_path / "run")
    before = (run / "mlperf.log").read_bytes()
    assert main(["evaluate", str(run)]) == 0
    out = capsys.readouterr().out
    assert "status: success" in out and "passing step: 20" in out
    assert (run / "mlperf.log").read_bytes() == before


@pytest.mark.parametrize("signum, code, name", [(signal.SIGTERM, 143, "stopped by SIGTERM"), (signal.SIGINT, 130, "interrupted (Ctrl-C)")])
def test_signal_during_evaluate_stops_cleanly_and_resumes(run, finished, signum, code, name):
    """SIGTERM (like Ctrl-C) after the first eval triple: a documented exit code, one
    line, only whole evaluations in the log, no run_stop, nothing deleted; then resumable."""
    proc = spawn_evaluate(run, "stopped")
    assert wait_for(lambda: count_evals(run) >= 1, proc)
    proc.send_signal(signum)
    assert proc.wait() == code
    line = error_lines((run.parent / "stopped.err").read_text())
    assert line == (f"mlperf-grpo: evaluation {name}; the log holds only whole evaluations (no partial one, "
                    f"no run_stop): 'mlperf-grpo evaluate {run}' resumes it")
    log = read_log(run / "mlperf.log")
    assert not log.bad_lines and not log.find("run_stop")
    steps = eval_steps(run / "mlperf.log")
    assert steps and [e.metadata["step"] for e in log.find("eval_stop")] == steps == list(range(18, 18 + len(steps)))
    assert (run / "checkpoints" / "step_30").is_dir()
    assert spawn_evaluate(run, "resumed").wait() == 0
    assert normalized(run / "mlperf.log") == normalized(finished / "mlperf.log")
