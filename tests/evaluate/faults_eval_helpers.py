"""Helpers of the evaluator's fault tests (``test_faults_eval_*.py``): copies of a run, its log
normalized for comparison, evaluator subprocesses and polls with a deadline, training_info.json
edits.
"""

import json
import shutil
import signal
import subprocess
import sys
import time

from mlperf_grpo.cli import main
from mlperf_grpo.logs.mllog import PREFIX, read_log

EVAL_KEYS = ("eval_start", "eval_accuracy", "eval_stop", "run_stop")


def copy_run(src, dst):
    """Copy a run directory and point its run.json at the copy's own log."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock"))
    (dst / "run.json").write_text(json.dumps({"mllog_file": str(dst / "mlperf.log")}) + "\n")
    return dst


def normalized(log_path):
    """Every line of the log, MLLOG lines parsed with time_ms dropped (all else kept)."""
    out = []
    for line in log_path.read_text().splitlines():
        if PREFIX in line:
            d = json.loads(line.split(PREFIX, 1)[1])
            d.pop("time_ms")
            out.append(d)
        else:
            out.append(line)
    return out


def eval_steps(log_path):
    return [e.metadata["step"] for e in read_log(log_path).find("eval_accuracy")]


def has_eval_events(log_path):
    return any(e.key in EVAL_KEYS for e in read_log(log_path).events)


def error_lines(err):
    """The CLI's error lines; asserts there is exactly one and no traceback."""
    lines = [l for l in err.splitlines() if l.startswith("mlperf-grpo:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def spawn_evaluate(run, out_name):
    out = open(run.parent / f"{out_name}.out", "w")
    err = open(run.parent / f"{out_name}.err", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlperf_grpo.cli", "evaluate", str(run), "--retain-checkpoints"],
        stdout=out, stderr=err,
        # Ctrl-C's default, as in a terminal's foreground job: a test runner started in the
        # background of a shell inherits SIGINT ignored, and Python then keeps ignoring it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    out.close()
    err.close()
    return proc


def wait_for(predicate, proc, timeout_s=600.0):
    """Poll every 10 ms until ``predicate()``; False if ``proc`` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.01)
    raise AssertionError("timed out waiting for the evaluator")


def lock_held_by(run, pid):
    lock = run / ".lock"
    return lock.is_file() and f"pid {pid})" in lock.read_text()


def count_evals(run):
    log = run / "mlperf.log"
    return log.read_text().count('"key": "eval_stop"')


def read_results(path):
    lines = path.read_text().splitlines()
    return json.loads(lines[0]), [json.loads(l) for l in lines[1:]]


def set_info(run, step, **fields):
    path = run / "checkpoints" / f"step_{step}" / "training_info.json"
    info = json.loads(path.read_text())
    info.update(fields)
    path.write_text(json.dumps(info, indent=2))


def info_of(run, step):
    return json.loads((run / "checkpoints" / f"step_{step}" / "training_info.json").read_text())



SHARD = "model-00001-of-00001.safetensors"


def flip_byte(run, step):
    """Flip one weight byte (the safetensors header stays valid)."""
    path = run / "checkpoints" / f"step_{step}" / SHARD
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def evaluate_with(run, workers):
    assert main(["evaluate", str(run), "--retain-checkpoints", "--workers", str(workers)]) in (0, 3)
    return normalized(run / "mlperf.log")
