"""The PNG of ``mlperf-grpo report`` (matplotlib, Agg backend): the upper panel puts a
:class:`~mlperf_grpo.logs.report.timeline.Timeline` on one wall-clock axis, the lower one
plots ``eval_accuracy`` per step against the target (see ``report.py``)."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

from mlperf_grpo.logs.check.shape import DEFERRED, INLINE
from mlperf_grpo.logs.report.timeline import EvalSpan, Timeline, evaluated_beside_training, fmt_duration, title_of

TRAIN_COLORS = ("#4C72B0", "#7EA6D8")
CKPT_COLOR = "#DD8452"
FAIL_COLOR = "#C44E52"
PASS_COLOR = "#55A868"


def _time_unit(span_ms: float) -> tuple[str, float]:
    if span_ms < 120_000:
        return "s", 1000.0
    if span_ms < 120 * 60_000:
        return "min", 60_000.0
    return "h", 3_600_000.0


MODE_TEXT = {
    DEFERRED: ("evaluation (offline)", "timeline: evaluation runs after training and is taken off the clock"),
    INLINE: ("evaluation (inline)", "timeline: evaluation runs inline, on the clock (training waits for it)"),
}
UNKNOWN_TEXT = ("evaluation", "timeline: the log does not show whether evaluation ran inline or deferred")
FOLLOW_TEXT = "timeline: evaluation ran beside training (evaluate --follow) and is taken off the clock"


def run_stop_label(tl: Timeline) -> str:
    """What ``run_stop`` marks in this run, true to its evaluation mode and status."""
    what = f"step {tl.run_stop_step}" if tl.run_stop_step is not None else "its checkpoint"
    if tl.mode.mode == DEFERRED:
        final = "final " if tl.status != "success" else ""
        return f"run_stop ({tl.status}) = weight update of {final}{what}"
    if tl.mode.mode == INLINE:
        which = "the passing evaluation" if tl.status == "success" else "the last evaluation"
        return f"run_stop ({tl.status}) = end of {which} ({what})"
    return f"run_stop ({tl.status})"


@dataclass(frozen=True)


class _Panel:
    """The upper panel's frame: its axes, the time axis (ms since ``origin_ms``, in units
    of ``per`` ms) and the lanes (name -> y), bars ``h`` high and at least ``min_width`` wide."""

    ax: object
    origin_ms: float
    per: float
    lanes: dict[str, float]
    eval_lane: str
    h: float
    min_width: float

    def x(self, ms: float) -> float:
        """A Unix time in ms as the panel's x (time since the origin, in its unit)."""
        return (ms - self.origin_ms) / self.per

    @property
    def top(self) -> float:
        """The y of the training-steps lane, the highest."""
        return self.lanes["training steps"]


