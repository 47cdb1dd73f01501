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
import xxhash

from mlperf_grpo.checkpoint import discover_checkpoints, read_training_end, read_weights
from mlperf_grpo.config.load import load_config
from mlperf_grpo.evaluate.series import check_series
from mlperf_grpo.graceful_stop import GracefulStop, Terminated
from mlperf_grpo.logs.mllog import read_log
from mlperf_grpo.model.files import BUILTIN_MODEL_DIR
from mlperf_grpo.tasks import load_validation_set

pytestmark = pytest.mark.slow
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


def assert_published_checkpoints_intact(root: Path) -> list[int]:
    """Every step_N/ is complete: its record parses and its shards match their hashes."""
    found, _ = discover_checkpoints(root)
    for c in found:
        assert read_weights(c), c.path  # raises CheckpointCorruptError on a hash mismatch
        assert c.info.current_step == c.step
    return [c.step for c in found]


WRITER = textwrap.dedent(
    """
    import sys, time, torch
    from pathlib import Path
    from mlperf_grpo.checkpoint import AsyncCheckpointer, TrainingInfo
    from mlperf_grpo.model.files import BUILTIN_MODEL_DIR
    root = Path(sys.argv[1])
    state = {"w": torch.randn(4_000_000)}  # 16 MB: a write takes long enough to be hit
    writer = AsyncCheckpointer(root, BUILTIN_MODEL_DIR, max_in_flight=2)
    print("ready", flush=True)
    for step in range(18, 1000):
        info = TrainingInfo(step, step * 16, 1000 + step, step * 256, 256, 16, "float32", [0.0])
        writer.save(state, info)  # background writes, two in flight
    """
)


@pytest.mark.parametrize("delay_s", [0.05, 0.21, 0.47])
def test_sigkill_during_background_writes_leaves_only_complete_ones(tmp_path, delay_s):
    root = tmp_path / "checkpoints"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root)], stdout=subprocess.PIPE, env=ENV, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(delay_s)
    proc.kill()
    proc.wait()
    steps = assert_published_checkpoints_intact(root)
    assert steps == list(range(18, 18 + len(steps)))  # no hole, previous ones intact
    # An interrupted tmp_step_N/ may remain; discovery never returns it as a checkpoint.
    leftovers = [p.name for p in root.iterdir() if p.name.startswith("tmp_step_")] if root.exists() else []
    assert all(int(n.removeprefix("tmp_step_")) not in steps for n in leftovers)
    assert read_training_end(root) is None if root.exists() else True


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


SLOW_WRITES = textwrap.dedent(
    """
    import sys, time
    from mlperf_grpo.checkpoint.writer import AsyncCheckpointer
    from mlperf_grpo.cli import main
    real = AsyncCheckpointer._write_shard
    def write_shard(path, shard, slot):
        time.sleep(2.0)
        return real(path, shard, slot)
    AsyncCheckpointer._write_shard = staticmethod(write_shard)
    sys.exit(main(sys.argv[1:]))
    """
)


def test_sigkill_trainer_then_evaluate_uses_only_complete_checkpoints(tmp_path):
    run = tmp_path / "run"
    # a slow disk (each shard write takes 2 s), killed while a background write is in flight
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_WRITES, "train", "--config", str(_config(tmp_path, max_steps=30)), "--output", str(run)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, text=True,
    )
    _wait_for(lambda: (run / "checkpoints" / "step_19").is_dir() and any((run / "checkpoints").glob("tmp_step_*")))
    proc.kill()
    proc.wait()
    steps = assert_published_checkpoints_intact(run / "checkpoints")
    assert steps[0] == 18 and read_training_end(run / "checkpoints") is None
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
    `evaluate` evaluates the published series and finds the pass at step 20 (as after a
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
    step20 = json.loads((run / "checkpoints" / "step_20" / "training_info.json").read_text())

    out = subprocess.run([sys.executable, "-m", "mlperf_grpo.cli", "evaluate", str(run)], capture_output=True, text=True, env=ENV)
    assert out.returncode == 0, out.stderr
    assert "status: success" in out.stdout and "passing step: 20" in out.stdout
    log = read_log(run / "mlperf.log")
    assert [e.metadata["step"] for e in log.find("eval_accuracy")] == [18, 19, 20]
    (stop,) = log.find("run_stop")
    assert stop.metadata["status"] == "success" and stop.time_ms == step20["training_step_end_time_ms"]


def test_sigterm_inside_a_checkpoint_write_waits_for_it():
    reached_end_of_write = False
    with pytest.raises(Terminated, match="after staging the checkpoint"):
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


FAIL_AT_STEP_20 = textwrap.dedent(
    """
    import errno, sys
    from mlperf_grpo.checkpoint.writer import AsyncCheckpointer
    from mlperf_grpo.cli import main
    real = AsyncCheckpointer._write_shard
    def write_shard(path, shard, slot):
        if path.parent.name == "tmp_step_20":
            raise OSError(errno.EIO, "Input/output error")
        return real(path, shard, slot)
    AsyncCheckpointer._write_shard = staticmethod(write_shard)
    sys.exit(main(sys.argv[1:]))
    """
)


def test_failing_background_write_mid_run_stops_training_and_leaves_an_evaluable_series(tmp_path):
    run = tmp_path / "run"
    cfg = _config(tmp_path, max_steps=30)
    proc = subprocess.run(
        [sys.executable, "-c", FAIL_AT_STEP_20, "train", "--config", str(cfg), "--output", str(run)],
        capture_output=True, text=True, env=ENV, timeout=900,
    )
    assert proc.returncode == 1, proc.stderr
    errors = [l for l in proc.stderr.splitlines() if l.startswith("mlperf-grpo: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    assert "cannot write checkpoint" in errors[0] and "tmp_step_20: Input/output error" in errors[0]
    log = read_log(run / "mlperf.log")
    last_trained = max(e.metadata["step"] for e in log.find("block_stop"))
    assert 20 <= last_trained <= 22  # stopped at the next step boundary after the failure
    steps = assert_published_checkpoints_intact(run / "checkpoints")
    assert steps == [18, 19] and not list((run / "checkpoints").glob("tmp_step_*"))
    assert read_training_end(run / "checkpoints").last_published_step == 19
    # evaluable up to the last good checkpoint: the series check accepts it
    checkpoints = discover_checkpoints(run / "checkpoints")[0]
    config = load_config(run / "config.yaml")
    assert check_series(checkpoints, config, load_validation_set(config), log, run / "checkpoints") == ([], None)


def test_training_info_records_shard_hashes_and_file_fingerprints(tmp_path):
    run = tmp_path / "run"
    proc = _train(run, _config(tmp_path, max_steps=18))
    proc.communicate(timeout=600)
    assert proc.returncode == 0
    step = run / "checkpoints" / "step_18"
    info = json.loads((step / "training_info.json").read_text())
    shard = "model-00001-of-00001.safetensors"
    data = (step / shard).read_bytes()
    assert info["weights"]["shards"] == {shard: {"hash": xxhash.xxh3_128_hexdigest(data), "bytes": len(data)}}
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert info["files"][name]["hash"] == xxhash.xxh3_128_hexdigest((BUILTIN_MODEL_DIR / name).read_bytes())
    assert read_training_end(run / "checkpoints").last_published_step == 18
