"""Fault injection on the offline evaluator (issue 5, evaluator side), one writer and teardown: a
second evaluator or a trainer holding the run is refused; a log closed aborted keeps its unevaluated
checkpoints. The runs are copies of the default run that ``conftest.py`` makes once (``finished``,
``trained``, ``run``).
"""

import json
import os

import pytest
from faults_eval_helpers import error_lines, lock_held_by, spawn_evaluate, wait_for

from mlperf_grpo.cli import main
from mlperf_grpo.config.rundir import RunLock
from mlperf_grpo.logs.mllog import PREFIX, read_log

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- 2. one writer

def test_second_evaluator_is_refused_while_one_runs(run, capsys):
    holder = spawn_evaluate(run, "holder")
    try:
        assert wait_for(lambda: lock_held_by(run, holder.pid), holder)
        assert main(["evaluate", str(run), "--retain-checkpoints"]) == 2
        line = error_lines(capsys.readouterr().err)
        assert f"the evaluator (pid {holder.pid})" in line and "being written" in line
    finally:
        holder.kill()
        holder.wait()


def test_evaluator_is_refused_while_the_trainer_holds_the_run(run, capsys):
    before = (run / "mlperf.log").read_bytes()
    with RunLock(run, "trainer"):
        assert main(["evaluate", str(run)]) == 2
    line = error_lines(capsys.readouterr().err)
    assert f"the trainer (pid {os.getpid()})" in line
    assert (run / "mlperf.log").read_bytes() == before
    assert (run / "checkpoints" / "step_18").is_dir()  # no teardown either



# --------------------------------------------------------------------------- teardown

def test_teardown_keeps_checkpoints_an_aborted_run_stop_left_unevaluated(run, capsys):
    """A log closed with run_stop aborted before its checkpoints were evaluated (as the
    trainer used to write on SIGTERM): evaluate reports it and deletes none of them."""
    log = read_log(run / "mlperf.log")
    last = log.find("block_stop")[-1]
    with open(run / "mlperf.log", "a") as f:
        f.write(PREFIX + json.dumps({"namespace": "", "time_ms": last.time_ms, "event_type": "INTERVAL_END", "key": "run_stop",
                                     "value": None, "metadata": {"status": "aborted", "samples_count": 30 * 256, "step": 30}}) + "\n")
    assert main(["evaluate", str(run)]) == 3
    captured = capsys.readouterr()
    assert "time-to-train: none" in captured.out and "were never evaluated" in captured.err
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [f"step_{s}" for s in sorted(range(18, 31), key=str)]
