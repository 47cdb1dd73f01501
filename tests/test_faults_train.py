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
from mlperf_grpo.train.stop import GracefulStop, TrainingStopped

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


def _check_write_failure(run: Path, proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("mlperf-grpo: error: cannot write checkpoint") and "Traceback" not in err
    assert "bytes" in lines[-1] and "tmp_step_" in lines[-1]
    log = read_log(run / "mlperf.log")
    stops = log.find("run_stop")
    assert len(stops) == 1 and stops[0].metadata["status"] == "aborted"
    assert log.events[-1].key == "run_stop"
    assert_published_checkpoints_intact(run / "checkpoints")
    assert not list((run / "checkpoints").glob("tmp_step_*"))


def test_full_disk_stops_training_with_aborted_run_stop(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    # 1.5 MB: the log, the config and two 0.5 MB checkpoints fit; the third does not.
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        run = disk / "run"
        _check_write_failure(run, _train(run, _config(tmp_path)))
        assert assert_published_checkpoints_intact(run / "checkpoints") == [18, 19]
    finally:
        subprocess.run(["umount", str(disk)])


def _limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.RLIM_INFINITY))


def test_write_error_stops_training_with_aborted_run_stop(tmp_path):
    run = tmp_path / "run"
    # Every checkpoint (0.5 MB) exceeds the 200 kB file-size limit; the log does not.
    _check_write_failure(run, _train(run, _config(tmp_path), preexec_fn=_limit_file_size))
    assert assert_published_checkpoints_intact(run / "checkpoints") == []


@pytest.mark.parametrize("moment", ["before_first_checkpoint", "during_checkpoints"])
def test_sigterm_stops_cleanly(tmp_path, moment):
    run = tmp_path / "run"
    proc = _train(run, _config(tmp_path, max_steps=30))
    if moment == "before_first_checkpoint":
        _wait_for(lambda: (run / "mlperf.log").is_file() and '"step": 3' in (run / "mlperf.log").read_text())
    else:
        _wait_for(lambda: (run / "checkpoints").is_dir() and any((run / "checkpoints").iterdir()))
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 1
    assert "SIGTERM" in err.strip().splitlines()[-1] and "Traceback" not in err
    log = read_log(run / "mlperf.log")
    assert log.events[-1].key == "run_stop" and log.events[-1].metadata["status"] == "aborted"
    assert len(log.find("run_stop")) == 1
    if (run / "checkpoints").exists():
        assert not list((run / "checkpoints").glob("tmp_step_*"))  # finished, not torn
        assert_published_checkpoints_intact(run / "checkpoints")


def test_sigterm_inside_a_checkpoint_write_waits_for_it():
    reached_end_of_write = False
    with pytest.raises(TrainingStopped, match="after finishing the checkpoint"):
        with GracefulStop() as stopper:
            with stopper.deferred():
                os.kill(os.getpid(), signal.SIGTERM)  # a real signal, mid "write"
                time.sleep(0.01)
                reached_end_of_write = True
    assert reached_end_of_write
    with pytest.raises(TrainingStopped):
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
