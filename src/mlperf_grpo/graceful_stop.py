"""Clean stops on SIGTERM: raise at a safe point, never in the middle of staging a checkpoint.

The CLI holds a :class:`GracefulStop` for the whole command (training and evaluation);
the trainer holds its own to defer SIGTERM while it stages a checkpoint.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM asked the process to stop; handled like Ctrl-C (the CLI exits 143, Ctrl-C 130)."""


class GracefulStop:
    """While active, SIGTERM raises :class:`Terminated` in the main thread, except
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
        raise Terminated("stopped by SIGTERM")

    def __enter__(self) -> "GracefulStop":
        self._previous = signal.signal(signal.SIGTERM, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self._previous)

    def stopping(self) -> None:
        """The caller is stopping already (handling an error, publishing the checkpoints
        in flight): from now on SIGTERM is ignored, as after the first one (under torchrun
        the SIGTERM that follows another rank's failure must not cut that short)."""
        self._stopping = True

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
            raise Terminated("stopped by SIGTERM (after staging the checkpoint; publishing those in flight)")
