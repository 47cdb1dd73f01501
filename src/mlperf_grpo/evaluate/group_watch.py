"""A tensor-parallel evaluation worker's ranks watch each other (issue 28, item 3).

The T ranks of a worker meet in collectives (the read's agreement, the refit's
fingerprint, every forward of the generation). A rank that dies (SIGKILL, the OOM
killer, its node lost) leaves the others blocked in the next one until the process
group's timeout (30 minutes for gloo, 10 for NCCL) and then, on rank 0, waiting for the
dead rank's ``ended/<r>`` for ``STORE_TIMEOUT``. So every rank of a group runs a
:class:`GroupWatch` thread on its own store connection: it adds to its own counter
``alive/<rank>`` every :data:`BEAT_S` and looks at its peers'. A peer is gone when its
process no longer exists (a peer on this host: its pid, published once, is checked
every :data:`BEAT_S`) or its counter stood still for :data:`PEER_SILENCE_S` (a peer on
another host). The watcher then fails the work queue with one line (no rank claims
more; rank 0's committer stops), marks the lost peer and this rank ended (rank 0 waits
for no one dead), writes the line to stderr and ends this process at once with exit
code 1 (``os._exit``: its main thread may be blocked in a collective that never
returns). What was logged is whole (each commit is one write); the lock is an ``flock``
the kernel drops; ``evaluate`` run again resumes after the last commit.

Store keys (under the work queue's prefix)::

    alive/<r>      counter rank r adds to every BEAT_S while it evaluates
    pid/<r>        JSON {"host": ..., "pid": ...} of rank r
    done/<r>       set when rank r's evaluation ended (its end or its own error): no
                   longer watched
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time

import torch.distributed as dist

from mlperf_grpo.evaluate.worker_errors import WORKER_ERRORS

BEAT_S = 0.5
"""Seconds between two heartbeats (and two looks at the peers) of a watcher."""

PEER_SILENCE_S = 30.0
"""Seconds a peer's counter may stand still before it is taken for gone (a peer on
another host; one on this host is found gone within :data:`BEAT_S` of its death). Its
watcher is a thread of its own, beating whatever its main thread does (a long read, a
long generation), so only a dead or frozen process misses it."""

TERMINATED_GRACE_S = 2.0
"""Seconds a SIGTERM is held while a peer on this host may be ending: torchrun's agent
stops the survivors of a failed rank within its monitor interval (0.1 s), before the
dead rank's process is gone from ``/proc``; its death, not the SIGTERM, is the cause."""

EXIT_CODE = 1
"""The exit code of a rank whose peer is gone (an error, as a failed rank's)."""


