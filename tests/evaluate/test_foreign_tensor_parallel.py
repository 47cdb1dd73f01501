"""``evaluate --checkpoints DIR --format nemo-rl`` under torchrun at T = 2 (issue 28, item
3): one evaluation worker spanning 2 ranks (gloo), each reading only its slices of a
NeMo-RL series (a DCP directory, per-rank safetensors), against the one-process T = 1
evaluation of the same series; and each rank's share of each layout, read alone."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import foreign_layouts
import pytest
import torch
import yaml
from faults_eval_helpers import error_lines
from test_distributed import ENV
from test_tensor_parallel import _training_model_dir

from mlperf_grpo.checkpoint import foreign_layouts as foreign
from mlperf_grpo.checkpoint.foreign_share import read_foreign_share
from mlperf_grpo.checkpoint.reader import ReadBuffers
from mlperf_grpo.cli import main
from mlperf_grpo.evaluate import group_watch
from mlperf_grpo.evaluate.group_watch import lost_peer_line
from mlperf_grpo.logs.mllog import read_log

pytestmark = pytest.mark.slow

CONFIG = {"grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 4, "max_steps": 3, "micro_batch_size": 4,
                   "first_eval_step": 2},
          "validation": {"num_tasks": 8, "generations_per_task": 1, "temperature": 1.0, "top_p": 1.0},
          "task": {"num_train_tasks": 64}}
TORCHRUN = [sys.executable, "-m", "mlperf_grpo.torchrun", "--standalone", "--nproc-per-node", "2", "-m", "mlperf_grpo.cli"]
TIMEOUT_S = 300
"""A torchrun evaluation that runs longer hangs (2 checkpoints of 8 tasks: about 30 s here)."""


def _config(base, model, t):
    path = base / f"t{t}.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, "model": {"path": str(model)}, "inference": {"tensor_parallel_size": t}}))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-step run (checkpoints at steps 2, 3) of the built-in model padded to a
    vocabulary of 16 (T = 2 divides it and its heads), and its configs at T = 1 and 2."""
    base = tmp_path_factory.mktemp("tp_foreign")
    model = _training_model_dir(base)
    assert main(["train", "--config", str(_config(base, model, 1)), "--output", str(base / "run")]) == 0
    _config(base, model, 2)
    return base


def _series(trained, tmp_path, weights):
    series = foreign_layouts.to_nemo_rl(trained / "run", tmp_path / weights, weights)
    log = tmp_path / f"{weights}.log"
    shutil.copy(trained / "run" / "mlperf.log", log)
    return series, log


def _evaluate_args(series, log, config):
    return ["evaluate", "--checkpoints", str(series), "--mllog", str(log), "--config", str(config), "--format", "nemo-rl"]


def _results(series, log):
    """The log's evaluation lines and run_stop (all but time_ms), and each step's task results (completions, rewards)."""
    lines = [(e.key, e.value, e.metadata) for e in read_log(log).events
             if e.key in ("eval_start", "eval_accuracy", "eval_stop", "run_stop")]
    completions = {p.name: [json.loads(l) for l in p.read_text().splitlines()[1:]]
                   for p in sorted((series / "eval").glob("step_*.jsonl"))}
    return lines, completions


@pytest.mark.parametrize("weights", ["dcp", "sharded", "megatron"])
def test_a_nemo_rl_series_at_t2_under_torchrun_gives_the_one_process_t1_results(trained, tmp_path, weights):
    one, one_log = _series(trained, tmp_path / "one", weights)
    assert main(_evaluate_args(one, one_log, trained / "t1.yaml")) in (0, 3)
    two, two_log = _series(trained, tmp_path / "two", weights)
    proc = subprocess.run([*TORCHRUN, *_evaluate_args(two, two_log, trained / "t2.yaml")], capture_output=True, text=True,
                          env=ENV, cwd=tmp_path, timeout=TIMEOUT_S)
    assert proc.returncode in (0, 3), proc.stderr[-3000:]
    assert _results(two, two_log) == _results(one, one_log)
    assert len(read_log(two_log).find("run_stop")) == 1
    for result in sorted((two / "eval").glob("step_*.jsonl")):
        header = json.loads(result.read_text().splitlines()[0])
        assert header["refit_check"].startswith("fingerprint of the tensors read, combined over the 2 ranks' slices")
        assert header["engine"]["tensor_parallel_size"] == 2


