"""An evaluation worker of one rank, or of a tensor-parallel group of T ranks.

With the ``hf`` engine and ``inference.tensor_parallel_size`` T > 1, an evaluation worker
spans T torchrun ranks (world = workers x T; worker ``w`` is ranks ``w T .. w T + T - 1``,
the groups of :func:`~mlperf_grpo.inference.tensor_parallel.tensor_parallel_mesh`). Its
leader (group rank 0) claims checkpoints from the work queue and tells its group which
through store keys (:class:`TensorParallelGroup`); every rank reads its share of the
checkpoint (:func:`~mlperf_grpo.checkpoint.share_read.read_share`), the group agrees on
the read (a failed hash fails every rank), refits, verifies (the v2 fingerprint combined
over the group, the canary) and generates (collectives); the leader alone writes results
and publishes them. The group's ranks watch each other (``group_watch.py``): a dead one
ends the job with one line. :class:`SoloWorker` is the one-rank worker of T = 1.

Store keys (under the work queue's prefix)::

    group/<w>/claim/<n>   JSON index (or null: nothing more) of worker w's n-th claim
    group/<w>/go/<n>      "1"/"0": the leader's decision to evaluate its n-th item (0: the run is decided)
"""

from __future__ import annotations

import functools
import json
import os
import threading

import torch

from mlperf_grpo.checkpoint import Checkpoint
from mlperf_grpo.checkpoint.reader import ReadBuffers
from mlperf_grpo.checkpoint.share_read import agree_on_read
from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.evaluate.group_watch import GroupWatch
from mlperf_grpo.evaluate.launch import STORE_TIMEOUT, WorkQueue, _wait_for, rank_store
from mlperf_grpo.evaluate.series import RunSeries, SeriesSource


def group_size(config: RunConfig) -> int:
    """T: the ranks one evaluation worker spans (``inference.tensor_parallel_size`` for
    the ``hf`` engine; 1 for vLLM, which shards the model in its own processes)."""
    return config.inference.tensor_parallel_size if config.inference.engine == "hf" else 1


def check_worker_groups(config: RunConfig, world_size: int | None, command: str = "evaluate RUN_DIR") -> None:
    """Refuse a tensor-parallel ``hf`` evaluation that cannot form its groups, before
    anything is written: T > 1 needs torchrun (``world_size``: its WORLD_SIZE; None
    without torchrun) with a multiple of T ranks, and T must divide the model's heads
    (:func:`~mlperf_grpo.plan.memory.check_tensor_parallel`). ``command``: the
    evaluation the refusal tells to run under torchrun (``evaluate --checkpoints DIR ...``
    for a series outside a run directory).

    Raises:
        EvaluationError: not under torchrun.
        MemoryPlanError: T does not divide the world size or the heads (both numbers, the fix).
    """
    from mlperf_grpo.evaluate.series import EvaluationError
    from mlperf_grpo.model.load import check_model_path
    from mlperf_grpo.plan import memory as memory_plan
    from mlperf_grpo.plan.model_config import load_model_config

    t = group_size(config)
    if t == 1:
        return
    if not world_size:
        raise EvaluationError(
            f"inference.tensor_parallel_size {t} splits each evaluation worker's hf engine over {t} ranks: run {command} "
            f"under torchrun with a multiple of {t} ranks (e.g. torchrun --nproc-per-node {t} ...), or set "
            "inference.tensor_parallel_size 1")
    memory_plan.check_tensor_parallel(load_model_config(check_model_path(config.model.path)), world_size, t,
                                      config.inference.engine)


class SoloWorker:
    """The worker of one rank: it claims from the queue itself and reads whole
    checkpoints (``source.read``)."""

    leader = True

    def __init__(self, source: SeriesSource) -> None:
        self.read = source.read
        self.reserve = isinstance(source, RunSeries)  # our series reads into the buffers; allocate them ahead

    def claim(self, queue: WorkQueue) -> int | None:
        return queue.claim()

    def go(self, queue: WorkQueue) -> bool:
        return not queue.stopped()

    def agree(self, error: BaseException | None) -> BaseException | None:
        return error


class TensorParallelGroup:
    """This rank's part of a worker spanning a tensor-parallel group (the engine's
    ``tp_group``). The leader's claims and decisions go to the group through the
    queue's store; :meth:`read` reads this rank's share; :meth:`agree` combines the
    group's reads (a collective).

    Args:
        engine: this rank's tensor-parallel engine (``tp_size``, ``tp_rank``,
            ``tp_group``, ``weight_slices()``).
        store: the work queue's store (every rank's connection).
        worker: the worker's index (``RANK // tp_size``).
        source: the series (its ``read_share`` and ``reserve_share``: our series'
            ``share_read``, a foreign one's ``foreign_share``).
    """

    def __init__(self, engine, store, worker: int, source: SeriesSource) -> None:
        self.engine, self.store, self.worker, self.source = engine, store, worker, source
        self.leader = engine.tp_rank == 0
        self._slices = engine.weight_slices()
        self.reserve = functools.partial(source.reserve_share, slices=self._slices)  # the share's buffers, allocated ahead
        self._turns = {"claim": 0, "go": 0}

    def read(self, checkpoint: Checkpoint, buffers: ReadBuffers, stop: threading.Event | None = None) -> dict[str, torch.Tensor]:
        return self.source.read_share(checkpoint, self._slices, buffers, self.engine.tp_rank, self.engine.tp_size, stop)

    def claim(self, queue: WorkQueue) -> int | None:
        """The leader claims the next index and tells the group; the others wait for it."""
        return self._shared("claim", queue.claim)

    def go(self, queue: WorkQueue) -> bool:
        """Whether the group evaluates its next item (the leader's view of the queue)."""
        return self._shared("go", lambda: not queue.stopped())

    def agree(self, error: BaseException | None) -> BaseException | None:
        return agree_on_read(error, self.engine.tp_group)

    def _shared(self, kind: str, decide):
        n = self._turns[kind]
        self._turns[kind] += 1
        key = f"group/{self.worker}/{kind}/{n}"
        if self.leader:
            value = decide()
            self.store.set(key, json.dumps(value))
            return value
        _wait_for(self.store, [key], timeout=STORE_TIMEOUT)
        return json.loads(self.store.get(key))


def watch_group(store, rank: int, t: int) -> GroupWatch | None:
    """At T > 1, this rank's watch over the other ranks of its group (``group_watch.py``:
    a dead one ends the job with one line), started: its thread on a store connection of
    its own, its main-thread checks on ``store`` (the work queue's). None at T = 1."""
    if t == 1:
        return None
    first = rank // t * t
    return GroupWatch(rank_store(serve=False), store, rank, [r for r in range(first, first + t) if r != rank],
                      "" if rank == 0 else f"rank {rank}: ").start()


def join_process_group(config: RunConfig) -> bool:
    """Initialise ``torch.distributed``'s default process group from torchrun's
    environment (gloo on the CPU, NCCL on CUDA) unless it is; returns whether this call
    did (the caller then destroys it). The tensor-parallel engine's mesh is built over it;
    its collectives time out after torch's default (30 min for gloo), so a dead rank of a
    group is found by the group's watchers instead (:class:`TensorParallelGroup`'s
    ``watch``, ``group_watch.py``)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    backend = "nccl" if config.model.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    return True
