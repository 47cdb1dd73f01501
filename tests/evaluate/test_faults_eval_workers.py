"""Fault injection on the offline evaluator (issue 5, evaluator side), N workers committed in step
order: their log equals one worker's, and the evaluator killed or stopped with its workers leaves
nothing running and resumes. The runs are copies of the default run that ``conftest.py`` makes once
(``finished``, ``trained``, ``run``).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from faults_eval_helpers import (
    copy_run,
    count_evals,
    eval_steps,
    evaluate_with,
    normalized,
    read_results,
    wait_for,
)

from mlperf_grpo.logs.mllog import read_log

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- 8. N workers, committed in step order

def never_passing(trained, dst):
    """The trained run cut after step_19 (as if training had published up to it): no
    checkpoint passes (step 20 is the first that does)."""
    run = copy_run(trained, dst)
    for step in range(20, 31):
        shutil.rmtree(run / "checkpoints" / f"step_{step}")
    end = json.loads((run / "checkpoints" / "training_end.json").read_text())
    (run / "checkpoints" / "training_end.json").write_text(json.dumps({**end, "last_published_step": 19}))
    return run


def descendants(pid):
    """Every live process below ``pid`` (Linux /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found




def test_two_workers_log_equals_one_workers_pass_at_the_3rd_checkpoint(trained, finished, tmp_path):
    run = copy_run(trained, tmp_path / "two")
    assert evaluate_with(run, 2) == normalized(finished / "mlperf.log")
    assert eval_steps(run / "mlperf.log") == [18, 19, 20]
    for step in (18, 19, 20):  # the logged results moved out of eval/unlogged/, the same bytes as serial
        assert read_results(run / "eval" / f"step_{step}.jsonl") == read_results(finished / "eval" / f"step_{step}.jsonl")
    assert sorted(p.name for p in (run / "eval").glob("step_*.jsonl")) == [f"step_{s}.jsonl" for s in (18, 19, 20)]
    assert all(int(p.stem.split("_")[1]) > 20 for p in (run / "eval" / "unlogged").glob("*.jsonl"))
    startups = [json.loads(l) for l in (run / "eval" / "startup.jsonl").read_text().splitlines()]
    assert sorted(s["rank"] for s in startups) == [0, 1]  # each rank warmed up its engine, launched by the evaluator
    assert all(s["launch_unix_s"] <= s["start_unix_s"] and s["warm_up_s"] > 0 for s in startups)


def test_more_workers_than_pending_checkpoints_start_one_per_checkpoint(trained, tmp_path, monkeypatch, capsys):
    """``--workers 64`` with one checkpoint to evaluate evaluates it with one worker here
    and launches no ranks (a worker beyond the pending checkpoints would claim nothing;
    64 engines would exhaust the machine), says so in one note, and logs what one worker
    logs."""
    from mlperf_grpo.evaluate import offline

    def only_step_18(dst):
        run = never_passing(trained, dst)
        shutil.rmtree(run / "checkpoints" / "step_19")
        end = json.loads((run / "checkpoints" / "training_end.json").read_text())
        (run / "checkpoints" / "training_end.json").write_text(json.dumps({**end, "last_published_step": 18}))
        return run

    one, many = only_step_18(tmp_path / "one"), only_step_18(tmp_path / "many")
    launched = []
    monkeypatch.setattr(offline, "launch", lambda entrypoint, args, nprocs: launched.append(nprocs) or {})
    assert evaluate_with(many, 64) == evaluate_with(one, 1)
    assert launched == []
    assert "note: 1 checkpoint(s) to evaluate: 1 worker(s), not 64" in capsys.readouterr().err
    assert eval_steps(many / "mlperf.log") == [18]


def test_two_workers_log_equals_one_workers_when_nothing_passes(trained, tmp_path):
    one, two = never_passing(trained, tmp_path / "one"), never_passing(trained, tmp_path / "two")
    assert evaluate_with(one, 1) == evaluate_with(two, 2)
    log = read_log(two / "mlperf.log")
    assert eval_steps(two / "mlperf.log") == [18, 19]
    assert [(e.metadata["status"], e.metadata["step"]) for e in log.find("run_stop")] == [("aborted", 19)]


def spawn_two_worker_evaluate(run, err_path):
    """``evaluate RUN --workers 2`` in its own process group (as a terminal's foreground
    job: Ctrl-C reaches the whole group), stderr to ``err_path``."""
    with open(err_path, "w") as err:
        return subprocess.Popen([sys.executable, "-m", "mlperf_grpo.cli", "evaluate", str(run), "--retain-checkpoints",
                                 "--workers", "2"], stdout=subprocess.DEVNULL, stderr=err,
                                preexec_fn=lambda: (signal.signal(signal.SIGINT, signal.SIG_DFL), os.setpgrp()))


def running(pid):
    """``pid`` exists and is not a zombie."""
    try:
        return "Z" not in open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1][:3]
    except OSError:
        return False


