"""Evaluation workers: a work queue on a ``torch.distributed`` store, and the ranks that
serve it: N local ranks launched with torchrun's own launcher
(``torch.distributed.launcher``), or the ranks ``torchrun`` itself started (any number of
nodes), which this process joins (:func:`joined_ranks`).

The queue is a handful of keys in a store every rank can reach (a ``TCPStore`` served by
the launcher's agent, or an in-process ``HashStore`` for one worker)::

    next         counter: store.add("next", 1) - 1 is the index a worker claims (atomic)
    result/<i>   JSON of the evaluation of pending checkpoint i (or its error)
    stop         set once the run is decided (a pass committed, or an error): claim no more
    failed       set by a rank other than 0 that failed: its one line (the committer raises it)

Under ``torchrun`` rank 0 coordinates through four more keys::

    plan         JSON rank 0 publishes once it has planned the evaluation; the other
                 ranks wait for it (or for the verdict: nothing to evaluate, or a failure)
    ended/<r>    set by rank r != 0 when it has stopped: rank 0 waits for every one
                 before the teardown
    verdict      JSON rank 0 sets as it ends: its exit code and error line; the other
                 ranks wait for it and exit accordingly
    heartbeat/0  counter rank 0 adds to every ``HEARTBEAT_S`` from the moment it joins;
                 a rank that sees it stand still for ``RANK0_SILENCE_S`` (rank 0 was
                 killed, or its node lost, while the store lives on elsewhere) fails the
                 queue and exits with one line (:class:`Rank0LostError`) instead of
                 waiting for rank 0 until ``STORE_TIMEOUT``

Each worker claims the next unevaluated checkpoint; rank 0 also commits the results to
the log strictly in step order (see ``commit.py``). Nothing here knows about the log.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from mlperf_grpo.errors import EXIT_FAILURE, EXIT_OK
from mlperf_grpo.evaluate.group_watch import PeerTracker
from mlperf_grpo.evaluate.prestart import RANK_START_METHOD, die_with_parent, prestart_rank_server
from mlperf_grpo.evaluate.worker_errors import RankFailedError

STORE_TIMEOUT = timedelta(hours=24)
"""How long a rank waits on the store (a checkpoint's evaluation may take hours at scale)."""

POLL_S = 0.05
"""How often a rank waiting for a key looks for it, in s (a ``store.wait`` would hold off
signal handlers until it returns, and logs a warning each time its timeout ends)."""


HEARTBEAT_S = 2.0
"""Under torchrun: how often rank 0 adds to its heartbeat counter in the store, in s."""

RANK0_SILENCE_S = 30.0
"""Under torchrun: how long the other ranks accept rank 0's heartbeat standing still
before they stop (:class:`Rank0LostError`), in s. Rank 0's heartbeat is a thread of its
own; only a rank 0 that is gone (or frozen that long) misses it."""


class Rank0LostError(RuntimeError):
    """Under torchrun, rank 0's heartbeat stood still for ``RANK0_SILENCE_S`` (it was
    killed, or its node lost): this rank stops; the run is resumable."""


class WorkQueue:
    """The checkpoints still to evaluate (indices ``0 .. count-1``) and their results.

    Args:
        store: a ``torch.distributed.Store`` shared by every worker.
        count: how many checkpoints are pending.
    """

    def __init__(self, store: dist.Store, count: int) -> None:
        self.store = store
        self.count = count

    def claim(self) -> int | None:
        """The next unclaimed index, or ``None`` when none is left or the run is decided."""
        if self.stopped():
            return None
        index = self.store.add("next", 1) - 1
        return index if index < self.count else None

    def publish(self, index: int, result: dict[str, Any]) -> None:
        """Make index's result (JSON-serializable) visible to the committer."""
        self.store.set(f"result/{index}", json.dumps(result))

    def result(self, index: int, block: bool = True) -> dict[str, Any] | None:
        """Index's result; waits for it when ``block``, else ``None`` if not there yet.

        Raises:
            RankFailedError: a rank failed (:meth:`fail`) before the result came; the
                queue is stopped.
        """
        key = f"result/{index}"
        while not self.store.check([key]):
            if not block:
                return None
            if self.store.check(["failed"]):
                self.stop()
                raise RankFailedError(self.store.get("failed").decode())
            time.sleep(POLL_S)
        return json.loads(self.store.get(key))

    def fail(self, message: str) -> None:
        """This rank failed (``message``: one line): the committer raises it, none claims more."""
        self.store.set("failed", message)
        self.stop()

    def stop(self) -> None:
        """No worker claims anything more."""
        self.store.set("stop", "1")

    def stopped(self) -> bool:
        return self.store.check(["stop"])


def local_queue(count: int) -> WorkQueue:
    """A queue for workers in this process (``torch.distributed.HashStore``)."""
    return WorkQueue(dist.HashStore(), count)


def rank_queue(count: int, serve: bool = True) -> WorkQueue:
    """The queue of a rank started by torchrun or :func:`launch` (:func:`rank_store`)."""
    return WorkQueue(rank_store(serve), count)


def rank_store(serve: bool = True) -> dist.Store:
    """A connection to the store of the ranks torchrun or :func:`launch` started
    (``MASTER_ADDR``/``MASTER_PORT``; rank 0 serves it itself when the agent does not,
    shared by its connections, unless ``serve`` is False), under the prefix
    ``mlperf_eval/``. Use one connection per thread."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
        is_master=serve and rank == 0 and not agent_store, timeout=STORE_TIMEOUT, wait_for_workers=False,
        multi_tenant=True,
    )
    return dist.PrefixStore("mlperf_eval/", store)


class TorchrunRanks:
    """The ranks ``torchrun`` started (``RANK`` of ``WORLD_SIZE``, over any number of
    nodes), joined through their store (:func:`rank_store`): every rank is an evaluation
    worker, rank 0 the coordinator. Get it from :func:`joined_ranks`.

    Rank 0 heartbeats (``heartbeat/0``) from a thread of its own; every other rank
    watches that heartbeat from a thread of its own: once it has stood still for
    ``RANK0_SILENCE_S`` with no verdict set, the watcher fails the queue (no rank claims
    a checkpoint more; a rank 0 that is only slow raises that line) and the rank's next
    wait on rank 0 (its plan, its verdict) raises :class:`Rank0LostError`. A rank
    evaluating a checkpoint then finishes it first, so a rank stops within about
    ``RANK0_SILENCE_S`` plus one checkpoint's evaluation of rank 0's death.
    """

    def __init__(self) -> None:
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.node = int(os.environ.get("GROUP_RANK", "0"))
        self.store = rank_store()
        self.rank0_lost: str | None = None
        self._closed = threading.Event()
        target = self._heartbeat if self.rank == 0 else self._watch_rank0
        self._thread = threading.Thread(target=target, args=(rank_store(serve=False),), name=target.__name__.strip("_"),
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the heartbeat (rank 0) or the watcher (the others)."""
        self._closed.set()
        self._thread.join()

    def _heartbeat(self, store: dist.Store) -> None:
        """Rank 0's heartbeat thread (its own store connection): ends with the process,
        or when the store is gone."""
        with contextlib.suppress(dist.DistError):
            while not self._closed.is_set():
                store.add("heartbeat/0", 1)
                self._closed.wait(HEARTBEAT_S)

    def _watch_rank0(self, store: dist.Store) -> None:
        """The watcher thread of a rank other than 0 (its own store connection): sets
        ``rank0_lost`` and fails the queue when rank 0's heartbeat stood still for
        ``RANK0_SILENCE_S`` (or the store, rank 0's own, is gone) before a verdict
        (or :meth:`close`)."""
        beats, since = None, time.monotonic()
        try:
            while not store.check(["verdict"]):
                if (now := store.add("heartbeat/0", 0)) != beats:
                    beats, since = now, time.monotonic()
                elif time.monotonic() - since > RANK0_SILENCE_S:
                    break
                if self._closed.wait(min(HEARTBEAT_S, RANK0_SILENCE_S / 4)):
                    return
            else:
                return
            why = f"its heartbeat in the store stood still for {RANK0_SILENCE_S:g} s"
        except dist.DistError as err:
            why = f"the store is unreachable ({_reason(err)})"
        self.rank0_lost = _rank0_lost(why)
        with contextlib.suppress(dist.DistError):
            WorkQueue(store, 0).fail(f"rank {self.rank}: {self.rank0_lost}")

    def publish_plan(self, plan: dict[str, Any]) -> None:
        """Rank 0: what the workers evaluate (JSON-serializable)."""
        self.store.set("plan", json.dumps(plan))

    def wait_plan(self) -> dict[str, Any] | None:
        """Ranks other than 0: rank 0's plan, or ``None`` when rank 0 concluded without
        one (nothing to evaluate, or it failed first: see :meth:`verdict`).

        Raises:
            Rank0LostError: rank 0's heartbeat stood still (see the class).
            TimeoutError: neither after ``STORE_TIMEOUT``.
        """
        self._wait_for_rank0(["plan"], ["verdict"])
        return json.loads(self.store.get("plan")) if self.store.check(["plan"]) else None

    def end(self, failure: str | None = None) -> None:
        """Ranks other than 0: this rank has stopped (``failure``: its one line, raised by
        rank 0's committer)."""
        if failure is not None:
            WorkQueue(self.store, 0).fail(failure)
        self.store.set(f"ended/{self.rank}", "1")

    def wait_ended(self) -> None:
        """Rank 0: wait until every other rank has stopped (none reads a checkpoint or
        writes a result any more): it set ``ended/<r>``, or it is gone (a rank of a
        tensor-parallel worker whose process ended or whose heartbeat stood still:
        ``group_watch.PeerTracker``). Raises TimeoutError after ``STORE_TIMEOUT``."""
        tracker, pending = PeerTracker(self.store), set(range(1, self.world_size))
        deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
        while pending:
            pending = {r for r in pending if not self.store.check([f"ended/{r}"]) and tracker.gone(r) is None}
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(pending)} of the evaluation did not stop within {STORE_TIMEOUT}")
            time.sleep(POLL_S)

    def conclude(self, exit_code: int, error: str | None = None) -> None:
        """Rank 0: how it ends (its exit code, its error line); the queue is stopped."""
        WorkQueue(self.store, 0).stop()
        self.store.set("verdict", json.dumps({"exit_code": exit_code, "error": error, "node": self.node}))

    def verdict(self) -> tuple[int, str | None]:
        """Ranks other than 0: the exit code for this rank and rank 0's error line, once
        rank 0 has concluded. On rank 0's node, 0 (its agent reports rank 0's failure and
        stops the others); on another node, rank 0's code (1 for an error), so that
        node's agent fails too instead of waiting for the others at its exit barrier
        (``torchrun`` waits there up to 300 s). Raises Rank0LostError when rank 0's heartbeat
        stood still (see the class), TimeoutError after ``STORE_TIMEOUT``."""
        self._wait_for_rank0(["verdict"])
        verdict = json.loads(self.store.get("verdict"))
        if verdict["node"] == self.node:
            return EXIT_OK, None
        return (EXIT_FAILURE if verdict["error"] and not verdict["exit_code"] else verdict["exit_code"]), verdict["error"]

    def _wait_for_rank0(self, *any_of: list[str]) -> None:
        """:func:`_wait_for` rank 0's keys; raises Rank0LostError once the watcher has
        found rank 0 gone, or the store (rank 0's own, without an agent's) is gone."""
        def rank0_lost() -> None:
            if self.rank0_lost is not None:
                raise Rank0LostError(self.rank0_lost)

        try:
            _wait_for(self.store, *any_of, timeout=STORE_TIMEOUT, check=rank0_lost)
        except dist.DistError as err:
            raise Rank0LostError(_rank0_lost(f"the store is unreachable ({_reason(err)})")) from None


