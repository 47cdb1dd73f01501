"""Shared by test_check.py, test_merge.py and test_report.py: a stored real run, a live
run once per session, and a small synthetic log builder (lint-level, not a full compliant log)."""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path

from mlperf_grpo.cli import main

GBS = 256
S0 = 18


DATA = Path(__file__).parent / "data" / "real_run"
"""A run of the default benchmark made by ``mlperf-grpo run --retain-checkpoints``: its
log, ``eval/summary.json``, one ``eval/step_N.jsonl`` and every checkpoint's
``training_info.json`` (weights left out). Regenerate with that command when the log
format changes."""


def real_run() -> Path:
    """A fresh copy of the stored real run directory (tests may modify it)."""
    out = Path(tempfile.mkdtemp(prefix="mlperf-grpo-logtools-")) / "run"
    shutil.copytree(DATA, out)
    return out


@functools.lru_cache(maxsize=None)
def live_run() -> Path:
    """Run the default benchmark now (seconds to a minute) with checkpoints retained."""
    out = Path(tempfile.mkdtemp(prefix="mlperf-grpo-logtools-live-")) / "run"
    assert main(["run", "--output", str(out), "--retain-checkpoints"]) == 0
    return out


def ev(key, value=None, t=0, md=None, et="POINT_IN_TIME") -> dict:
    return {"namespace": "", "time_ms": t, "event_type": et, "key": key, "value": value, "metadata": dict(md or {})}


