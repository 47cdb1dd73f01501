"""How the ranks' checkpoint writers talk: reports through the torchrun store, never a
collective.

Every rank writes its own shard files of a checkpoint in a background thread
(:mod:`~mlperf_grpo.checkpoint.writer`); rank 0's writer then needs every other rank's
report (its files' hashes and sizes, its tensors' fingerprint checksums) before it
publishes ``step_N/``. Collectives belong to the main thread (NCCL and gloo order them
per process group), so the reports go through the job's key-value store instead: the
``TCPStore`` torchrun starts (the default store of the process group, here under a
``PrefixStore``), which any thread may use.

A rank that dies (SIGKILL, the OOM killer) sends no report, so rank 0 cannot wait for it
forever: every other rank's :class:`Heartbeat` adds 1 to its beat counter every
:data:`BEAT_S`, and rank 0 gives up on a report (failing that checkpoint) when the
rank's counter has not moved for :data:`STALL_S`. A rank that is alive but slow (a larger
share to write, a slower disk) keeps beating and is waited for.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

BEAT_S = 1.0
"""Seconds between two heartbeats of a rank."""

STALL_S = 10.0
"""Seconds without a heartbeat after which rank 0 takes a rank for dead (well inside
torchrun's 30 s between its SIGTERM and SIGKILL of the survivors, so rank 0 still records
the failed write in ``training_end.json``)."""

POLL_S = 0.02
"""Seconds between two looks at the store while rank 0 waits for a report."""

STORE_PREFIX = "mlperf_grpo/checkpoint"


class RankReportError(RuntimeError):
    """A rank reported a failed write, or stopped beating before it reported."""


@dataclass(frozen=True)
class RankGroup:
    """The ranks writing one checkpoint series: this process is ``rank`` of ``world_size``;
    ``store`` is shared by all of them (``None``: one rank, nothing to exchange)."""

    rank: int = 0
    world_size: int = 1
    store: dist.Store | None = None

    @classmethod
    def of_process_group(cls) -> "RankGroup":
        """This rank of the default process group, over its store (torchrun's TCPStore;
        one checkpoint series per job, keys under :data:`STORE_PREFIX`)."""
        store = dist.PrefixStore(f"{STORE_PREFIX}/", dist.distributed_c10d._get_default_store())
        return cls(dist.get_rank(), dist.get_world_size(), store)

    def send_report(self, step: int, report: dict) -> None:
        """Publish this rank's report of ``step`` (any JSON object) for rank 0."""
        self.store.set(_report_key(step, self.rank), json.dumps(report))

    def await_report(self, step: int, rank: int, stall_s: float | None = None) -> dict:
        """Rank ``rank``'s report of ``step``, waiting as long as that rank beats.

        Raises:
            RankReportError: the rank stopped beating for ``stall_s`` (default
                :data:`STALL_S`) before it reported, or its report says its write failed
                (``{"error": message}``).
        """
        stall_s = STALL_S if stall_s is None else stall_s
        key, beat_key, end_key = _report_key(step, rank), _beat_key(rank), _end_key(rank)
        beats, changed = None, time.monotonic()
        wake = threading.Event()
        while not self.store.check([key]):
            # it ended training without saving this step (its reports precede its end)
            if self.store.check([end_key]) and not self.store.check([key]):
                raise RankReportError(f"rank {rank} ended training without staging step_{step} "
                                      f"(its last checkpoint: {self.store.get(end_key).decode()})")
            now, seen = time.monotonic(), self.store.add(beat_key, 0)
            if seen != beats:
                beats, changed = seen, now
            elif now - changed > stall_s:
                raise RankReportError(f"rank {rank} sent no report of step_{step} and stopped responding "
                                      f"(no heartbeat for {stall_s:g} s)")
            wake.wait(POLL_S)
        report = json.loads(self.store.get(key))
        self.store.delete_key(key)
        if "error" in report:
            raise RankReportError(f"rank {rank} could not write its part of step_{step}: {report['error']}")
        return report


    def send_end(self, last: str) -> None:
        """Tell rank 0 that this rank has sent the reports of every checkpoint it saved
        (``last``: the last one's name, for the message): one it still waits for will not come."""
        self.store.set(_end_key(self.rank), last)


class Heartbeat:
    """A daemon thread adding 1 to this rank's beat counter every :data:`BEAT_S` until
    :meth:`stop` (see the module docstring). A store that goes away ends it quietly:
    rank 0 then sees the rank as stalled, which is what it is to the checkpoint."""

    def __init__(self, group: RankGroup) -> None:
        self._group = group
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkpoint-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        key = _beat_key(self._group.rank)
        try:
            while True:
                self._group.store.add(key, 1)
                if self._stopped.wait(BEAT_S):
                    return
        except dist.DistError:
            return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


def _report_key(step: int, rank: int) -> str:
    return f"step_{step}/report/{rank}"


def _end_key(rank: int) -> str:
    return f"end/{rank}"


def _beat_key(rank: int) -> str:
    return f"beat/{rank}"
