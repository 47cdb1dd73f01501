"""MLPerf log writer over ``mlperf_logging.mllog`` and a reader of existing logs.

The writer lets ``mlperf_logging`` encode every line (same JSON layout, same
``file``/``lineno`` metadata as any MLPerf log) but collects the lines in memory and
appends them to the log file in one ``write`` followed by ``fsync`` when
:meth:`MLLogWriter.commit` is called. A group of events that belongs together (an
evaluation's ``eval_start``/``eval_accuracy``/``eval_stop``) therefore reaches the file
all at once or not at all.

``commit(durable=False)`` skips the ``fsync`` (the lines are in the file, and survive a
kill of the process, but not yet a power loss): the trainer commits its per-step events
so, because an ``fsync`` on the training path can wait behind a checkpoint's gigabytes
being flushed by the background writer (one H200, 2.8 GB checkpoints: up to 0.9 s per
``fsync``). :meth:`MLLogWriter.sync` makes everything committed so far durable; the
checkpoint writer calls it, off the clock, before it publishes a ``step_N/``, so a
published checkpoint never outlives the log lines of its step.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlperf_logging.mllog import constants as C  # noqa: N812  (the library's own name)
from mlperf_logging.mllog.mllog import MLLogger

from mlperf_grpo.errors import LogWriteError

PREFIX = ":::MLLOG "
_logger_ids = itertools.count()


def now_ms() -> int:
    """Wall-clock Unix time in integer milliseconds: the MLPerf log's clock."""
    return int(time.time() * 1000)


