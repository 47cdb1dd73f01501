"""The drawable facts of one MLPerf log for ``mlperf-grpo report``: training blocks,
checkpoint writes, evaluations, ``run_start``/``run_stop`` and the score, read from the
log only (:func:`build_timeline`), and the report's title."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlperf_grpo import rules
from mlperf_grpo.logs.check.shape import INLINE, EvalMode, evaluation_mode
from mlperf_grpo.logs.mllog import ParsedLog
from mlperf_grpo.logs.values import is_int, is_number, logged_global_batch_size


@dataclass
class EvalSpan:
    """One evaluation drawn on the timeline: its step, ``samples_count`` as logged, start
    (its eval_start, None when not logged) and stop (Unix ms, as logged), accuracy and
    whether it passed."""
    step: int | None
    samples_count: object
    start_ms: float | None
    stop_ms: float
    accuracy: float | None
    passed: bool


@dataclass
class Timeline:
    """The drawable facts of one log; times are Unix ms, steps are 1-based."""

    benchmark: str
    division: str
    status: str
    time_to_train_ms: float | None
    run_start_ms: float | None
    run_stop_ms: float | None
    run_stop_step: int | None
    global_batch_size: int | None
    first_eval_step: int | None
    target: float = rules.TARGET_ACCURACY
    mode: EvalMode = EvalMode("unknown", "not decided")
    steps: list[tuple[int, float, float]] = field(default_factory=list)
    """``(step, start_ms, stop_ms)`` per training block; ``step`` is the block's last step."""
    step_ticks: list[tuple[int, float]] = field(default_factory=list)
    """``(step, time_ms)`` of each ``tracked_stats`` event: steps inside long blocks."""
    checkpoint_writes: list[tuple[int, float, float]] = field(default_factory=list)
    evals: list[EvalSpan] = field(default_factory=list)

    @property
    def origin_ms(self) -> float:
        if self.run_start_ms is not None:
            return self.run_start_ms
        times = [t for _, t, _ in self.steps] + [e.stop_ms for e in self.evals]
        return min(times) if times else 0.0

    @property
    def passing(self) -> EvalSpan | None:
        return next((e for e in self.evals if e.passed), None)

    @property
    def has_score(self) -> bool:
        """Only a successful run has a time-to-train; an aborted run has no score."""
        return self.status == "success" and self.time_to_train_ms is not None


def _str(value: object, default: str = "?") -> str:
    return value if isinstance(value, str) and value else default


def _step_of(metadata: dict, gbs: int | None) -> int | None:
    step = metadata.get("step")
    if is_int(step):
        return step
    sc = metadata.get("samples_count")
    return sc // gbs if is_int(sc) and gbs else None


def build_timeline(log: ParsedLog) -> Timeline:
    """Extract a :class:`Timeline` from a parsed log. Never raises; odd lines are skipped."""
    gbs = logged_global_batch_size(log)
    starts, stops = log.find("run_start"), log.find("run_stop")
    run_start = starts[0].time_ms if starts and is_number(starts[0].time_ms) else None
    stop = stops[0] if stops else None
    run_stop = stop.time_ms if stop is not None and is_number(stop.time_ms) else None
    ttt = run_stop - run_start if run_start is not None and run_stop is not None else None
    tl = Timeline(
        benchmark=_str(log.first_value("submission_benchmark"), rules.BENCHMARK),
        division=_str(log.first_value("submission_division")),
        status=_str(stop.metadata.get("status"), "?") if stop is not None else "no run_stop",
        time_to_train_ms=ttt,
        run_start_ms=run_start,
        run_stop_ms=run_stop,
        run_stop_step=_step_of(stop.metadata, gbs) if stop is not None else None,
        global_batch_size=gbs,
        first_eval_step=rules.first_eval_step(gbs) if gbs else None,
        mode=evaluation_mode(log),
    )
    open_block: list[tuple[int | None, float]] = []  # block_stop closes the latest open block
    eval_start: dict[object, float] = {}
    for e in log.events:
        if not is_number(e.time_ms):
            continue
        step = _step_of(e.metadata, gbs)
        if e.key == "block_start":
            open_block.append((step, e.time_ms))
        elif e.key == "block_stop" and open_block:
            start_step, start_ms = open_block.pop()
            tl.steps.append((step if step is not None else start_step, start_ms, e.time_ms))
        elif e.key == "tracked_stats" and step is not None:
            tl.step_ticks.append((step, e.time_ms))
        elif e.key == "eval_start":
            eval_start[repr(e.metadata.get("samples_count"))] = e.time_ms
        elif e.key == "eval_accuracy":
            acc = e.value if is_number(e.value) else None
            tl.evals.append(EvalSpan(step, e.metadata.get("samples_count"), eval_start.get(repr(e.metadata.get("samples_count"))),
                                     e.time_ms, acc, acc is not None and rules.is_passing(acc, tl.target)))
        elif e.key == "eval_stop":
            for span in reversed(tl.evals):
                if repr(span.samples_count) == repr(e.metadata.get("samples_count")):
                    span.stop_ms = max(span.stop_ms, e.time_ms)
                    break
    tl.first_eval_step = _first_eval_step(tl)
    block_starts = sorted(t for _, t, _ in tl.steps)
    last: list[tuple[int, float]] = []
    for step, _, stop_ms in tl.steps:
        if tl.mode.mode == INLINE or tl.first_eval_step is None or step is None or step < tl.first_eval_step:
            continue  # inline runs write no deferred checkpoints
        later = [t for t in block_starts if t >= stop_ms]
        if later:
            tl.checkpoint_writes.append((step, stop_ms, later[0]))
        else:
            last.append((step, stop_ms))
    # The last step's write has no next block_start: draw it as long as the median write.
    widths = sorted(b - a for _, a, b in tl.checkpoint_writes)
    median = widths[len(widths) // 2] if widths else 0.0
    tl.checkpoint_writes += [(step, stop_ms, stop_ms + median) for step, stop_ms in last]
    return tl


def _first_eval_step(tl: Timeline) -> int | None:
    """The step of the first logged evaluation (an open run may set its own
    ``grpo.first_eval_step``; the evaluator starts there), else the closed formula
    ``ceil(2.5 + 3840 / GBS)`` when the log has no evaluation."""
    steps = [e.step for e in tl.evals if e.step is not None]
    return min(steps) if steps else tl.first_eval_step


def evaluated_beside_training(tl: Timeline) -> bool:
    """An evaluation began before training ended (``evaluate --follow``: a deferred
    run's evaluator ran beside the trainer; its lines were merged after training's)."""
    last_step_end = max((b for _, _, b in tl.steps), default=None)
    starts = [e.start_ms for e in tl.evals if e.start_ms is not None]
    return last_step_end is not None and bool(starts) and min(starts) < last_step_end


def fmt_duration(ms: float | None) -> str:
    """A duration in ms as text: minutes and seconds, or minutes and hours from one hour on; ``-`` for None."""
    if ms is None:
        return "-"
    return f"{ms / 60000:.3f} min ({ms / 1000:.3f} s)" if abs(ms) < 3_600_000 else f"{ms / 60000:.1f} min ({ms / 3_600_000:.2f} h)"


def title_of(tl: Timeline) -> str:
    """The report title: benchmark, division, status and score (none for an unsuccessful run)."""
    score = fmt_duration(tl.time_to_train_ms) if tl.has_score else f"none ({tl.status}: no score)"
    return f"{tl.benchmark}  |  {tl.division} division  |  status: {tl.status}  |  time-to-train: {score}"
