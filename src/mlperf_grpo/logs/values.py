"""Reads of MLPerf logs shared by the log tools and the merge core: a log file's text
(:func:`load_log_text`, the only function here that raises), its run directory, which
values are numbers or integers, the logged global batch size, times for messages, and
the weight-update times recorded by the checkpoints still on disk. Torch-free; a value
of the wrong type reads as absent."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mlperf_grpo.logs.mllog import PREFIX, LogEvent, ParsedLog

EVAL_KEYS = ("eval_start", "eval_accuracy", "eval_stop")
"""The keys of one evaluation's events, in the order they are written."""


class UnreadableLog(ValueError):
    """The input is not an MLPerf log at all (missing, empty, binary, no ``:::MLLOG`` line)."""


def load_log_text(path: Path) -> str:
    """The text of an MLPerf log (bytes that are not UTF-8 are replaced).

    Raises:
        UnreadableLog: the file is missing or unreadable, empty, binary (contains NUL
            bytes), or has no ``:::MLLOG`` line. The message is one line.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UnreadableLog(f"{path}: no such file") from None
    except OSError as err:
        raise UnreadableLog(f"{path}: cannot read: {err.strerror or err}") from None
    if not data.strip():
        raise UnreadableLog(f"{path}: the file is empty")
    if b"\x00" in data:
        raise UnreadableLog(f"{path}: a binary file, not an MLPerf log")
    text = data.decode("utf-8", errors="replace")
    if PREFIX.strip() not in text:
        raise UnreadableLog(f"{path}: no ':::MLLOG' lines; not an MLPerf log")
    return text


def find_run_dir(log_path: Path) -> Path | None:
    """The run directory of a log written by ``mlperf-grpo run``: the log's folder when it
    holds ``run.json``, ``checkpoints/`` or ``eval/``; else None."""
    parent = Path(log_path).resolve().parent
    if any((parent / name).exists() for name in ("run.json", "checkpoints", "eval")):
        return parent
    return None


def int_or_none(value: Any) -> int | None:
    """``value`` when it is an int (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def samples_count_of(e: LogEvent) -> int | None:
    """The event's integer ``samples_count`` metadata, or None (missing or wrong type)."""
    return int_or_none(e.metadata.get("samples_count"))


def ms_text(value: float) -> str:
    """A time in ms for a message: whole ms as digits (``1795998424706``, never ``1.8e+12``,
    which prints two different times alike); a fractional one with its fraction."""
    if isinstance(value, int):
        return str(value)
    return f"{value:.0f}" if value.is_integer() else repr(value)


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


def step_window(train: ParsedLog, step: int, gbs: int) -> tuple[LogEvent | None, LogEvent | None]:
    """The training log's bounds on the weight-update time of ``step``: the ``block_stop``
    that ends step - 1 (at ``(step - 1) * GBS``; ``run_start`` for step 1) and the first
    event that ends ``step`` (``block_stop`` or ``tracked_stats`` at ``step * GBS``). The
    update happens after the first and no later than the second (right after the optimizer
    step, inside the step's block; a step's stats are logged after it). None where the log
    has no such event (one block spanning many steps has no ``block_stop`` between them:
    no lower bound)."""
    def ends(sc: int, keys: tuple[str, ...]) -> list[LogEvent]:
        return [e for e in train.events if e.key in keys and samples_count_of(e) == sc and is_number(e.time_ms)]
    before = ends((step - 1) * gbs, ("block_stop",)) if step > 1 else train.find("run_start")
    after = ends(step * gbs, ("block_stop", "tracked_stats")) if step > 0 else train.find("run_start")
    return (max(before, key=lambda e: e.time_ms) if before else None,
            min(after, key=lambda e: e.time_ms) if after else None)
