"""Read the next checkpoint while the current one is validated.

A background thread reads each submitted checkpoint with
:func:`~mlperf_grpo.checkpoint.reader.read_verified` (hash-verified as read) into one of
two reusable host buffer sets (pinned when the engine is on a GPU, so the refit is one
DMA per tensor): while checkpoint ``k`` is refit and validated from one set, ``k+1`` is
read into the other. Host memory: two checkpoints' weight bytes (a rank of a
tensor-parallel worker of T ranks: two of its shares, about 2 total/T). Every set is allocated
(pinned) by the thread right around the first read (the first set before it, the others
just after it, sized by that checkpoint), while the engine starts: pinning stalls the
device work of other threads, so none is left to happen during a refit or a validation.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable
from dataclasses import dataclass

import torch

from mlperf_grpo.checkpoint import Checkpoint
from mlperf_grpo.checkpoint.reader import ReadBuffers


@dataclass
class Prefetched:
    """One read checkpoint: ``weights`` (views into ``buffers``) or the ``error`` its read
    raised (whatever its type); ``index`` is the caller's tag (its position in the work
    queue)."""

    index: int
    checkpoint: Checkpoint
    weights: dict[str, torch.Tensor] | None
    error: BaseException | None
    buffers: ReadBuffers


class CheckpointPrefetcher:
    """Reads submitted checkpoints in order in one background thread.

    Args:
        read: ``read(checkpoint, buffers, stop) -> tensors`` (our series:
            ``read_verified``, hash-verified as read, given up at the next chunk once the
            ``threading.Event`` ``stop`` is set; raises on a corrupt or unreadable
            checkpoint; a rank of a tensor-parallel worker: its share,
            ``checkpoint/share_read.read_share``, one buffer of about total/T per set).
        pin: pin the host buffers (the engine is on a GPU).
        buffer_sets: host copies that may exist at once (2: one refit, one being read).
        reserve: allocate every set around the first read: True with
            :meth:`ReadBuffers.reserve` (our series' whole shards), or
            ``reserve(buffers, checkpoint)`` (a tensor-parallel rank's share); False for
            sources whose ``read`` does not use the buffers.
    Use: :meth:`submit` a checkpoint, :meth:`take` it (blocks until read), give its
    buffers back with :meth:`release` once the engine holds the weights; :meth:`close`.
    """

    def __init__(self, read: Callable[[Checkpoint, ReadBuffers, threading.Event], dict[str, torch.Tensor]], pin: bool, buffer_sets: int = 2,
                 reserve: bool | Callable[[ReadBuffers, Checkpoint], None] = True) -> None:
        self._read = read
        self._todo: queue.Queue[tuple[int, Checkpoint] | None] = queue.Queue()
        self._done: queue.Queue[Prefetched] = queue.Queue()
        self._free: queue.Queue[ReadBuffers | None] = queue.Queue()
        sets = [ReadBuffers(pin=pin) for _ in range(buffer_sets)]
        for buffers in sets:
            self._free.put(buffers)
        self._unreserved = sets if reserve else []  # the sets not yet allocated ahead
        self._reserve = reserve if callable(reserve) else ReadBuffers.reserve
        self._stop = threading.Event()  # set by close(): the thread gives up what it does
        self._thread = threading.Thread(target=self._run, name="checkpoint-prefetch", daemon=True)
        self._thread.start()

    def submit(self, index: int, checkpoint: Checkpoint) -> None:
        """Queue ``checkpoint`` for reading (tagged ``index``)."""
        self._todo.put((index, checkpoint))

    def take(self) -> Prefetched:
        """The next submitted checkpoint, once read (or its read failed: every failure of
        the read is handed over here, so the taker never waits on a dead thread)."""
        return self._done.get()

    def release(self, item: Prefetched) -> None:
        """``item``'s buffers may be read into again (its tensors become invalid)."""
        item.weights = None
        self._free.put(item.buffers)

    def close(self) -> None:
        """Stop the thread and wait for it to end: a read in progress is given up at its
        next chunk (our series; a foreign layout's read is waited for), a buffer
        allocation in progress (page-locking: under a second per GB) is finished. No
        thread may be left inside torch or a reader, with the GIL released, when the
        process exits: a daemon thread that then takes the GIL back aborts the process
        ("terminate called without an active exception"). Idempotent."""
        self._stop.set()
        self._todo.put(None)
        self._free.put(None)
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set() and (job := self._todo.get()) is not None:
            buffers = self._free.get()
            if buffers is None:
                return
            index, checkpoint = job
            try:
                if self._unreserved:
                    self._reserve(buffers, checkpoint)
                self._done.put(Prefetched(index, checkpoint, self._read(checkpoint, buffers, self._stop), None, buffers))
            except BaseException as err:  # noqa: BLE001  (re-raised by the taker, at this checkpoint: any failure,
                # DCP's CheckpointException (a BaseException) included, or the taker would wait forever)
                self._done.put(Prefetched(index, checkpoint, None, err, buffers))
            self._reserve_the_others(checkpoint)

    def _reserve_the_others(self, checkpoint: Checkpoint) -> None:
        """After the first read: allocate the other sets at its sizes (once)."""
        others, self._unreserved = self._unreserved[1:], []
        for buffers in others:
            if self._stop.is_set():
                return
            try:
                self._reserve(buffers, checkpoint)
            except Exception:  # noqa: BLE001  (a checkpoint with bad sizes fails at its own read)
                return