def synth(accs=(0.5, 0.6, 0.7), steps=22, status="success", gbs=GBS) -> list[dict]:
    """Events of a small log: training ``steps`` steps, then evaluations from S0 with
    accuracies ``accs``, then a run_stop backdated to the passing step's block_stop
    (or, when none passes, the final step's)."""
    s0 = -(-(5 * gbs + 7680) // (2 * gbs))
    events = [ev("submission_benchmark", "qwen35_397b_grpo"), ev("submission_division", "closed"),
              ev("global_batch_size", gbs), ev("eval_samples", 251), ev("run_start", t=1000, et="INTERVAL_START")]
    stop_of = {}
    for s in range(1, steps + 1):
        events.append(ev("block_start", t=1000 + 100 * (s - 1), md={"samples_count": (s - 1) * gbs, "step": s}, et="INTERVAL_START"))
        stop_of[s] = 1000 + 100 * s - 10
        events.append(ev("block_stop", t=stop_of[s], md={"samples_count": s * gbs, "step": s}, et="INTERVAL_END"))
    t = 1000 + 100 * steps + 50
    passing = None
    for i, acc in enumerate(accs):
        s = s0 + i
        md = {"samples_count": s * gbs, "step": s}
        events += [ev("eval_start", t=t, md=md, et="INTERVAL_START"), ev("eval_accuracy", acc, t=t + 15, md=md),
                   ev("eval_stop", t=t + 15, md=md, et="INTERVAL_END")]
        t += 20
        if acc > 0.69 and passing is None:
            passing = s
    stop_step = passing if passing is not None else steps  # aborted: the final checkpoint
    events.append(ev("run_stop", t=stop_of.get(stop_step, t), md={"status": status, "samples_count": stop_step * gbs, "step": stop_step}, et="INTERVAL_END"))
    return events


def to_text(events: list[dict]) -> str:
    return "".join(":::MLLOG " + json.dumps(e) + "\n" for e in events)


def find(events: list[dict], key: str, step: int | None = None) -> int:
    """Index of the first event with ``key`` (and metadata step)."""
    return next(i for i, e in enumerate(events) if e["key"] == key and (step is None or e["metadata"].get("step") == step))


STEP_MS = 382_000
"""Reference step time at GBS 256 (DESIGN.md): the reference-style logs below use it."""
EVAL_MS = 1_000_000
"""About one inline evaluation of the reference runs."""


def reference_style(accs=(0.72,), gbs=GBS, inline=True, max_steps=None) -> list[dict]:
    """Events in the shape of the reference implementation's logs (issue 16), from our own
    numbers: ``tracked_stats`` per step with ``samples_count`` and ``step``; one
    ``block_start`` (``step`` = the block's first step - 1, ``samples_count`` = where it ends)
    and ``block_stop`` per stretch of training; ``eval_start`` with ``step``,
    ``eval_accuracy``/``eval_stop`` with ``samples_count`` only; no 6.1 precision keys and
    ``eval_samples`` 256, as the reference logs have.

    ``inline``: training stops at each eval step from S0, evaluates on the clock, and
    ``run_stop`` follows the passing ``eval_accuracy`` by 5 ms (or, when none passes, the
    last evaluation, at the final step ``S0 + len(accs) - 1``: aborted).
    Deferred: one block trains to ``max_steps`` (default the last evaluated step), then the
    checkpoints are evaluated and ``run_stop`` is backdated to the passing (or final)
    step's ``tracked_stats`` time.
    """
    s0 = -(-(5 * gbs + 7680) // (2 * gbs))
    t0 = 1_000_000
    events = [ev("submission_benchmark", "qwen35_397b_grpo", t=t0 - 50), ev("submission_division", "closed", t=t0 - 50),
              ev("submission_org", "reference", t=t0 - 50), ev("global_batch_size", gbs, t=t0 - 40), ev("eval_samples", 256, t=t0 - 40),
              ev("init_start", t=t0 - 30, et="INTERVAL_START"), ev("init_stop", t=t0 - 10, et="INTERVAL_END"),
              ev("run_start", t=t0, et="INTERVAL_START")]
    t = t0
    stats_ms: dict[int, int] = {}

    def train(first: int, last: int) -> None:
        nonlocal t
        events.append(ev("block_start", t=t, md={"samples_count": last * gbs, "step": first - 1}, et="INTERVAL_START"))
        for s in range(first, last + 1):
            t += STEP_MS
            stats_ms[s] = t
            events.append(ev("tracked_stats", {"loss": 0.1, "reward_mean": 0.5 + s / 100}, t=t, md={"samples_count": s * gbs, "step": s}))
        t += 5
        events.append(ev("block_stop", t=t, md={"samples_count": last * gbs}, et="INTERVAL_END"))

    def evaluate(s: int, acc: float) -> None:
        nonlocal t
        events.append(ev("eval_start", t=t + 10, md={"samples_count": s * gbs, "step": s}, et="INTERVAL_START"))
        t += EVAL_MS
        events.append(ev("eval_accuracy", acc, t=t, md={"samples_count": s * gbs}))
        events.append(ev("eval_stop", t=t + 2, md={"samples_count": s * gbs}, et="INTERVAL_END"))
        t += 2

    passing = next((s0 + i for i, a in enumerate(accs) if a > 0.69), None)
    last_eval = passing if passing is not None else s0 + len(accs) - 1
    if inline:
        train(1, s0)
        for i, acc in enumerate(accs[: last_eval - s0 + 1]):
            if i:
                train(s0 + i, s0 + i)
            evaluate(s0 + i, acc)
        events.append(ev("run_stop", t=t + 5, md={"samples_count": last_eval * gbs, "status": "success" if passing else "aborted"},
                         et="INTERVAL_END"))
        return events
    final = max_steps or s0 + len(accs) - 1
    train(1, final)
    for i, acc in enumerate(accs[: last_eval - s0 + 1]):
        evaluate(s0 + i, acc)
    stop_step = passing if passing is not None else final
    events.append(ev("run_stop", t=stats_ms[stop_step], md={"samples_count": stop_step * gbs, "status": "success" if passing else "aborted"},
                     et="INTERVAL_END"))
    return events


def figure_texts(tl):
    """``(texts, figure)``: the report's figure for ``tl`` (drawn by ``render_png``, kept from
    being closed) and every text drawn in it (title, axis titles, labels, annotations; not hidden ones)."""
    import matplotlib

    from mlperf_grpo.logs.report.png import render_png

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    before = set(plt.get_fignums())
    captured = {}
    original_close = plt.close

    def keep(fig=None):
        if fig is not None and not isinstance(fig, str):
            captured["fig"] = fig
        return original_close(fig)

    plt.close = keep
    try:
        render_png(tl)
    finally:
        plt.close = original_close
    fig = captured["fig"]
    assert set(plt.get_fignums()) == before
    texts = [t.get_text() for t in fig.findobj(matplotlib.text.Text) if t.get_text() and t.get_visible()]
    return texts, fig