def _rank0_lost(why: str) -> str:
    return (f"rank 0 is gone ({why}: killed, or its node lost); this rank stops. Nothing partial was logged: run "
            "the same evaluate command again to resume the run")


def _reason(err: BaseException) -> str:
    """The first line of a store error (torch appends a C++ backtrace)."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _wait_for(store: dist.Store, *any_of: list[str], timeout: timedelta, check: Callable[[], None] = lambda: None) -> None:
    """Wait until every key of one of the lists ``any_of`` is set (polled every
    ``POLL_S``; ``check()`` runs before each poll and may raise). Raises TimeoutError."""
    deadline = time.monotonic() + timeout.total_seconds()
    while not any(store.check(keys) for keys in any_of):
        check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"the evaluation's ranks did not set {any_of} within {timeout}")
        time.sleep(POLL_S)


@contextlib.contextmanager
def joined_ranks() -> Iterator[TorchrunRanks]:
    """Join the ranks ``torchrun`` started for the duration (``evaluate`` under torchrun
    with ``WORLD_SIZE`` > 1; rank 0 passes them to the evaluation, ``evaluate_run(...,
    ranks=)``). Rank 0 leaving by an exception concludes with it (exit code 1, its
    message), so no rank waits for it."""
    ranks = TorchrunRanks()
    try:
        yield ranks
    except BaseException as err:
        if ranks.rank == 0:
            ranks.conclude(EXIT_FAILURE, str(err) or type(err).__name__)
        raise
    finally:
        ranks.close()


def die_with_launcher() -> None:
    """This rank is SIGKILLed as soon as the process that launched it dies, so a
    SIGKILLed evaluator (or torchrun agent) leaves no rank running, printing or writing:
    the kernel kills it when its parent dies (:func:`~mlperf_grpo.evaluate.prestart.die_with_parent`;
    under ``evaluate --workers N`` the parent is the fork server, which dies with the
    evaluator), and a daemon thread kills it when the process that asked for it
    (``multiprocessing.parent_process()``: the evaluator, not the fork server) is gone,
    which it sees as the end of the pipe that process holds open for it (its sentinel).
    The ranks then stop before they notice the evaluator's store is gone (its errors
    and tracebacks are never printed). A rank the evaluator launched (:func:`launch`)
    also stops at once on Ctrl-C (SIGINT to the terminal's process group), as on the
    SIGTERM the launcher sends: the evaluator handles it and prints the one line (an
    interrupted rank would otherwise wait for its committer thread until the launcher
    SIGKILLs it, 30 s later). Call it in the rank's main thread."""
    die_with_parent()
    launcher = multiprocessing.parent_process()
    if launcher is not None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        threading.Thread(target=_kill_self_when_ready, args=(launcher.sentinel,), name="die-with-launcher",
                         daemon=True).start()


def _kill_self_when_ready(fd: int) -> None:
    """SIGKILL this process once ``fd`` (a pipe's read end) is readable: EOF, its writer gone."""
    select.select([fd], [], [])
    os.kill(os.getpid(), signal.SIGKILL)


def launch(entrypoint: Callable[..., Any], args: tuple, nprocs: int) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` in ``nprocs`` local ranks with torchrun's launcher
    (``torch.distributed.launcher.api.elastic_launch``, c10d rendezvous on a free local
    port, no restarts), forked from a fork server with ``entrypoint``'s module imported
    (:func:`~mlperf_grpo.evaluate.prestart.prestart_rank_server`; started now unless it
    runs already); returns rank -> return value.

    Raises:
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a rank failed
            (the launcher stops the others).
        Terminated, KeyboardInterrupt: SIGTERM or SIGINT reached the launcher (it stopped
            the ranks), so the CLI reports it as for a serial evaluation (exit 143 or 130).
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    prestart_rank_server(entrypoint.__module__)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=f"mlperf-eval-{os.getpid()}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}", max_restarts=0, monitor_interval=0.1,
        start_method=RANK_START_METHOD,
    )
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from mlperf_grpo.graceful_stop import Terminated

    _quiet_launcher_logs()
    try:
        return elastic_launch(config, entrypoint)(*args)
    except SignalException as err:  # the launcher's own SIGTERM/SIGINT handler stopped the ranks
        if err.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise Terminated("stopped by SIGTERM") from None


def _quiet_launcher_logs() -> None:
    """Our one line, not the launcher's warnings ("Received 15 death signal, shutting
    down workers", "Closing process ... via signal"): its modules' loggers get their own
    level when imported (``LOGLEVEL``, default WARNING), so each is set to ERROR."""
    prefix = "torch.distributed.elastic"
    for name in [prefix, *(n for n in logging.root.manager.loggerDict if n.startswith(prefix + "."))]:
        logging.getLogger(name).setLevel(logging.ERROR)
