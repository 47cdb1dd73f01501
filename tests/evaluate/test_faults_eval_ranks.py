"""Fault injection on the offline evaluator (issue 5, evaluator side), the ranks of a torchrun on any
nodes: the serial log, rank 0's error or death stopping the others, refusals; tensor-parallel
workers that cannot form their groups. The runs are copies of the default run that ``conftest.py``
makes once (``finished``, ``trained``, ``run``).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from faults_eval_helpers import (
    SHARD,
    copy_run,
    count_evals,
    error_lines,
    eval_steps,
    evaluate_with,
    flip_byte,
    normalized,
    read_results,
    wait_for,
)

from mlperf_grpo.cli import main
from mlperf_grpo.logs.check import check_log
from mlperf_grpo.logs.mllog import read_log

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- 9. the ranks of a torchrun, any nodes

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
MLPERF_GRPO = str(Path(sys.executable).parent / "mlperf-grpo")


def torchrun_evaluate(run, launcher_args, *evaluate_args, timeout_s=300):
    """``torchrun LAUNCHER_ARGS --no-python mlperf-grpo evaluate RUN --retain-checkpoints
    ARGS``; a hang fails the test (timeout)."""
    return subprocess.run([*TORCHRUN, *launcher_args, "--no-python", MLPERF_GRPO, "evaluate", str(run),
                           "--retain-checkpoints", *evaluate_args],
                          capture_output=True, text=True, timeout=timeout_s, cwd=run.parent)


def two_node_evaluate(run, out_dir, timeout_s=300):
    """Two torchrun agents, as on two nodes (``--nnodes 2 --nproc-per-node 1``, c10d
    rendezvous on a local port), each running ``evaluate RUN``; returns their
    ``(returncode, stdout, stderr)``. A hang fails the test (timeout); both are killed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    try:
        for node in range(2):
            with open(out_dir / f"node{node}.out", "w") as out, open(out_dir / f"node{node}.err", "w") as err:
                procs.append(subprocess.Popen(
                    [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"eval-{port}", "--no-python", MLPERF_GRPO,
                     "evaluate", str(run), "--retain-checkpoints"], stdout=out, stderr=err, cwd=run.parent))
        deadline = time.monotonic() + timeout_s
        codes = [proc.wait(timeout=max(1.0, deadline - time.monotonic())) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [(code, (out_dir / f"node{n}.out").read_text(), (out_dir / f"node{n}.err").read_text())
            for n, code in enumerate(codes)]


def ranks_that_evaluated(run):
    return {json.loads(line)["rank"] for line in (run / "eval" / "timing.jsonl").read_text().splitlines()}


def test_torchrun_ranks_log_equals_the_serial_log_and_passes_the_checker(trained, finished, tmp_path):
    run = copy_run(trained, tmp_path / "run")
    proc = torchrun_evaluate(run, ["--standalone", "--nproc-per-node", "2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert normalized(run / "mlperf.log") == normalized(finished / "mlperf.log")  # pass at the 3rd checkpoint
    assert proc.stdout.count("status: success") == 1 and "passing step: 20" in proc.stdout  # rank 0 alone prints
    assert ranks_that_evaluated(run) == {0, 1}
    for step in (18, 19, 20):
        assert read_results(run / "eval" / f"step_{step}.jsonl") == read_results(finished / "eval" / f"step_{step}.jsonl")
    report = check_log(run / "mlperf.log")
    assert report.official.verdict == "SUCCESS" and report.clean, (report.official.messages, report.findings)


def test_two_torchrun_nodes_log_equals_the_serial_log(trained, finished, tmp_path):
    run = copy_run(trained, tmp_path / "run")
    nodes = two_node_evaluate(run, tmp_path)
    assert [code for code, _, _ in nodes] == [0, 0], [err[-3000:] for _, _, err in nodes]
    assert normalized(run / "mlperf.log") == normalized(finished / "mlperf.log")
    assert sorted(out.count("status: success") for _, out, _ in nodes) == [0, 1]  # global rank 0, on one of them
    assert ranks_that_evaluated(run) == {0, 1}  # each node's rank evaluated checkpoints
    assert check_log(run / "mlperf.log").official.verdict == "SUCCESS"


def test_two_torchrun_nodes_stop_at_rank_0s_error_without_a_hang(trained, tmp_path):
    """Rank 0 refuses the run at a corrupt checkpoint: it exits 2 with its line; the rank
    on the other node exits 1 with that line (so its torchrun does not wait out the 300 s
    exit barrier for a node that failed); both torchruns end within the timeout."""
    run = copy_run(trained, tmp_path / "run")
    flip_byte(run, 19)  # no pass before it: rank 0's committer refuses the run there
    nodes = two_node_evaluate(run, tmp_path, timeout_s=240)
    refusal = (f"step_19/{SHARD}: xxh3_128 differs from training_info.json; the checkpoint is corrupt; no earlier "
               "checkpoint passed, so the run cannot be scored past it: restore step_19/ from a copy and run evaluate "
               "again (it resumes there), or train again")
    ours = sorted(line for _, _, err in nodes for line in err.splitlines() if line.startswith("mlperf-grpo:"))
    assert ours == [f"mlperf-grpo: error: {refusal}", f"mlperf-grpo: rank 1: error: rank 0 failed: {refusal}"], ours
    stderr = "".join(err for _, _, err in nodes)
    assert "exitcode  : 2" in stderr and "exitcode  : 1" in stderr and "mlperf_grpo/" not in stderr
    assert all(code != 0 for code, _, _ in nodes)
    assert eval_steps(run / "mlperf.log") == [18] and not read_log(run / "mlperf.log").find("run_stop")


def test_torchrun_refuses_more_workers_than_ranks_with_one_line(trained, tmp_path):
    run = copy_run(trained, tmp_path / "run")
    before = (run / "mlperf.log").read_bytes()
    refusal = "under torchrun the evaluation workers are its 2 rank(s) (WORLD_SIZE 2): leave out --workers, or give --workers 2"
    proc = torchrun_evaluate(run, ["--standalone", "--nproc-per-node", "2"], "--workers", "3", timeout_s=120)
    ours = [line for line in proc.stderr.splitlines() if line.startswith("mlperf-grpo:")]
    assert ours[0] == f"mlperf-grpo: error: {refusal}", proc.stderr[-3000:]  # rank 0's line; rank 1 exits 0 ...
    assert all(line == "mlperf-grpo: rank 1: stopped by SIGTERM" for line in ours[1:]), ours  # ... unless torchrun stopped it first
    assert "exitcode  : 2" in proc.stderr and proc.returncode != 0
    assert "mlperf_grpo/" not in proc.stderr  # no traceback of ours (torchrun prints its own)
    assert (run / "mlperf.log").read_bytes() == before and not (run / "eval").exists()


def test_other_ranks_stop_within_the_silence_limit_when_rank_0_is_killed(trained, finished, tmp_path):
    """Two ranks of a torchrun on two nodes, the store hosted elsewhere (here, as by the
    agent that hosts the rendezvous): rank 0 SIGKILLed after its first commit. Rank 1
    sees its heartbeat stand still and exits 1 with one line within RANK0_SILENCE_S (plus
    the checkpoint it is evaluating), instead of waiting on the store for 24 h; the run
    resumes to the uninterrupted log."""
    from torch.distributed import TCPStore

    from mlperf_grpo.evaluate.launch import RANK0_SILENCE_S

    run = copy_run(trained, tmp_path / "run")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841  (the agent's store)
    procs = []
    try:
        for rank in (0, 1):
            env = {**os.environ, "TORCHELASTIC_RUN_ID": "test", "RANK": str(rank), "LOCAL_RANK": "0",
                   "GROUP_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
            with open(tmp_path / f"rank{rank}.err", "w") as err:
                procs.append(subprocess.Popen([sys.executable, "-m", "mlperf_grpo.cli", "evaluate", str(run),
                                               "--retain-checkpoints"], env=env, stdout=subprocess.DEVNULL, stderr=err))
        assert wait_for(lambda: count_evals(run) >= 1, procs[0]), "rank 0 exited before its first commit"
        killed = time.monotonic()
        procs[0].send_signal(signal.SIGKILL)
        assert procs[1].wait(timeout=RANK0_SILENCE_S + 60) == 1
        assert time.monotonic() - killed < RANK0_SILENCE_S + 30
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    err = (tmp_path / "rank1.err").read_text()
    assert error_lines(err) == (
        f"mlperf-grpo: rank 1: error: rank 0 is gone (its heartbeat in the store stood still for {RANK0_SILENCE_S:g} s: "
        "killed, or its node lost); this rank stops. Nothing partial was logged: run the same evaluate command again "
        "to resume the run")
    assert not read_log(run / "mlperf.log").find("run_stop")
    assert evaluate_with(run, 1) == normalized(finished / "mlperf.log")


@pytest.mark.parametrize("evaluate_args, refusal", [
    (["RUN", "--follow"], "--follow evaluates with one worker, not torchrun's 2 ranks: run it without torchrun (or with "
                          "one rank)"),
    (["RUN", "--checkpoints", "CKPT", "--mllog", "LOG", "--config", "C"],
     "give RUN_DIR (a run our trainer wrote) or --checkpoints/--mllog/--config (another trainer's series), not both"),
])
def test_rank_0_of_two_refuses_what_one_worker_does(tmp_path, monkeypatch, capsys, evaluate_args, refusal):
    """Rank 0 of a 2-rank torchrun (its environment, serving the store itself: no agent)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"TORCHELASTIC_RUN_ID": "test", "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "WORLD_SIZE": "2",
                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "TORCHELASTIC_USE_AGENT_STORE": "False"}.items():
        monkeypatch.setenv(name, value)
    assert main(["evaluate", *[str(tmp_path / a) if a.isupper() else a for a in evaluate_args]]) == 2
    assert error_lines(capsys.readouterr().err) == f"mlperf-grpo: error: {refusal}"
    assert list(tmp_path.iterdir()) == []


def test_a_finished_run_under_torchrun_exits_0_on_every_rank(finished, tmp_path):
    run = copy_run(finished, tmp_path / "run")
    log, summary = (run / "mlperf.log").read_bytes(), (run / "eval" / "summary.json").read_bytes()
    proc = torchrun_evaluate(run, ["--standalone", "--nproc-per-node", "2"], timeout_s=120)
    assert proc.returncode == 0, proc.stderr[-3000:]  # torchrun exits 0 only when every rank did
    assert proc.stdout.count("status: success") == 1
    assert (run / "mlperf.log").read_bytes() == log and (run / "eval" / "summary.json").read_bytes() == summary



# --------------------------------------------------------------------------- tensor-parallel workers (issue 28)

def _set_tensor_parallel_size(run, t):
    config = yaml.safe_load((run / "config.yaml").read_text())
    config.setdefault("inference", {})["tensor_parallel_size"] = t
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


@pytest.mark.parametrize("world, t, refusal", [
    (None, 2, "inference.tensor_parallel_size 2 splits each evaluation worker's hf engine over 2 ranks: run evaluate RUN_DIR "
              "under torchrun with a multiple of 2 ranks (e.g. torchrun --nproc-per-node 2 ...), or set "
              "inference.tensor_parallel_size 1"),
    ("2", 4, "inference.tensor_parallel_size 4 does not divide the world size 2: set inference.tensor_parallel_size to "
             "a common divisor of the world size and the heads, or launch a multiple of 4 ranks"),
])
def test_a_tensor_parallel_evaluation_that_cannot_form_its_groups_is_refused(run, monkeypatch, capsys, world, t, refusal):
    _set_tensor_parallel_size(run, t)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    if world is not None:  # rank 0 of a torchrun world (serving the store itself)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for name, value in {"TORCHELASTIC_RUN_ID": "test", "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0",
                            "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "False"}.items():
            monkeypatch.setenv(name, value)
    assert main(["evaluate", str(run)]) == 2
    assert error_lines(capsys.readouterr().err) == f"mlperf-grpo: error: {refusal}"
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