class GroupWatch:
    """This rank's heartbeat and its watch over the other ranks of its tensor-parallel
    group, from :meth:`start` to :meth:`close`.

    Args:
        store: a store connection of this rank's own (the watcher thread uses it), under
            the work queue's prefix.
        main_store: the main thread's connection to the same store (:meth:`watching`).
        rank: this rank's global rank.
        peers: the global ranks of the other members of its group.
        tag: the prefix of this rank's error line (``"rank R: "`` on ranks other than 0).
    """

    def __init__(self, store: dist.Store, main_store: dist.Store, rank: int, peers: list[int], tag: str = "") -> None:
        self.store, self.main_store, self.rank, self.peers, self.tag = store, main_store, rank, peers, tag
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="group-watch", daemon=True)
        self._report_lock, self._reported = threading.Lock(), False

    def start(self) -> "GroupWatch":
        """Publish this rank's host and pid, then beat and watch from a thread."""
        self.store.set(f"pid/{self.rank}", json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        self.store.add(f"alive/{self.rank}", 1)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop beating and watching: this rank's evaluation ended, by its end or by an
        error of its own (``done/<rank>``: its peers no longer watch it)."""
        with contextlib.suppress(dist.DistError):
            self.store.set(f"done/{self.rank}", "1")
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join()

    @contextlib.contextmanager
    def watching(self):
        """A block (this rank's evaluation) whose stop may come from a peer's death: a
        SIGTERM (torchrun's agent stops the survivors of a failed rank) or an unexpected
        error (not ``WORKER_ERRORS``'s: e.g. a collective failing as its peer's
        connection closed) is raised as :class:`PeerLostError` when a peer is gone by
        then; an unexpected error is first held up to :data:`PEER_SILENCE_S` + 2
        :data:`BEAT_S` while the watcher decides about a peer on another host (if one is
        gone it ends the process with its line)."""
        from mlperf_grpo.graceful_stop import Terminated

        try:
            yield
        except tuple(WORKER_ERRORS.values()):
            raise
        except BaseException as err:
            if isinstance(err, KeyboardInterrupt) and not isinstance(err, Terminated):
                raise
            hold_s = TERMINATED_GRACE_S if isinstance(err, Terminated) else PEER_SILENCE_S + 2 * BEAT_S
            try:
                self._wait_for_lost_peer(hold_s)
            except Terminated:  # the agent's SIGTERM while the error is held: a peer of this host ended
                self._wait_for_lost_peer(TERMINATED_GRACE_S)
            raise

    def _wait_for_lost_peer(self, hold_s: float) -> None:
        """Raise :class:`PeerLostError` as soon as a peer is found gone within ``hold_s``
        (or the watcher has ended the process); return when none is."""
        deadline = time.monotonic() + hold_s
        while True:
            self._raise_if_lost()
            if not self._thread.is_alive() or time.monotonic() > deadline:
                return
            time.sleep(BEAT_S / 5)

    def _raise_if_lost(self) -> None:
        """Raise :class:`PeerLostError` for the first peer gone now (unless the watcher
        has reported one: it ends the process); SIGTERM is ignored from then on (main
        thread only)."""
        tracker = PeerTracker(self.main_store)
        for peer in self.peers:
            with contextlib.suppress(dist.DistError):
                why = None if self.main_store.check([f"done/{peer}"]) else tracker.gone(peer)
                if why is not None and self._take_report():
                    # the SIGTERM torchrun's agent sends the survivors must not replace this error as it unwinds
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)
                    raise PeerLostError(lost_peer_line(peer, why)) from None

    def _take_report(self) -> bool:
        """Whether this caller is the one that reports a lost peer (once per process)."""
        with self._report_lock:
            taken, self._reported = self._reported, True
        return not taken

    def _run(self) -> None:
        tracker = PeerTracker(self.store, beats_expected=True)
        with contextlib.suppress(dist.DistError):  # the store is gone: rank 0's watch over it (launch.py) reports it
            while not self._closed.wait(BEAT_S):
                self.store.add(f"alive/{self.rank}", 1)
                for peer in self.peers:
                    if self.store.check([f"done/{peer}"]):
                        continue  # it ended its evaluation
                    why = tracker.gone(peer)
                    if why is not None:
                        self._stop_job(peer, why)

    def _stop_job(self, peer: int, why: str) -> None:
        """Fail the queue, mark ``peer`` and this rank ended, say the one line, exit
        (unless the main thread reports it: :meth:`watching`)."""
        if not self._take_report():
            self._closed.set()
            return
        line = lost_peer_line(peer, why)
        with contextlib.suppress(dist.DistError):
            if not self.store.check(["failed"]):
                self.store.set("failed", f"rank {self.rank}: {line}")
            self.store.set("stop", "1")
            for r in (peer, self.rank):
                self.store.set(f"ended/{r}", "1")
        from tqdm import tqdm

        tqdm.write(f"mlperf-grpo: {self.tag}error: {line}", file=sys.stderr)  # on a line of its own, past a progress bar
        sys.stderr.flush()
        os._exit(EXIT_CODE)


class PeerLostError(RuntimeError):
    """A rank of this rank's tensor-parallel group is gone; the evaluation stops
    (resumable)."""


class PeerTracker:
    """Whether ranks are gone, from what their :class:`GroupWatch` publishes in ``store``:
    a rank on this host whose process has ended, or one whose ``alive/<r>`` counter has
    not moved for :data:`PEER_SILENCE_S` across calls of :meth:`gone`. ``beats_expected``:
    the ranks run a watcher (a group's peers), so a counter not started yet counts as
    standing still at 0 (a peer that dies before its first beat); else (rank 0 waiting
    for every rank, some without a watcher) a rank that never beat is judged by its pid
    alone, once published."""

    def __init__(self, store: dist.Store, beats_expected: bool = False) -> None:
        self.store, self.beats_expected = store, beats_expected
        self._seen: dict[int, tuple[int, float]] = {}

    def gone(self, rank: int) -> str | None:
        """Why ``rank`` is taken for gone (one clause), or None."""
        if self.beats_expected or self.store.check([f"alive/{rank}"]):
            now = self.store.add(f"alive/{rank}", 0)
            beats, since = self._seen.get(rank, (None, 0.0))
            if now != beats:
                self._seen[rank] = (now, time.monotonic())
            elif time.monotonic() - since > PEER_SILENCE_S:
                return f"its heartbeat in the store stood still for {PEER_SILENCE_S:g} s"
        if self.store.check([f"pid/{rank}"]):
            where = json.loads(self.store.get(f"pid/{rank}"))
            if where["host"] == socket.gethostname() and not process_alive(int(where["pid"])):
                return f"its process {where['pid']} on this host has ended"
        return None


def lost_peer_line(peer: int, why: str) -> str:
    """The one line of a rank whose tensor-parallel peer ``peer`` is gone."""
    return (f"rank {peer} of this evaluation worker's tensor-parallel group is gone ({why}: killed, or its node lost); "
            "this rank stops. Nothing partial was logged: run the same evaluate command again to resume the run")


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host exists and has not ended (a zombie, ended but
    not yet reaped by its parent, counts as ended: ``/proc/PID/stat`` state ``Z``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return True  # no /proc: existence is all that is known
    return stat[stat.rindex(")") + 2:].split()[0] not in ("Z", "X")
