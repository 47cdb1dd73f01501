"""The run's outcome: the one module that decides and writes the evaluation events
(``eval_start``/``eval_accuracy``/``eval_stop``) and the run's single ``run_stop``.

Who calls what (DESIGN.md, "The rule, in one paragraph")::

    offline, follow, foreign series   (evaluate/commit.py, results in step order)
        decide_result(accuracy)   commit the evaluation now, and does it pass?
        commit_evaluations(...)   the eval triples, then run_stop success at the
                                  passing checkpoint's weight-update time, in one write
        decide_end(...)           every result seen, none passed: abort, wait, or refuse
        commit_aborted_at(...)    run_stop aborted at the final checkpoint's update time
    inline evaluation (DEFERRED_OFFLINE_EVAL=0, train/inline_eval.py)
        commit_inline_evaluation  the eval triple (+ run_stop success at the eval's end)
        log_aborted_run_stop      no pass by max_steps: aborted at the last eval's end
    training closed before its first checkpoint (train/outputs.py, evaluate/offline.py)
        log_aborted_run_stop      aborted at the last trained step

Times are Unix ms; ``samples_count = step * global batch size``. Every function only
queues lines on an :class:`~mlperf_grpo.logs.mllog.MLLogWriter` unless named ``commit_*``
(those commit, so the lines of one decision reach the log in one write). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from mlperf_logging.mllog import constants as C  # noqa: N812

from mlperf_grpo import rules
from mlperf_grpo.logs.mllog import MLLogWriter, ParsedLog

if TYPE_CHECKING:
    from mlperf_grpo.checkpoint import Checkpoint


@dataclass(frozen=True)
class Evaluation:
    """One checkpoint's evaluation: its step, pass@k ``accuracy`` and start/stop (Unix ms)."""

    step: int
    accuracy: float
    start_ms: int
    stop_ms: int


@dataclass(frozen=True)
class ResultDecision:
    """What one result in step order decides: ``commit`` it (with those held before it)
    now, and whether it ``passed`` (then the run is decided: ``run_stop`` success)."""

    commit: bool
    passed: bool


class SeriesEnd(Enum):
    """Every pending result is in and none passed: what the run's end is."""

    ABORTED = "aborted"  # run_stop aborted at the final checkpoint
    WAIT = "wait"  # training still publishes checkpoints: later ones may pass
    UNSCORABLE = "unscorable"  # a series fault and no pass before it: nothing is logged


def decide_result(accuracy: float, target: float, series_fault: bool) -> ResultDecision:
    """The decision for the next result in step order: it passes when ``accuracy`` is
    strictly above ``target`` (:func:`mlperf_grpo.rules.is_passing`). Without a series
    fault every result is committed as it comes; with one (a checkpoint past it is
    unusable) results are held until one passes, since only a pass scores such a run."""
    passed = rules.is_passing(accuracy, target)
    return ResultDecision(commit=passed or not series_fault, passed=passed)


def decide_end(series_fault: bool, final_step: int | None) -> SeriesEnd:
    """The end of a series whose pending results are all in and none passed: refused
    with a series fault; waiting while the final checkpoint is unknown (``final_step``
    ``None``: training still runs); else aborted at the final checkpoint."""
    if series_fault:
        return SeriesEnd.UNSCORABLE
    return SeriesEnd.WAIT if final_step is None else SeriesEnd.ABORTED


def log_eval(log: MLLogWriter, evaluation: Evaluation, gbs: int) -> None:
    """Queue one checkpoint's ``eval_start``/``eval_accuracy``/``eval_stop`` (metadata
    ``samples_count = step * gbs`` and ``step``)."""
    md = {C.SAMPLES_COUNT: rules.samples_count(evaluation.step, gbs), "step": evaluation.step}
    log.start(C.EVAL_START, metadata=md, time_ms=evaluation.start_ms)
    log.event(C.EVAL_ACCURACY, evaluation.accuracy, metadata=md, time_ms=evaluation.stop_ms)
    log.end(C.EVAL_STOP, metadata=md, time_ms=evaluation.stop_ms)


def _log_run_stop(log: MLLogWriter, status: str, step: int, samples_count: int, time_ms: int) -> None:
    log.end(C.RUN_STOP, metadata={C.STATUS: status, C.SAMPLES_COUNT: samples_count, "step": step}, time_ms=time_ms)


def log_aborted_run_stop(log: MLLogWriter, step: int, samples_count: int, time_ms: int) -> None:
    """Queue ``run_stop`` aborted at ``step`` (``time_ms``: Unix ms): a run that ends with
    no pass and no checkpoint to backdate to (the trainer's own, inline evaluation's)."""
    _log_run_stop(log, C.ABORTED, step, samples_count, time_ms)


def commit_evaluations(log: MLLogWriter, evaluations: list[Evaluation], gbs: int, passing: Checkpoint | None) -> None:
    """Commit the eval triples of ``evaluations`` (step order) and, with ``passing`` (the
    last one's checkpoint, which passed), ``run_stop`` success backdated to its
    weight-update time (``training_info.json``), in one write."""
    for evaluation in evaluations:
        log_eval(log, evaluation, gbs)
    if passing is not None:
        info = passing.info
        _log_run_stop(log, C.SUCCESS, passing.step, info.samples_count, info.training_step_end_time_ms)
    log.commit()


def commit_aborted_at(log: MLLogWriter, final: Checkpoint) -> None:
    """Commit ``run_stop`` aborted at the final checkpoint's step and weight-update time."""
    info = final.info
    log_aborted_run_stop(log, final.step, info.samples_count, info.training_step_end_time_ms)
    log.commit()


def commit_inline_evaluation(log: MLLogWriter, evaluation: Evaluation, gbs: int, target: float) -> bool:
    """Inline evaluation: commit the eval triple and, when it passes (accuracy strictly
    above ``target``), ``run_stop`` success at the evaluation's end, in one write (the
    evaluation's time counts toward time-to-train). Returns whether it passed."""
    log_eval(log, evaluation, gbs)
    passed = rules.is_passing(evaluation.accuracy, target)
    if passed:
        _log_run_stop(log, C.SUCCESS, evaluation.step, rules.samples_count(evaluation.step, gbs), evaluation.stop_ms)
    log.commit()
    return passed


def last_trained_step(log: ParsedLog) -> tuple[int, int]:
    """``(step, time_ms)`` of the log's last ``block_stop``, or ``(0, run_start time)``
    when no step finished; time in Unix ms. The log must have a ``run_start``."""
    stops = log.find(C.BLOCK_STOP)
    if stops:
        return int(stops[-1].metadata.get("step", 0)), int(stops[-1].time_ms)
    return 0, int(log.find(C.RUN_START)[0].time_ms)
