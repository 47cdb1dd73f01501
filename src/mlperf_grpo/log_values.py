"""Typed reads of MLPerf log values shared by the log tools and the merge core: which
values are numbers or integers, the logged global batch size, and the weight-update
times recorded by the checkpoints still on disk. Torch-free; no function raises on any
input (a value of the wrong type reads as absent)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mlperf_grpo.mllog import ParsedLog

EVAL_KEYS = ("eval_start", "eval_accuracy", "eval_stop")
"""The keys of one evaluation's events, in the order they are written."""


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_int(value: Any) -> bool:
    """An int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def logged_global_batch_size(log: ParsedLog) -> int | None:
    """The first logged ``global_batch_size`` when it is a positive integer (``64.0`` reads
    as 64), else ``None``."""
    found = log.find("global_batch_size")
    value = found[0].value if found else None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if is_int(value) and value > 0 else None


def checkpoint_records(run_dir: Path | None) -> dict[int, tuple[Path, int]]:
    """samples_count -> (record path, weight-update time in Unix ms) from the checkpoints
    still on disk.

    Reads only the two fields needed from each ``checkpoints/step_N/training_info.json``
    (not :func:`mlperf_grpo.checkpoint.read_training_info`, which rejects records of
    other format versions); unreadable records are skipped.
    """
    found: dict[int, tuple[Path, int]] = {}
    root = run_dir / "checkpoints" if run_dir else None
    if root is None or not root.is_dir():
        return found
    for path in sorted(root.glob("step_*/training_info.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError):
            continue
        if isinstance(record, dict) and is_int(record.get("samples_count")) and is_int(record.get("training_step_end_time_ms")):
            found[record["samples_count"]] = (path, record["training_step_end_time_ms"])
    return found
