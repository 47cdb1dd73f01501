"""Evaluation workers: a work queue on a ``torch.distributed`` store, and the launch of
N worker ranks with torchrun's own launcher (``torch.distributed.launcher``).

The queue is a handful of keys in a store every rank can reach (a ``TCPStore`` served by
the launcher's agent, or an in-process ``HashStore`` for one worker)::

    next         counter: store.add("next", 1) - 1 is the index a worker claims (atomic)
    result/<i>   JSON of the evaluation of pending checkpoint i (or its error)
    stop         set once the run is decided (a pass committed, or an error): claim no more

Each worker claims the next unevaluated checkpoint; rank 0 also commits the results to
the log strictly in step order (see ``offline.py``). Nothing here knows about the log.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from mlperf_grpo.evaluate.prestart import RANK_START_METHOD, prestart_rank_server

STORE_TIMEOUT = timedelta(hours=24)
"""How long a rank waits on the store (a checkpoint's evaluation may take hours at scale)."""


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
        """Index's result; waits for it when ``block``, else ``None`` if not there yet."""
        key = f"result/{index}"
        if not block and not self.store.check([key]):
            return None
        self.store.wait([key], STORE_TIMEOUT)
        return json.loads(self.store.get(key))

    def stop(self) -> None:
        """No worker claims anything more."""
        self.store.set("stop", "1")

    def stopped(self) -> bool:
        return self.store.check(["stop"])


def local_queue(count: int) -> WorkQueue:
    """A queue for workers in this process (``torch.distributed.HashStore``)."""
    return WorkQueue(dist.HashStore(), count)


def rank_queue(count: int, serve: bool = True) -> WorkQueue:
    """The queue of a rank started by torchrun or :func:`launch`: a connection to the
    launcher's store (``MASTER_ADDR``/``MASTER_PORT``; rank 0 serves it itself when the
    agent does not, unless ``serve`` is False: a second connection of the same rank),
    under the prefix ``mlperf_eval/``. Use one connection per thread."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
        is_master=serve and rank == 0 and not agent_store, timeout=STORE_TIMEOUT, wait_for_workers=False,
    )
    return WorkQueue(dist.PrefixStore("mlperf_eval/", store), count)


def die_with_parent() -> None:
    """Linux: this process is killed when the process that started it dies (a SIGKILLed
    evaluator leaves no rank writing to the run). No-op where ``prctl`` is missing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


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

    from mlperf_grpo.train.stop import Terminated

    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)  # our one line, not its warnings
    try:
        return elastic_launch(config, entrypoint)(*args)
    except SignalException as err:  # the launcher's own SIGTERM/SIGINT handler stopped the ranks
        if err.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise Terminated("stopped by SIGTERM") from None
