"""Training-side faults, injected for real: SIGKILL, a full disk, a write error, SIGTERM.

Each test runs the real code in a child process and hurts it from outside (a signal at
a chosen moment, a filesystem too small, a file-size limit), then checks what is left.
"""

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mlperf_grpo.checkpoint import discover_checkpoints, sha256_file
from mlperf_grpo.mllog import read_log
from mlperf_grpo.train.stop import GracefulStop, Terminated

pytestmark = pytest.mark.slow
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


def assert_published_checkpoints_intact(root: Path) -> list[int]:
    """Every step_N/ is complete: its record parses and its weights match their sha256."""
    found, _ = discover_checkpoints(root)
    for c in found:
        for name, meta in c.info.weights.items():
            assert sha256_file(c.path / name) == meta["sha256"], c.path
        assert c.info.current_step == c.step
    return [c.step for c in found]


WRITER = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from mlperf_grpo.checkpoint import TrainingInfo, write_checkpoint
    root = Path(sys.argv[1])
    state = {"w": torch.randn(4_000_000)}  # 16 MB: a write takes long enough to be hit
    print("ready", flush=True)
    for step in range(18, 1000):
        info = TrainingInfo(step, step * 16, 1000 + step, step * 256, 256, 16, "float32", {}, [0.0])
        write_checkpoint(root, state, info)
    """
)


@pytest.mark.parametrize("delay_s", [0.05, 0.21, 0.47])
def test_sigkill_while_writing_checkpoints_leaves_only_complete_ones(tmp_path, delay_s):
    root = tmp_path / "checkpoints"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root)], stdout=subprocess.PIPE, env=ENV, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(delay_s)
    proc.kill()
    proc.wait()
    steps = assert_published_checkpoints_intact(root)
    assert steps == list(range(18, 18 + len(steps)))  # no hole, previous ones intact
    # An interrupted tmp_step_N/ may remain; discovery never returns it as a checkpoint.
    leftovers = [p.name for p in root.iterdir() if p.name.startswith("tmp_step_")]
    assert all(int(n.removeprefix("tmp_step_")) not in steps for n in leftovers)


def _train(run: Path, config: Path, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "mlperf_grpo.cli", "train", "--config", str(config), "--output", str(run)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, text=True, **popen,
    )


def _config(tmp_path: Path, max_steps: int = 22) -> Path:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"grpo: {{max_steps: {max_steps}}}\n")
    return cfg


def _wait_for(predicate, timeout_s=600.0):
    deadline = time.time() + timeout_s
    while not predicate():
        assert time.time() < deadline, "timed out waiting"
        time.sleep(0.005)


def test_sigkill_trainer_then_evaluate_uses_only_complete_checkpoints(tmp_path):
    run = tmp_path / "run"
    proc = _train(run, _config(tmp_path, max_steps=30))
    _wait_for(lambda: (run / "checkpoints" / "step_19").is_dir())
    proc.kill()
    proc.wait()
    steps = assert_published_checkpoints_intact(run / "checkpoints")
    assert steps[0] == 18
    out = subprocess.run([sys.executable, "-m", "mlperf_grpo.cli", "evaluate", str(run)], capture_output=True, text=True, env=ENV)
    assert out.returncode in (0, 3), out.stderr
    evaluated = [e.metadata["step"] for e in read_log(run / "mlperf.log").find("eval_accuracy")]
    assert set(evaluated) <= set(steps)


def _check_write_failure(run: Path, proc: subprocess.Popen, published: list[int]) -> None:
    """A failed checkpoint write: exit 1, one error line naming the path and the bytes;
    with ``published`` checkpoints the log has no run_stop (the evaluator's) and a note
    says how to finish the run, with none the trainer closed it with run_stop aborted."""
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, err
    errors = [line for line in err.strip().splitlines() if line.startswith("mlperf-grpo:")]
    assert len(errors) == 1 and errors[0].startswith("mlperf-grpo: error: cannot write checkpoint") and "Traceback" not in err
    assert "bytes" in errors[0] and "tmp_step_" in errors[0]
    assert assert_published_checkpoints_intact(run / "checkpoints") == published
    assert not list((run / "checkpoints").glob("tmp_step_*"))
    log = read_log(run / "mlperf.log")
    stops = log.find("run_stop")
    if published:
        assert stops == [] and f"mlperf-grpo evaluate {run}" in err
    else:
        assert len(stops) == 1 and stops[0].metadata["status"] == "aborted"
        assert log.events[-1].key == "run_stop"


def test_full_disk_stops_training_and_leaves_the_result_to_the_evaluator(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    # 1.5 MB: the log, the config and two 0.5 MB checkpoints fit; the third does not.
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        run = disk / "run"
        _check_write_failure(run, _train(run, _config(tmp_path)), published=[18, 19])
    finally:
        subprocess.run(["umount", str(disk)])


def _limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.RLIM_INFINITY))


def test_write_error_stops_training_with_aborted_run_stop(tmp_path):
    run = tmp_path / "run"
    # Every checkpoint (0.5 MB) exceeds the 200 kB file-size limit; the log does not.
    _check_write_failure(run, _train(run, _config(tmp_path), preexec_fn=_limit_file_size), published=[])


def _last_block_stop(log):
    return log.find("block_stop")[-1]


def test_sigterm_before_the_first_checkpoint_closes_the_run_as_aborted(tmp_path):
    """No checkpoint published: the trainer writes run_stop aborted at its last trained
    step (that step's block_stop time), exit 143, one line naming SIGTERM."""
    run = tmp_path / "run"
    proc = _train(run, _config(tmp_path, max_steps=30))
    _wait_for(lambda: (run / "mlperf.log").is_file() and '"step": 3' in (run / "mlperf.log").read_text())
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 143, err
    assert "SIGTERM" in err.strip().splitlines()[-1] and "Traceback" not in err
    log = read_log(run / "mlperf.log")
    (stop,) = log.find("run_stop")
    assert log.events[-1] == stop and stop.metadata["status"] == "aborted"
    last = _last_block_stop(log)
    assert (stop.metadata["step"], stop.metadata["samples_count"], stop.time_ms) == (
        last.metadata["step"], last.metadata["step"] * 256, last.time_ms)
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


def test_sigterm_after_checkpoints_leaves_the_result_to_the_evaluator(tmp_path):
    """Issue 8's case: SIGTERM once step_22/ exists. The trainer writes no run_stop;
    `evaluate` evaluates the published series and finds the pass at step 21 (as after a
    SIGKILL), and nothing it did not evaluate is lost to an early teardown."""
    run = tmp_path / "run"
    proc = _train(run, _config(tmp_path, max_steps=30))
    _wait_for(lambda: (run / "checkpoints" / "step_22").is_dir(), timeout_s=1800)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 143, err
    lines = [line for line in err.strip().splitlines() if line.startswith(("mlperf-grpo:", "note:"))]
    assert lines[0].startswith("mlperf-grpo: stopped by SIGTERM") and "Traceback" not in err
    assert lines[1].startswith("note:") and f"'mlperf-grpo evaluate {run}'" in lines[1]
    assert read_log(run / "mlperf.log").find("run_stop") == []  # the evaluator's to write
    assert not list((run / "checkpoints").glob("tmp_step_*"))  # finished, not torn
    published = assert_published_checkpoints_intact(run / "checkpoints")
    assert published[0] == 18 and published[-1] >= 22
    step21 = json.loads((run / "checkpoints" / "step_21" / "training_info.json").read_text())

    out = subprocess.run([sys.executable, "-m", "mlperf_grpo.cli", "evaluate", str(run)], capture_output=True, text=True, env=ENV)
    assert out.returncode == 0, out.stderr
    assert "status: success" in out.stdout and "passing step: 21" in out.stdout
    log = read_log(run / "mlperf.log")
    assert [e.metadata["step"] for e in log.find("eval_accuracy")] == [18, 19, 20, 21]
    (stop,) = log.find("run_stop")
    assert stop.metadata["status"] == "success" and stop.time_ms == step21["training_step_end_time_ms"]


def test_sigterm_inside_a_checkpoint_write_waits_for_it():
    reached_end_of_write = False
    with pytest.raises(Terminated, match="after finishing the checkpoint"):
        with GracefulStop() as stopper:
            with stopper.deferred():
                os.kill(os.getpid(), signal.SIGTERM)  # a real signal, mid "write"
                time.sleep(0.01)
                reached_end_of_write = True
    assert reached_end_of_write
    with pytest.raises(Terminated):
        with GracefulStop():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)


def test_training_info_records_weight_sha256(tmp_path):
    run = tmp_path / "run"
    proc = _train(run, _config(tmp_path, max_steps=18))
    proc.communicate(timeout=600)
    assert proc.returncode == 0
    info = json.loads((run / "checkpoints" / "step_18" / "training_info.json").read_text())
    assert info["weights"]["model.safetensors"]["sha256"] == sha256_file(run / "checkpoints" / "step_18" / "model.safetensors")
