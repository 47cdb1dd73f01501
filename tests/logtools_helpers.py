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
    (or the last step's, when none passes)."""
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
    stop_step = passing if passing is not None else s0 + len(accs) - 1
    events.append(ev("run_stop", t=stop_of[stop_step], md={"status": status, "samples_count": stop_step * gbs, "step": stop_step}, et="INTERVAL_END"))
    return events


def to_text(events: list[dict]) -> str:
    return "".join(":::MLLOG " + json.dumps(e) + "\n" for e in events)


def find(events: list[dict], key: str, step: int | None = None) -> int:
    """Index of the first event with ``key`` (and metadata step)."""
    return next(i for i, e in enumerate(events) if e["key"] == key and (step is None or e["metadata"].get("step") == step))