class _Lines(logging.Handler):
    """A logging handler that keeps formatted records in a list."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class DiscardingLogWriter:
    """The :class:`MLLogWriter` interface, writing nothing: the log of a data-parallel
    rank other than 0 (rank 0 alone writes the run's one MLPerf log)."""

    path = None

    def event(self, key: str, value: Any = None, metadata: dict | None = None, time_ms: int | None = None) -> None:
        """Drop the event."""

    def start(self, key: str, value: Any = None, metadata: dict | None = None, time_ms: int | None = None) -> None:
        """Drop the event."""

    def end(self, key: str, value: Any = None, metadata: dict | None = None, time_ms: int | None = None) -> None:
        """Drop the event."""

    def commit(self, durable: bool = True) -> None:
        """Nothing to write."""

    def sync(self) -> None:
        """Nothing to flush."""


class MLLogWriter:
    """Appends MLPerf events to one log file; lines are written on :meth:`commit`.

    Args:
        path: the log file; created (with parent directories) if missing, else appended to.
    Raises:
        LogWriteError: the file cannot be opened for appending (one-line message).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a"):
                pass
        except OSError as err:
            raise LogWriteError(f"cannot write MLPerf log {self.path}: {err.strerror}") from None
        logger = logging.getLogger(f"mlperf_grpo.logs.mllog.{next(_logger_ids)}")
        logger.propagate = False
        logger.setLevel(logging.INFO)
        self._lines = _Lines()
        logger.handlers = [self._lines]
        # stack_offset 2: the caller of event()/start()/end() below is named as "file".
        self._mllogger = MLLogger(logger=logger, default_stack_offset=2)

    def event(self, key: str, value: Any = None, metadata: dict | None = None, time_ms: int | None = None) -> None:
        """Queue a POINT_IN_TIME event (``time_ms`` defaults to now, Unix ms)."""
        self._mllogger.event(key, value, metadata=metadata, time_ms=time_ms)

    def start(self, key: str, value: Any = None, metadata: dict | None = None, time_ms: int | None = None) -> None:
        """Queue an INTERVAL_START event."""
        self._mllogger.start(key, value, metadata=metadata, time_ms=time_ms)

    def end(self, key: str, value: Any = None, metadata: dict | None = None, time_ms: int | None = None) -> None:
        """Queue an INTERVAL_END event."""
        self._mllogger.end(key, value, metadata=metadata, time_ms=time_ms)

    def commit(self, durable: bool = True) -> None:
        """Append the queued lines in one write, then (``durable``) fsync the file.

        Raises:
            LogWriteError: the write failed; the queued lines are kept for a retry.
        """
        if not self._lines.lines:
            if durable:
                self.sync()
            return
        data = ("\n".join(self._lines.lines) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                written = os.write(fd, data)
                if written != len(data):
                    raise OSError(28, f"short write ({written} of {len(data)} bytes)")
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as err:
            raise LogWriteError(f"cannot append to MLPerf log {self.path}: {err.strerror or err}") from None
        self._lines.lines.clear()

    def sync(self) -> None:
        """fsync the log file: every line committed so far is durable when this returns.
        Safe to call from another thread (it opens its own descriptor).

        Raises:
            LogWriteError: the file cannot be opened or synced.
        """
        try:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as err:
            raise LogWriteError(f"cannot fsync MLPerf log {self.path}: {err.strerror or err}") from None


@dataclass(frozen=True)
class LogEvent:
    """One parsed ``:::MLLOG`` line. ``line_no`` is 1-based in the file."""

    line_no: int
    key: str
    value: Any
    time_ms: int | float | None
    event_type: str | None
    metadata: dict = field(default_factory=dict)


@dataclass
class ParsedLog:
    """All MLPerf events of a log file, in file order, and the lines that did not parse."""

    events: list[LogEvent]
    bad_lines: list[tuple[int, str]]
    """``(line_no, reason)`` for ``:::MLLOG`` lines whose JSON is invalid."""

    def find(self, key: str) -> list[LogEvent]:
        """Events with exactly this key, in file order."""
        return [e for e in self.events if e.key == key]

    def first_value(self, key: str, default: Any = None) -> Any:
        """The ``value`` of the first event with this key, or ``default`` if none."""
        found = self.find(key)
        return found[0].value if found else default


def loads_line(line: str) -> Any:
    """The JSON after ``:::MLLOG`` in one line.

    Raises:
        ValueError: no ``:::MLLOG`` in the line, invalid JSON, or JSON nested too deeply
            for the parser (``RecursionError`` is turned into ``ValueError``).
    """
    at = line.find(PREFIX)
    if at < 0:
        raise ValueError("no ':::MLLOG' prefix")
    try:
        return json.loads(line[at + len(PREFIX):])
    except RecursionError:
        raise ValueError("JSON nested too deeply to parse") from None


def parse_log_text(text: str) -> ParsedLog:
    """Parse MLPerf log text; lines without ``:::MLLOG`` are ignored. Never raises
    (invalid or too deeply nested JSON becomes a ``bad_lines`` entry)."""
    events: list[LogEvent] = []
    bad: list[tuple[int, str]] = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if PREFIX not in line:
            continue
        try:
            d = loads_line(line)
        except ValueError as err:
            bad.append((line_no, f"invalid JSON: {err}"))
            continue
        if not isinstance(d, dict) or not isinstance(d.get("key"), str):
            bad.append((line_no, "not an object with a string 'key'"))
            continue
        metadata = d.get("metadata")
        events.append(
            LogEvent(
                line_no=line_no,
                key=d["key"],
                value=d.get("value"),
                time_ms=d.get("time_ms") if isinstance(d.get("time_ms"), (int, float)) else None,
                event_type=d.get("event_type") if isinstance(d.get("event_type"), str) else None,
                metadata=metadata if isinstance(metadata, dict) else {},
            )
        )
    return ParsedLog(events=events, bad_lines=bad)


def read_log(path: str | Path) -> ParsedLog:
    """Read and parse an MLPerf log file (bytes that are not UTF-8 are replaced).

    Raises:
        OSError: the file cannot be read.
    """
    return parse_log_text(Path(path).read_bytes().decode("utf-8", errors="replace"))


def time_to_train_ms(log: ParsedLog) -> int | None:
    """``run_stop.time_ms - run_start.time_ms`` of the first of each, or None if missing."""
    starts, stops = log.find(C.RUN_START), log.find(C.RUN_STOP)
    if not starts or not stops or starts[0].time_ms is None or stops[0].time_ms is None:
        return None
    return int(stops[0].time_ms - starts[0].time_ms)
