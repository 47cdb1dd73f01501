"""``mlperf-grpo report``: a timeline picture of one run, as PNG (matplotlib) or HTML.

The upper panel puts the run on one wall-clock axis (seconds, minutes or hours since
``run_start``): training blocks (``block_start``..``block_stop``; a block that spans many
steps is one bar with a tick per ``tracked_stats`` step), checkpoint writes (deferred
runs: from a step's ``block_stop`` to the next ``block_start``, for steps from the first
eval step on), each evaluation (``eval_start``..``eval_stop``), ``run_stop`` and the
time-to-train span. Labels follow the evaluation mode the log shows
(:func:`mlperf_grpo.check.shape.evaluation_mode`): deferred runs are drawn with the
backdated ``run_stop`` at the passing checkpoint's weight-update time, inline runs with
``run_stop`` at the end of the passing evaluation; an aborted run has no score and gets
no time-to-train arrow. The lower panel plots ``eval_accuracy`` per step against the
target (absent when the log has no evaluation). Only the log is read.
"""

from __future__ import annotations

import base64
import html
import io
import math
from dataclasses import dataclass, field
from pathlib import Path

from mlperf_grpo import rules
from mlperf_grpo.check import load_log_text
from mlperf_grpo.log_values import is_int, is_number, logged_global_batch_size
from mlperf_grpo.check.shape import DEFERRED, INLINE, EvalMode, evaluation_mode
from mlperf_grpo.mllog import ParsedLog, parse_log_text

SUFFIXES = (".png", ".html", ".htm")


class ReportError(ValueError):
    """The report cannot be written as asked (unknown output type, nothing to draw)."""


@dataclass
class EvalSpan:
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


# --- drawing -------------------------------------------------------------------------

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


def _fmt_duration(ms: float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms / 60000:.3f} min ({ms / 1000:.3f} s)" if abs(ms) < 3_600_000 else f"{ms / 60000:.1f} min ({ms / 3_600_000:.2f} h)"


def title_of(tl: Timeline) -> str:
    """The report title: benchmark, division, status and score (none for an unsuccessful run)."""
    score = _fmt_duration(tl.time_to_train_ms) if tl.has_score else f"none ({tl.status}: no score)"
    return f"{tl.benchmark}  |  {tl.division} division  |  status: {tl.status}  |  time-to-train: {score}"


MODE_TEXT = {
    DEFERRED: ("evaluation (offline)", "timeline: evaluation runs after training and is taken off the clock"),
    INLINE: ("evaluation (inline)", "timeline: evaluation runs inline, on the clock (training waits for it)"),
}
UNKNOWN_TEXT = ("evaluation", "timeline: the log does not show whether evaluation ran inline or deferred")


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