def render_png(tl: Timeline) -> bytes:
    """Draw the timeline with matplotlib (Agg backend) and return PNG bytes: the upper
    panel (training blocks, checkpoint writes, evaluations, run_start/run_stop and the
    time-to-train span on one wall-clock axis) and, when the log has evaluations, the
    lower one (:func:`_draw_accuracy`)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    all_ms = [t for _, a, b in tl.steps for t in (a, b)] + [t for e in tl.evals for t in (e.start_ms, e.stop_ms) if t is not None]
    all_ms += [t for t in (tl.run_start_ms, tl.run_stop_ms) if t is not None]
    span = (max(all_ms) - min(all_ms)) if all_ms else 1.0
    unit, per = _time_unit(span)
    draw_evals = [e for e in tl.evals if e.step is not None and e.accuracy is not None]
    if draw_evals:
        fig, (ax, ax2) = plt.subplots(2, 1, figsize=(13, 8.2), gridspec_kw={"height_ratios": [1.25, 1]})
    else:  # a killed run (no evaluation): no empty accuracy panel
        fig, ax = plt.subplots(1, 1, figsize=(13, 4.8))
        ax2 = None
    fig.suptitle(title_of(tl), fontsize=13, fontweight="bold")
    eval_lane, timeline_title = MODE_TEXT.get(tl.mode.mode, UNKNOWN_TEXT)
    if tl.mode.mode == DEFERRED and evaluated_beside_training(tl):
        timeline_title = FOLLOW_TEXT
    # no checkpoint-writes lane for a log without deferred checkpoints (inline runs, killed before S0)
    lanes = {"training steps": 2.0, "checkpoint writes": 1.0, eval_lane: 0.0} if tl.checkpoint_writes else {
        "training steps": 1.0, eval_lane: 0.0}
    panel = _Panel(ax, tl.origin_ms, per, lanes, eval_lane, h=0.6,
                   min_width=span / per * 0.004)  # the narrowest bar drawn: visible at any run length
    step_labels = _draw_steps(panel, tl)
    _draw_checkpoint_writes(panel, tl)
    eval_labels = _draw_evals(panel, tl)
    _draw_markers(panel, tl)
    _draw_axes(panel, tl, unit, timeline_title, below=-0.13 if ax2 is not None else -0.2)
    if ax2 is not None:
        _draw_accuracy(ax2, tl, draw_evals, tl.passing)
    fig.tight_layout()
    for labels in (step_labels, eval_labels):
        _hide_overlapping(fig, [text for _, text in sorted(labels, key=lambda p: not p[0])])
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _draw_steps(p: _Panel, tl: Timeline) -> list[tuple[bool, object]]:
    """The training blocks, a tick per step inside a long block, and their labels.

    Returns:
        ``(first in line, Text)`` per label: S0's and ranges' labels win overlaps.
    """
    ax, x, top, h = p.ax, p.x, p.top, p.h
    label_every = max(1, math.ceil(len(tl.steps) / 16))
    step_labels: list[tuple[bool, object]] = []
    previous_last: int | None = None
    for i, (step, a, b) in enumerate(tl.steps):
        ax.broken_barh([(x(a), x(b) - x(a))], (top - h / 2, h), color=TRAIN_COLORS[i % 2])
        inside = [s for s, t in tl.step_ticks if a <= t <= b]
        if len(inside) > 1:  # one long block: a tick per tracked_stats step logged inside it
            ax.vlines([x(t) for s, t in tl.step_ticks if a <= t <= b], top - h / 2, top + h / 2, color="white", linewidth=0.6)
        # the block's steps follow the previous block's; its own last step may log its tracked_stats after
        # block_stop (the reference logs a step's stats after its evaluation), so the range is not the ticks'
        first = previous_last + 1 if previous_last is not None else min(inside, default=step)
        if step is not None and first is not None and first < step:
            step_labels.append((True, ax.text(x((a + b) / 2), top + h / 2 + 0.05, f"steps {first}-{step}",
                                              ha="center", va="bottom", fontsize=7, color="#333")))
        elif step is not None and (step % label_every == 0 or step == tl.first_eval_step):
            step_labels.append((step == tl.first_eval_step, ax.text(x((a + b) / 2), top + h / 2 + 0.05, str(step),
                                                                    ha="center", va="bottom", fontsize=7, color="#333")))
        previous_last = step if step is not None else previous_last
    return step_labels


def _draw_checkpoint_writes(p: _Panel, tl: Timeline) -> None:
    """The checkpoint writes' bars, each with a mark where it began."""
    y = p.lanes.get("checkpoint writes")
    for step, a, b in tl.checkpoint_writes:
        p.ax.broken_barh([(p.x(a), max(p.x(b) - p.x(a), p.min_width))], (y - p.h / 2, p.h), color=CKPT_COLOR, zorder=3)
        p.ax.plot([p.x(a)], [y], marker="|", markersize=14, markeredgewidth=1.5, color=CKPT_COLOR, zorder=4)


def _draw_evals(p: _Panel, tl: Timeline) -> list[tuple[bool, object]]:
    """The evaluations' bars (passing or not) and their step labels.

    Returns:
        ``(first in line, Text)`` per label: the passing evaluation's label wins overlaps.
    """
    eval_labels: list[tuple[bool, object]] = []
    y = p.lanes[p.eval_lane]
    for e in tl.evals:
        a = e.start_ms if e.start_ms is not None else e.stop_ms
        color = PASS_COLOR if e.passed else FAIL_COLOR
        p.ax.broken_barh([(p.x(a), max(p.x(e.stop_ms) - p.x(a), p.min_width))], (y - p.h / 2, p.h), color=color,
                         edgecolor="white", linewidth=0.5)
        if e.step is not None:
            eval_labels.append((e is tl.passing, p.ax.text(p.x((a + e.stop_ms) / 2), y - p.h / 2 - 0.08, str(e.step),
                                                           ha="center", va="top", fontsize=7, color="#333")))
    return eval_labels


