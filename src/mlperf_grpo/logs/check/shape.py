"""How a log evaluates: inline (on the clock) or deferred (offline, off the clock).

Both are allowed by the rules and log differently. Inline evaluation (the reference
implementation, ``DEFERRED_OFFLINE_EVAL=0``) stops training at an eval step, evaluates,
and either ends the run (``run_stop`` when the evaluation ends) or trains on. Deferred
evaluation trains past the evaluated steps, evaluates the saved checkpoints afterwards
and backdates ``run_stop`` to the passing checkpoint's weight-update time.

:func:`evaluation_mode` decides from evidence in the log (and the run directory when
given) and says which evidence it used; the lint applies the ``run_stop`` timing rule of
the mode it finds, and ``report`` labels the picture with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlperf_grpo.logs.mllog import ParsedLog
from mlperf_grpo.logs.values import EVAL_KEYS, ms_text, samples_count_of

INLINE, DEFERRED, UNKNOWN = "inline", "deferred", "unknown"


def trained_samples(log: ParsedLog) -> list[tuple[int, int]]:
    """``(line_no, samples_count)`` of every ``block_stop`` and ``tracked_stats`` with an
    integer ``samples_count``: how far training had gone at that line."""
    return [(e.line_no, sc) for e in log.events
            if e.key in ("block_stop", "tracked_stats") and (sc := samples_count_of(e)) is not None]


@dataclass(frozen=True)
class EvalMode:
    """``mode`` is ``inline``, ``deferred`` or ``unknown``; ``evidence`` one sentence saying why."""

    mode: str
    evidence: str


def _number(value: Any) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def evaluation_mode(log: ParsedLog, run_dir: Path | None = None) -> EvalMode:
    """Inline or deferred evaluation, from the log's evidence. Never raises.

    Deferred, when any of: the run directory holds deferred checkpoints
    (``checkpoints/step_N/``); an evaluation is logged after training went past its step
    (a ``block_stop``/``tracked_stats`` with a larger ``samples_count`` before its
    ``eval_start``); ``run_stop`` is timed before the first evaluation began (backdated).
    Inline, when none of those holds and every evaluation directly follows the training
    of its own step, and either training resumed after an evaluation or ``run_stop`` is
    timed at or after the end of the evaluation before it. Otherwise unknown.
    """
    evals = [e for e in log.events if e.key in EVAL_KEYS]
    if not evals:
        return EvalMode(UNKNOWN, "the log has no evaluation")
    if run_dir is not None and any((Path(run_dir) / "checkpoints").glob("step_*")):
        return EvalMode(DEFERRED, f"the run directory holds deferred checkpoints ({Path(run_dir) / 'checkpoints'})")
    trained = trained_samples(log)
    follows_own_step = True
    for e in log.find("eval_start") or log.find("eval_accuracy"):
        sc = samples_count_of(e)
        before = [t for line_no, t in trained if line_no < e.line_no]
        if sc is None or not before:
            follows_own_step = False
            continue
        if max(before) > sc:
            return EvalMode(DEFERRED, f"the evaluation at line {e.line_no} (samples_count {sc}) is logged after "
                                      f"training reached samples_count {max(before)}")
        if max(before) != sc:
            follows_own_step = False
    stops = log.find("run_stop")
    stop_ms = _number(stops[0].time_ms) if stops else None
    first_eval_ms = min((t for e in evals if (t := _number(e.time_ms)) is not None), default=None)
    if stop_ms is not None and first_eval_ms is not None and stop_ms < first_eval_ms:
        return EvalMode(DEFERRED, f"run_stop (time_ms {ms_text(stop_ms)}) is timed before the first evaluation began "
                                  f"({ms_text(first_eval_ms)}): backdated")
    if not follows_own_step:
        return EvalMode(UNKNOWN, "the log alone cannot tell inline from deferred evaluation (an evaluation without "
                                 "an integer samples_count, or not right after training of its step)")
    resumed = next((line_no for line_no, _ in trained if line_no > evals[0].line_no), None)
    if resumed is not None:
        return EvalMode(INLINE, f"training resumes after the evaluation at line {evals[0].line_no} (line {resumed})")
    if stop_ms is not None:
        before_stop = [e for e in evals if e.line_no < stops[0].line_no and _number(e.time_ms) is not None]
        if before_stop and stop_ms >= max(e.time_ms for e in before_stop):
            return EvalMode(INLINE, "every evaluation directly follows its own step's training and run_stop is timed "
                                    "at the end of the evaluation before it (a deferred run backdates run_stop)")
    return EvalMode(UNKNOWN, "the log alone cannot tell inline from deferred evaluation")