def render_png(tl: Timeline) -> bytes:
    """Draw the timeline with matplotlib (Agg backend) and return PNG bytes."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = tl.origin_ms
    all_ms = [t for _, a, b in tl.steps for t in (a, b)] + [t for e in tl.evals for t in (e.start_ms, e.stop_ms) if t is not None]
    all_ms += [t for t in (tl.run_start_ms, tl.run_stop_ms) if t is not None]
    span = (max(all_ms) - min(all_ms)) if all_ms else 1.0
    unit, per = _time_unit(span)

    def x(ms: float) -> float:
        return (ms - t0) / per

    draw_evals = [e for e in tl.evals if e.step is not None and e.accuracy is not None]
    if draw_evals:
        fig, (ax, ax2) = plt.subplots(2, 1, figsize=(13, 8.2), gridspec_kw={"height_ratios": [1.25, 1]})
    else:  # a killed run (no evaluation): no empty accuracy panel
        fig, ax = plt.subplots(1, 1, figsize=(13, 4.8))
        ax2 = None
    fig.suptitle(title_of(tl), fontsize=13, fontweight="bold")
    eval_lane, timeline_title = MODE_TEXT.get(tl.mode.mode, UNKNOWN_TEXT)
    # no checkpoint-writes lane for a log without deferred checkpoints (inline runs, killed before S0)
    lanes = {"training steps": 2.0, "checkpoint writes": 1.0, eval_lane: 0.0} if tl.checkpoint_writes else {
        "training steps": 1.0, eval_lane: 0.0}
    top = lanes["training steps"]
    h = 0.6
    min_width = span / per * 0.004  # the narrowest bar drawn: visible at any run length
    label_every = max(1, math.ceil(len(tl.steps) / 16))
    step_labels: list[tuple[bool, object]] = []  # (first in line, text): S0's and ranges' labels win overlaps
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
    for step, a, b in tl.checkpoint_writes:
        ax.broken_barh([(x(a), max(x(b) - x(a), min_width))], (lanes["checkpoint writes"] - h / 2, h), color=CKPT_COLOR, zorder=3)
        ax.plot([x(a)], [lanes["checkpoint writes"]], marker="|", markersize=14, markeredgewidth=1.5, color=CKPT_COLOR, zorder=4)
    eval_labels: list[tuple[bool, object]] = []  # the passing evaluation's label wins overlaps
    for e in tl.evals:
        a = e.start_ms if e.start_ms is not None else e.stop_ms
        color = PASS_COLOR if e.passed else FAIL_COLOR
        ax.broken_barh([(x(a), max(x(e.stop_ms) - x(a), min_width))], (lanes[eval_lane] - h / 2, h), color=color, edgecolor="white", linewidth=0.5)
        if e.step is not None:
            eval_labels.append((e is tl.passing, ax.text(x((a + e.stop_ms) / 2), lanes[eval_lane] - h / 2 - 0.08, str(e.step),
                                                          ha="center", va="top", fontsize=7, color="#333")))
    if tl.first_eval_step is not None:
        # where step S0 began: the end of step S0-1 inside a long block, else the start of S0's block
        s0 = [t for step, t in tl.step_ticks if step == tl.first_eval_step - 1] or [
            a for step, a, _ in tl.steps if step == tl.first_eval_step]
        if s0:
            ax.axvline(x(s0[0]), color="#888", linestyle=":", linewidth=1)
            ax.text(x(s0[0]), top + 0.72, f" first eval step S0={tl.first_eval_step}", fontsize=8, color="#555", va="bottom")
    if tl.run_start_ms is not None:
        ax.axvline(x(tl.run_start_ms), color="#444", linestyle="--", linewidth=1)
        ax.text(x(tl.run_start_ms), -0.95, "run_start ", ha="right", fontsize=8, color="#444")
    passing = tl.passing
    if tl.run_stop_ms is not None:
        ok = tl.status == "success"
        stop_color = PASS_COLOR if ok else FAIL_COLOR
        xs = x(tl.run_stop_ms)
        ax.axvline(xs, color=stop_color, linewidth=2)
        ax.plot([xs], [lanes["training steps"]], marker="*", markersize=16, color=stop_color, markeredgecolor="black", zorder=5)
        ax.text(xs, -0.95, " " + run_stop_label(tl), fontsize=8, color=stop_color, fontweight="bold")
        if passing is not None and tl.mode.mode == DEFERRED:
            ax.annotate("", xy=(xs, lanes["training steps"] - 0.2), xytext=(x(passing.stop_ms), lanes[eval_lane] + h / 2),
                        arrowprops={"arrowstyle": "->", "color": stop_color, "linestyle": "--", "connectionstyle": "arc3,rad=0.25"})
            ax.text(x(passing.stop_ms), lanes[eval_lane] + h / 2 + 0.1, " pass: backdated", fontsize=8, color=stop_color, ha="left")
        if tl.run_start_ms is not None:
            x0 = x(tl.run_start_ms)
            ax.axvspan(min(x0, xs), max(x0, xs), color=PASS_COLOR if ok else FAIL_COLOR, alpha=0.07)
            if tl.has_score:
                what = "evaluation included" if tl.mode.mode == INLINE else (
                    "evaluation excluded" if tl.mode.mode == DEFERRED else "run_start to run_stop")
                ax.annotate("", xy=(xs, -0.7), xytext=(x0, -0.7), arrowprops={"arrowstyle": "<->", "color": "#222"})
                ax.text((x0 + xs) / 2, -0.65, f"time-to-train {_fmt_duration(tl.time_to_train_ms)} ({what})",
                        ha="center", va="bottom", fontsize=9)
            else:
                ax.text((x0 + xs) / 2, -0.65, f"{tl.status}: no time-to-train (no evaluation passed; the run has no score)",
                        ha="center", va="bottom", fontsize=9, color=FAIL_COLOR)
    ax.set_yticks(list(lanes.values()), list(lanes.keys()))
    ax.set_ylim(-1.05, top + 0.95)
    ax.set_xlabel(f"wall-clock time since run_start ({unit})")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(timeline_title, fontsize=10, loc="left")
    handles = [Patch(color=TRAIN_COLORS[0], label="training step (block)")]
    handles += [Patch(color=CKPT_COLOR, label="checkpoint write")] if tl.checkpoint_writes else []
    handles += [Patch(color=FAIL_COLOR, label="eval: below target"), Patch(color=PASS_COLOR, label="eval: passes")]
    ax.legend(handles=handles, loc="upper left", fontsize=8, ncol=4, framealpha=0.9,
              bbox_to_anchor=(0.0, -0.13 if ax2 is not None else -0.2))

    evals = draw_evals
    if ax2 is not None:
        _draw_accuracy(ax2, tl, evals, passing)
    fig.tight_layout()
    for labels in (step_labels, eval_labels):
        _hide_overlapping(fig, [text for _, text in sorted(labels, key=lambda p: not p[0])])
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


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


def render_html(tl: Timeline, png: bytes, log_path: Path) -> str:
    """A self-contained HTML page: title, summary, the PNG (base64) and the eval table."""
    e = html.escape
    rows = "".join(
        f"<tr class='{'pass' if ev.passed else 'fail'}'><td>{e(str(ev.step))}</td><td>{e(str(ev.samples_count))}</td>"
        f"<td>{'-' if ev.accuracy is None else f'{ev.accuracy:.4f}'}</td><td>{'yes' if ev.passed else 'no'}</td>"
        f"<td>{'-' if ev.start_ms is None else f'{(ev.stop_ms - ev.start_ms) / 1000:.3f}'}</td></tr>"
        for ev in tl.evals
    )
    summary = [
        ("log", str(log_path)), ("benchmark", tl.benchmark), ("division", tl.division), ("status", tl.status),
        ("time-to-train", _fmt_duration(tl.time_to_train_ms) if tl.has_score else f"none ({tl.status}: no score)"),
        ("evaluation", f"{tl.mode.mode} ({tl.mode.evidence})"), ("global batch size", str(tl.global_batch_size)),
        ("first eval step", str(tl.first_eval_step)), ("run_stop step", str(tl.run_stop_step)), ("target", f"> {tl.target}"),
    ]
    summary_rows = "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in summary)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title_of(tl))}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }} th, td {{ border: 1px solid #ccc; padding: 4px 10px; text-align: left; }}
tr.pass td {{ background: #e6f4ea; }} tr.fail td {{ background: #fbeaea; }} img {{ max-width: 100%; }}
</style></head><body>
<h1>{e(title_of(tl))}</h1>
<table>{summary_rows}</table>
<img alt="timeline of the run" src="data:image/png;base64,{base64.b64encode(png).decode()}">
<h2>Evaluations (in log order)</h2>
<table><tr><th>step</th><th>samples_count</th><th>eval_accuracy</th><th>passes</th><th>eval duration (s)</th></tr>{rows}</table>
</body></html>
"""


def write_report(log_path: Path, output: Path) -> Path:
    """Read ``log_path`` and write the report to ``output`` (``.png`` or ``.html``).

    Raises:
        UnreadableLog: the log is missing, empty, binary or has no ``:::MLLOG`` line.
        ReportError: ``output`` has another suffix, or the log has no step, evaluation or run_start to draw.
        OSError: ``output`` cannot be written.
    """
    from mlperf_grpo.merge import write_atomic

    output = Path(output)
    if output.suffix.lower() not in SUFFIXES:
        raise ReportError(f"{output}: the report is written as .png or .html, not {output.suffix or 'a file without suffix'}")
    tl = build_timeline(parse_log_text(load_log_text(Path(log_path))))
    if not tl.steps and not tl.evals and tl.run_start_ms is None:
        raise ReportError(f"{log_path}: no run_start, training step or evaluation to draw")
    png = render_png(tl)
    data = png if output.suffix.lower() == ".png" else render_html(tl, png, Path(log_path)).encode()
    write_atomic(output, data)
    return output