def _draw_markers(p: _Panel, tl: Timeline) -> None:
    """Where step S0 began, ``run_start``, and ``run_stop`` with its span (:func:`_draw_run_stop`)."""
    ax, x = p.ax, p.x
    if tl.first_eval_step is not None:
        # where step S0 began: the end of step S0-1 inside a long block, else the start of S0's block
        s0 = [t for step, t in tl.step_ticks if step == tl.first_eval_step - 1] or [
            a for step, a, _ in tl.steps if step == tl.first_eval_step]
        if s0:
            ax.axvline(x(s0[0]), color="#888", linestyle=":", linewidth=1)
            ax.text(x(s0[0]), p.top + 0.72, f" first eval step S0={tl.first_eval_step}", fontsize=8, color="#555", va="bottom")
    if tl.run_start_ms is not None:
        ax.axvline(x(tl.run_start_ms), color="#444", linestyle="--", linewidth=1)
        ax.text(x(tl.run_start_ms), -0.95, " run_start", ha="left", fontsize=8, color="#444")  # inside the axes
    if tl.run_stop_ms is not None:
        _draw_run_stop(p, tl)


def _draw_run_stop(p: _Panel, tl: Timeline) -> None:
    """``run_stop`` (a star on the steps' lane), the backdating arrow from the passing
    evaluation of a deferred run, and the time-to-train span (or why there is none)."""
    ax, x, passing = p.ax, p.x, tl.passing
    ok = tl.status == "success"
    stop_color = PASS_COLOR if ok else FAIL_COLOR
    xs = x(tl.run_stop_ms)
    ax.axvline(xs, color=stop_color, linewidth=2)
    ax.plot([xs], [p.top], marker="*", markersize=16, color=stop_color, markeredgecolor="black", zorder=5)
    ax.text(xs, -0.95, " " + run_stop_label(tl), fontsize=8, color=stop_color, fontweight="bold")
    if passing is not None and tl.mode.mode == DEFERRED:
        y = p.lanes[p.eval_lane] + p.h / 2
        ax.annotate("", xy=(xs, p.top - 0.2), xytext=(x(passing.stop_ms), y),
                    arrowprops={"arrowstyle": "->", "color": stop_color, "linestyle": "--", "connectionstyle": "arc3,rad=0.25"})
        ax.text(x(passing.stop_ms), y + 0.1, "pass: backdated", fontsize=8, color=stop_color, ha="right")  # ends at its bar
    if tl.run_start_ms is None:
        return
    x0 = x(tl.run_start_ms)
    ax.axvspan(min(x0, xs), max(x0, xs), color=PASS_COLOR if ok else FAIL_COLOR, alpha=0.07)
    if tl.has_score:
        what = "evaluation included" if tl.mode.mode == INLINE else (
            "evaluation excluded" if tl.mode.mode == DEFERRED else "run_start to run_stop")
        ax.annotate("", xy=(xs, -0.7), xytext=(x0, -0.7), arrowprops={"arrowstyle": "<->", "color": "#222"})
        ax.text((x0 + xs) / 2, -0.65, f"time-to-train {fmt_duration(tl.time_to_train_ms)} ({what})",
                ha="center", va="bottom", fontsize=9)
    else:
        ax.text((x0 + xs) / 2, -0.65, f"{tl.status}: no time-to-train (no evaluation passed; the run has no score)",
                ha="center", va="bottom", fontsize=9, color=FAIL_COLOR)


