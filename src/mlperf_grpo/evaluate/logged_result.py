"""What a log already says about the result, checked before anything is evaluated.

The evaluator never moves a score. Two logs it is handed would make it do so:

- **A logged pass without a ``run_stop``** (a log edited or merged by hand, or an
  evaluator killed between its eval lines and its ``run_stop`` by a tool that wrote them
  apart): evaluating on would score a later checkpoint. The run is closed at the logged
  pass instead, with ``run_stop`` success at that checkpoint's weight-update time
  (:func:`logged_pass`); evaluations logged after the pass make the log unscorable
  (refused: the rules allow nothing after the first passing checkpoint).
- **A ``run_stop`` success that no logged evaluation supports** (a training log closed by
  another tool, or by hand): reporting it would print a passing step nothing measured.
  Refused (:func:`check_run_stop_supported`). A ``run_stop`` aborted needs no
  evaluation: training stopped before its first checkpoint closes the run that way.

And the series must be the log's (:func:`check_series_in_log`): a checkpoint series
trained after another run's log would be scored against that log's ``run_start``.
"""

from __future__ import annotations

from pathlib import Path

from mlperf_logging.mllog import constants as C  # noqa: N812

from mlperf_grpo import rules
from mlperf_grpo.evaluate.series import EvaluationError
from mlperf_grpo.logs.mllog import ParsedLog
from mlperf_grpo.logs.values import ms_text, step_window


def logged_pass(log: ParsedLog, target: float, log_file: Path) -> int | None:
    """The step of the log's first passing evaluation (accuracy strictly above
    ``target``), or None.

    Raises:
        EvaluationError: evaluations are logged after that pass (one line naming them).
    """
    evaluations = [(e.metadata.get("step"), e.value) for e in log.find(C.EVAL_ACCURACY)]
    for index, (step, accuracy) in enumerate(evaluations):
        if isinstance(accuracy, (int, float)) and rules.is_passing(accuracy, target):
            after = [s for s, _ in evaluations[index + 1:]]
            if after:
                raise EvaluationError(
                    f"{log_file} logs step {step} passing (accuracy {accuracy} > {target}) and evaluations after it "
                    f"(steps {after}) but no run_stop; the rules allow nothing after the first pass, so the log "
                    "cannot be scored: restore the log as the evaluator wrote it")
            return step
    return None


def check_run_stop_supported(log: ParsedLog, target: float, global_batch_size: int, log_file: Path) -> None:
    """A ``run_stop`` success names a step whose logged evaluation passed.

    Raises:
        EvaluationError: no logged evaluation of that step passes (one line naming the
            ``run_stop``'s step and what the log holds).
    """
    (stop,) = log.find(C.RUN_STOP)[:1]
    if stop.metadata.get(C.STATUS) != C.SUCCESS:
        return
    step = stop.metadata.get("step")
    if step is None and isinstance(stop.metadata.get(C.SAMPLES_COUNT), int):
        step = stop.metadata[C.SAMPLES_COUNT] // global_batch_size
    passing = [e.metadata.get("step") for e in log.find(C.EVAL_ACCURACY)
               if isinstance(e.value, (int, float)) and rules.is_passing(e.value, target)]
    if step not in passing:
        held = f"passing evaluations at steps {passing}" if passing else "no passing evaluation"
        raise EvaluationError(
            f"{log_file} has a run_stop success at step {step} but {held}; a run_stop no logged evaluation supports "
            "cannot be scored: remove the run_stop line and run evaluate again")


def check_series_in_log(checkpoints: list, log: ParsedLog, global_batch_size: int) -> None:
    """Every checkpoint's weight-update time lies within its step's training in the log
    (:func:`~mlperf_grpo.logs.values.step_window`, the bounds ``merge`` ties a ``run_stop``
    to: after the ``block_stop`` of the step before, no later than the step's own
    ``block_stop`` or ``tracked_stats``). A step the log has not trained is not checked
    here (the series check refuses a series longer than the log's training).

    Raises:
        EvaluationError: a checkpoint's time lies outside its step's window: one line
            naming its record, the time and the log's lines.
    """
    for c in checkpoints:
        lo, hi = step_window(log, c.step, global_batch_size)
        t_update = c.info.training_step_end_time_ms
        if hi is None or ((lo is None or t_update >= lo.time_ms) and t_update <= hi.time_ms):
            continue
        record = getattr(c, "record", None) or c.path / "training_info.json"
        after = f"after {ms_text(lo.time_ms)} ms (line {lo.line_no}) and " if lo is not None else ""
        raise EvaluationError(
            f"{record}: weight-update time {ms_text(t_update)} ms is not within step {c.step}'s training in the MLPerf "
            f"log ({after}no later than {ms_text(hi.time_ms)} ms, its {hi.key} at line {hi.line_no}); the checkpoints "
            "are of another run than the log: pass the training log of the run that wrote them")
