"""Clean stops on SIGTERM: raise at a safe point, never in the middle of staging a checkpoint."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


class TrainingStopped(KeyboardInterrupt):
    """SIGTERM asked training to stop (handled like Ctrl-C: ``run_stop`` aborted)."""


class GracefulStop:
    """While active, SIGTERM raises :class:`TrainingStopped` in the main thread, except
    inside :meth:`deferred` blocks (a checkpoint write), where it is held until the block
    ends, so the checkpoint is finished rather than torn. Ctrl-C (SIGINT) raises
    ``KeyboardInterrupt`` as usual. After the first SIGTERM has raised, later ones are
    ignored, so stopping (publishing the checkpoints in flight) is not cut short."""

    def __init__(self) -> None:
        self._depth = 0
        self._pending = False
        self._stopping = False
        self._previous = None

    def _handler(self, signum: int, frame: object) -> None:
        if self._stopping:
            return
        if self._depth:
            self._pending = True
            return
        self._stopping = True
        raise TrainingStopped("stopped by SIGTERM")

    def __enter__(self) -> "GracefulStop":
        self._previous = signal.signal(signal.SIGTERM, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self._previous)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold SIGTERM until the block ends, then stop if one arrived."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self._pending and not self._depth:
            self._pending = False
            self._stopping = True
            raise TrainingStopped("stopped by SIGTERM (after staging the checkpoint; publishing those in flight)")