def seconds_until_gone(pids, since, timeout_s=60.0):
    """Seconds from ``since`` (monotonic) until none of ``pids`` runs (zombies count as gone)."""
    while any(running(pid) for pid in pids):
        assert time.monotonic() - since < timeout_s, "a process outlived the evaluator by a minute"
        time.sleep(0.01)
    return time.monotonic() - since


def stderr_lines(path):
    """stderr's lines without the progress bar's redraws."""
    lines = path.read_text().replace("\r", "\n").splitlines()
    return [line.split("]", 1)[1] if line.startswith("evaluate:") and "]" in line else line
            for line in lines if line.strip() and not (line.startswith("evaluate:") and line.rstrip().endswith("]"))]


def test_killed_two_worker_evaluation_resumes_with_one_worker_to_the_same_log(trained, finished, tmp_path):
    """SIGKILL of the evaluator after its first commit: its ranks (forked from the fork
    server, which is not the evaluator), their reward workers and the fork server stop
    within a second, before printing anything (no store error, no traceback); only the
    resource tracker's note on the killed evaluator's own semaphores (torch's launcher)
    follows; resumed with one worker, the log is the serial one."""
    run = copy_run(trained, tmp_path / "run")
    proc = spawn_two_worker_evaluate(run, tmp_path / "killed.err")
    assert wait_for(lambda: count_evals(run) >= 1, proc), "the evaluator exited before its first commit"
    processes = descendants(proc.pid)
    assert len(processes) >= 4, "no worker ranks were started"  # fork server, resource tracker, 2 ranks, reward workers
    killed = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    tracker = {pid for pid in processes if "resource_tracker" in open(f"/proc/{pid}/cmdline").read()}
    assert seconds_until_gone(processes - tracker, killed) < 1.0
    seconds_until_gone(tracker, killed)
    after_kill = stderr_lines(tmp_path / "killed.err")
    assert not [line for line in after_kill if "leaked semaphore" not in line and "warnings.warn(" not in line], after_kill
    cut = (run / "mlperf.log").read_text()
    assert not read_log(run / "mlperf.log").find("run_stop")
    assert evaluate_with(run, 1) == normalized(finished / "mlperf.log")
    assert (run / "mlperf.log").read_text().startswith(cut)


@pytest.mark.parametrize("signum, code, name", [(signal.SIGTERM, 143, "stopped by SIGTERM"),
                                                (signal.SIGINT, 130, "interrupted (Ctrl-C)")])
def test_signal_during_two_worker_evaluate_prints_one_line_and_leaves_nothing_running(trained, finished, tmp_path,
                                                                                      signum, code, name):
    """SIGTERM to the evaluator, or Ctrl-C to its whole process group (as a terminal
    sends it: the ranks get it too), after its first commit: our one line and nothing
    else (no launcher warning, no leaked-semaphore warning: a rank's progress-bar lock is
    a thread lock), the fork server and the ranks gone within a second of the
    evaluator's exit, and the run resumes to the uninterrupted log."""
    run = copy_run(trained, tmp_path / "run")
    proc = spawn_two_worker_evaluate(run, tmp_path / "stopped.err")
    assert wait_for(lambda: count_evals(run) >= 1, proc), "the evaluator exited before its first commit"
    processes = descendants(proc.pid)
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    assert proc.wait(timeout=60) == code
    assert seconds_until_gone(processes, time.monotonic()) < 1.0
    assert stderr_lines(tmp_path / "stopped.err") == [
        f"mlperf-grpo: evaluation {name}; the log holds only whole evaluations (no partial one, no run_stop): "
        f"'mlperf-grpo evaluate {run}' resumes it"]
    log = read_log(run / "mlperf.log")
    assert not log.bad_lines and not log.find("run_stop") and (run / "checkpoints" / "step_30").is_dir()
    assert evaluate_with(run, 2) == normalized(finished / "mlperf.log")