def _draw_axes(p: _Panel, tl: Timeline, unit: str, title: str, below: float) -> None:
    """The upper panel's lanes, limits, time axis, title and legend (``below``: the
    legend's top in axes units, under the time axis)."""
    from matplotlib.patches import Patch

    ax = p.ax
    ax.set_yticks(list(p.lanes.values()), list(p.lanes.keys()))
    ax.set_ylim(-1.05, p.top + 0.95)
    ax.set_xlabel(f"wall-clock time since run_start ({unit})")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title, fontsize=10, loc="left")
    handles = [Patch(color=TRAIN_COLORS[0], label="training step (block)")]
    handles += [Patch(color=CKPT_COLOR, label="checkpoint write")] if tl.checkpoint_writes else []
    handles += [Patch(color=FAIL_COLOR, label="eval: below target"), Patch(color=PASS_COLOR, label="eval: passes")]
    ax.legend(handles=handles, loc="upper left", fontsize=8, ncol=4, framealpha=0.9, bbox_to_anchor=(0.0, below))


def _hide_overlapping(fig, texts: list) -> None:
    """Hide each text of ``texts`` (matplotlib ``Text``, in order of priority) whose drawn
    box, in pixels, overlaps one kept before it: step labels never print over each other."""
    renderer = fig.canvas.get_renderer()
    kept = []
    for text in texts:
        box = text.get_window_extent(renderer).expanded(1.15, 1.0)  # a little air between neighbours
        if any(box.overlaps(other) for other in kept):
            text.set_visible(False)
        else:
            kept.append(box)


def _draw_accuracy(ax2, tl: Timeline, evals: list[EvalSpan], passing: EvalSpan | None) -> None:
    """The lower panel: eval_accuracy per step against the target."""
    if evals:
        ax2.plot([e.step for e in evals], [e.accuracy for e in evals], color="#555", linewidth=1, zorder=1)
        ax2.scatter([e.step for e in evals], [e.accuracy for e in evals], c=[PASS_COLOR if e.passed else FAIL_COLOR for e in evals],
                    s=45, zorder=2, edgecolors="black", linewidths=0.5)
    ax2.axhline(tl.target, color="#222", linestyle="--", linewidth=1)
    ax2.annotate(f"target {tl.target} (a pass is strictly greater)", xy=(1.0, tl.target), xycoords=ax2.get_yaxis_transform(),
                 xytext=(-4, 3), textcoords="offset points", fontsize=8, va="bottom", ha="right")
    if passing is not None and passing.step is not None and passing.accuracy is not None:
        # above the point (a pass is above the target line), so the target line never crosses the label
        ax2.annotate(f"first pass: step {passing.step}, {passing.accuracy:.4f}, samples_count {passing.samples_count}",
                     xy=(passing.step, passing.accuracy), xytext=(-10, 12), textcoords="offset points", fontsize=8,
                     ha="right", va="bottom", arrowprops={"arrowstyle": "->"}, color=PASS_COLOR, fontweight="bold",
                     bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none", "alpha": 0.85})
    ckpt_steps = [s for s, _, _ in tl.checkpoint_writes]
    evaluated = {e.step for e in evals}
    not_evaluated = [s for s in ckpt_steps if s not in evaluated]
    accs = [e.accuracy for e in evals] + [tl.target]
    lo, hi = min(accs), max(accs)
    pad = max((hi - lo) * 0.25, 0.01)
    if not_evaluated:
        ax2.scatter(not_evaluated, [lo - pad * 0.6] * len(not_evaluated), marker="|", color="#999", s=60,
                    label="checkpoint saved, not evaluated" + (" (after the pass)" if passing is not None else ""))
        ax2.legend(loc="upper left", fontsize=8)
    ax2.set_ylim(lo - pad, hi + 2 * pad)  # room above the highest point for the first-pass label
    steps_all = [e.step for e in evals] + ckpt_steps
    if steps_all:
        ax2.set_xlim(min(steps_all) - 0.7, max(steps_all) + 0.7)
        ax2.xaxis.get_major_locator().set_params(integer=True)
    ax2.set_xlabel("training step (checkpoint)" + (f";  samples_count = step x GBS {tl.global_batch_size}" if tl.global_batch_size else ""))
    ax2.set_ylabel("eval_accuracy (pass@k)")
    ax2.grid(alpha=0.3)
    ax2.set_title("eval accuracy per checkpoint", fontsize=10, loc="left")
