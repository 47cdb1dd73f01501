"""``mlperf-grpo report``: a timeline picture of one run, as PNG (matplotlib) or HTML.

The upper panel puts the run on one wall-clock axis (seconds, minutes or hours since
``run_start``): training blocks (``block_start``..``block_stop``; a block that spans many
steps is one bar with a tick per ``tracked_stats`` step), checkpoint writes (deferred
runs: from a step's ``block_stop`` to the next ``block_start``, for steps from the first
eval step on), each evaluation (``eval_start``..``eval_stop``), ``run_stop`` and the
time-to-train span. Labels follow the evaluation mode the log shows
(:func:`mlperf_grpo.logs.check.shape.evaluation_mode`): deferred runs are drawn with the
backdated ``run_stop`` at the passing checkpoint's weight-update time, inline runs with
``run_stop`` at the end of the passing evaluation; an aborted run has no score and gets
no time-to-train arrow. The lower panel plots ``eval_accuracy`` per step against the
target (absent when the log has no evaluation). Only the log is read.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

from mlperf_grpo.logs.check import load_log_text
from mlperf_grpo.logs.mllog import parse_log_text
from mlperf_grpo.logs.report.png import render_png
from mlperf_grpo.logs.report.timeline import Timeline, build_timeline, fmt_duration, title_of

SUFFIXES = (".png", ".html", ".htm")


class ReportError(ValueError):
    """The report cannot be written as asked (unknown output type, nothing to draw)."""


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
        ("time-to-train", fmt_duration(tl.time_to_train_ms) if tl.has_score else f"none ({tl.status}: no score)"),
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
    from mlperf_grpo.logs.merge import write_atomic

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