def test_a_t2_evaluation_of_a_series_without_torchrun_is_refused_naming_its_own_command(trained, tmp_path, capsys):
    series, log = _series(trained, tmp_path, "dcp")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(_evaluate_args(series, log, trained / "t2.yaml")) == 2
    assert error_lines(capsys.readouterr().err) == (
        "mlperf-grpo: error: inference.tensor_parallel_size 2 splits each evaluation worker's hf engine over 2 ranks: "
        f"run evaluate --checkpoints {series} ... under torchrun with a multiple of 2 ranks (e.g. torchrun "
        "--nproc-per-node 2 ...), or set inference.tensor_parallel_size 1")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("weights", ["dcp", "sharded", "safetensors", "megatron"])
def test_each_rank_reads_exactly_its_slices_into_a_buffer_of_its_share(trained, tmp_path, weights):
    series, _ = _series(trained, tmp_path, weights)
    checkpoint = foreign.discover_nemo_rl(series, 16, trained / "model16" / "config.json")[0][0]
    full = foreign.read_weights(checkpoint)
    total = sum(t.numel() * t.element_size() for t in full.values())
    largest = max(t.numel() * t.element_size() for t in full.values())
    parts = []
    for rank in (0, 1):  # rows split for 2-D tensors of even rows, columns for the others of even columns
        slices = {}
        for name, t in full.items():
            if t.dim() == 2 and t.shape[0] % 2 == 0:
                slices[name] = (slice(rank * t.shape[0] // 2, (rank + 1) * t.shape[0] // 2),)
            elif t.dim() == 2 and t.shape[1] % 2 == 0:
                slices[name] = (slice(None), slice(rank * t.shape[1] // 2, (rank + 1) * t.shape[1] // 2))
        buffers = ReadBuffers()
        share = read_foreign_share(checkpoint, slices, buffers, rank, 2)
        for name, t in full.items():
            assert torch.equal(share[name], t[slices.get(name, ())]), name
        held = sum(buffers.allocated().values())
        assert held <= total / 2 + largest + 64 * len(full)  # its share (64-byte aligned tensors), never the whole
        parts.append(held)
    assert sum(parts) < total + 2 * largest + 128 * len(full)


def test_a_rank_killed_during_a_t2_evaluation_ends_the_job_within_a_minute_and_a_rerun_completes(trained, tmp_path):
    """Rank 1 SIGKILLed once its engine is up (it is then reading or generating the
    first checkpoint, its group's leader in the read's agreement or a collective of the
    generation with it): the job ends with one line and a non-zero exit instead of
    waiting for gloo's 30-minute timeout, nothing is logged, and the same command then
    resumes and completes as the one-process T = 1 evaluation does."""
    one, one_log = _series(trained, tmp_path / "one", "dcp")
    assert main(_evaluate_args(one, one_log, trained / "t1.yaml")) in (0, 3)
    two, two_log = _series(trained, tmp_path / "two", "dcp")
    before = two_log.read_bytes()
    with open(tmp_path / "killed.err", "w") as err:
        proc = subprocess.Popen([*TORCHRUN, *_evaluate_args(two, two_log, trained / "t2.yaml")], stdout=subprocess.DEVNULL,
                                stderr=err, env=ENV, cwd=tmp_path)
    try:
        startup = two / "eval" / "startup.jsonl"
        deadline = time.monotonic() + TIMEOUT_S
        while not (startup.is_file() and any(json.loads(l)["rank"] == 1 for l in startup.read_text().splitlines())):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "killed.err").read_text()[-3000:]
            time.sleep(0.05)
        rank1 = next(json.loads(l)["pid"] for l in startup.read_text().splitlines() if json.loads(l)["rank"] == 1)
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        code = proc.wait(timeout=120)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = (tmp_path / "killed.err").read_text()
    # the first failed rank's code (python -m mlperf_grpo.torchrun): rank 1's SIGKILL, or rank 0's exit 1 after
    # its one line when both fail in the same second (torchrun's failure timestamps are whole seconds)
    assert code in (128 + signal.SIGKILL, 1) and took < 60, err[-3000:]
    ours = [line for line in err.splitlines() if line.startswith("mlperf-grpo:")]
    assert ours == [f"mlperf-grpo: error: {lost_peer_line(1, f'its process {rank1} on this host has ended')}"], err[-3000:]
    assert "mlperf_grpo/" not in err  # no traceback of ours
    assert two_log.read_bytes() == before  # nothing logged
    rerun = subprocess.run([*TORCHRUN, *_evaluate_args(two, two_log, trained / "t2.yaml")], capture_output=True, text=True,
                           env=ENV, cwd=tmp_path, timeout=TIMEOUT_S)
    assert rerun.returncode in (0, 3), rerun.stderr[-3000:]
    assert _results(two, two_log) == _results(one, one_log)


SILENCE_S = 5
"""The heartbeat silence after which a peer is taken for gone, shortened from 30 s for the test."""
FROZEN_CLI = [sys.executable, "-m", "mlperf_grpo.torchrun", "--standalone", "--nproc-per-node", "2", "--no-python",
              sys.executable, "-c", f"import sys; from mlperf_grpo.evaluate import group_watch; "
              f"group_watch.PEER_SILENCE_S = {SILENCE_S}; from mlperf_grpo.cli.app import main; sys.exit(main(sys.argv[1:]))"]


def test_a_frozen_rank_is_taken_for_gone_after_its_heartbeat_silence(trained, tmp_path):
    """Rank 1 SIGSTOPped once its engine is up (as a rank on a lost node: its process
    exists, nothing answers, torchrun's agent sees nothing wrong): rank 0, blocked in a
    collective with it, is ended by its watcher once rank 1's heartbeat stood still for
    the silence limit, with one line and exit 1; nothing is logged."""
    series, log = _series(trained, tmp_path, "dcp")
    before = log.read_bytes()
    with open(tmp_path / "frozen.err", "w") as err:
        proc = subprocess.Popen([*FROZEN_CLI, *_evaluate_args(series, log, trained / "t2.yaml")], stdout=subprocess.DEVNULL,
                                stderr=err, env=ENV, cwd=tmp_path)
    rank1 = None
    try:
        startup = series / "eval" / "startup.jsonl"
        deadline = time.monotonic() + TIMEOUT_S
        while not (startup.is_file() and any(json.loads(l)["rank"] == 1 for l in startup.read_text().splitlines())):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "frozen.err").read_text()[-3000:]
            time.sleep(0.05)
        rank1 = next(json.loads(l)["pid"] for l in startup.read_text().splitlines() if json.loads(l)["rank"] == 1)
        os.kill(rank1, signal.SIGSTOP)
        frozen = time.monotonic()
        while "mlperf-grpo: error:" not in (tmp_path / "frozen.err").read_text():
            assert time.monotonic() - frozen < SILENCE_S + 30, (tmp_path / "frozen.err").read_text()[-3000:]
            time.sleep(0.05)
        # not before the limit: the silence counts from rank 0's last look that saw a beat, at
        # most two beat intervals (rank 1's beat, rank 0's look) before the freeze
        assert time.monotonic() - frozen > SILENCE_S - 2 * group_watch.BEAT_S, (tmp_path / "frozen.err").read_text()[-2000:]
        os.kill(rank1, signal.SIGKILL)  # as torchrun's agent does, 30 s after its SIGTERM: a stopped process ignores that
        code = proc.wait(timeout=60)
    finally:
        if rank1 is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank1, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = (tmp_path / "frozen.err").read_text()
    assert code == 1, err[-3000:]  # rank 0's, the first failure
    ours = [line for line in err.splitlines() if line.startswith("mlperf-grpo:")]
    why = f"its heartbeat in the store stood still for {SILENCE_S:g} s"
    assert ours == [f"mlperf-grpo: error: {lost_peer_line(1, why)}"], err[-3000:]
    assert log.read_bytes() == before
