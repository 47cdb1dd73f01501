"""Where this process sits among the ``torchrun`` ranks, and who does what.

Launched by ``torchrun`` (``torch.distributed.is_torchelastic_launched()``), every rank
runs the same trainer; without it the process is rank 0 of a world of 1 and nothing
communicates (every collective, :mod:`~mlperf_grpo.train.collectives`, is then the
identity), so single-process runs behave as before. "Distributed" is decided from
torchrun's environment (:func:`in_process_group`), never from
``torch.distributed.is_initialized()`` alone: the vLLM engine initialises a process group
of its own inside a single process. The decisions, and where they are made:

- **process group**: :func:`process_group` (gloo for CPU tensors, NCCL for CUDA tensors
  when CUDA is present; each rank on the CUDA device ``LOCAL_RANK``).
- **prompts**: :func:`prompt_share`; rank ``r`` of ``N`` generates prompts
  ``[r P/N, (r+1) P/N)`` of the step, with the per-completion seeds of their global
  index, so a completion does not depend on ``N``; a prompt group never spans ranks. At
  T > 1 the group's T ranks generate the group's prompts together and each trains on
  its 1/T of them.
- **policy**: :func:`~mlperf_grpo.train.fsdp.load_sharded_policy` builds it FSDP2-sharded
  from the start (:mod:`mlperf_grpo.train.fsdp`): no rank ever holds the whole fp32 model,
  on the host or on a device.
- **engine**: :func:`~mlperf_grpo.train.engine_setup.engine_from_policy` gives each rank a
  full rollout-dtype copy on its device, or at ``inference.tensor_parallel_size`` T > 1
  its slices of the model split over its group of T ranks
  (:mod:`~mlperf_grpo.inference.tensor_parallel`), filled by a refit from the sharded policy.
- **refit**: :func:`~mlperf_grpo.train.fsdp.policy_weights` hands the policy to the
  engine's one refit entry (``engine.load_weights``) one parameter at a time.
- **who writes**: rank 0 alone writes the run directory and the MLPerf log
  (:func:`is_writer`); every rank stages and writes its share of each deferred
  checkpoint (:mod:`mlperf_grpo.checkpoint.shard_plan`) and rank 0 publishes it. The trainer gives the other ranks objects that write
  nothing (:mod:`mlperf_grpo.train.outputs`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.errors import ConfigError


class LayoutError(ConfigError):
    """The config does not divide over the launched ranks (exit 2)."""


@dataclass(frozen=True)
class Layout:
    """Where this process sits: ``rank`` of ``world_size`` data-parallel ranks."""

    rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        """True under ``torchrun`` (even with one rank): the policy is FSDP-sharded."""
        return in_process_group()


def launched() -> bool:
    """True when this process was started by ``torchrun`` (its environment is set)."""
    return dist.is_available() and dist.is_torchelastic_launched()


def ranks_on_host() -> int:
    """The ranks sharing this host's memory: torchrun's ``LOCAL_WORLD_SIZE`` under
    torchrun, else 1 (one process; a ``LOCAL_WORLD_SIZE`` left in its environment is not
    read).

    Raises:
        LayoutError: under torchrun, ``LOCAL_WORLD_SIZE`` is not a positive whole number.
    """
    if not launched():
        return 1
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    if not (value.isascii() and value.isdigit() and int(value) > 0):
        raise LayoutError(f"LOCAL_WORLD_SIZE must be the number of ranks on this host, a positive whole number "
                          f"(torchrun sets it), got {value!r}; launch with torchrun or set it to the ranks on this host")
    return int(value)


def in_process_group() -> bool:
    """True when this process is a torchrun rank that has joined its process group
    (:func:`process_group`): the one test of "distributed" every helper here uses. A
    group that something else initialised in a process torchrun did not start (vLLM's,
    of world size 1) does not count."""
    return launched() and dist.is_initialized()


def layout() -> Layout:
    """This process's :class:`Layout` (rank 0 of 1 outside a torchrun process group)."""
    if in_process_group():
        return Layout(dist.get_rank(), dist.get_world_size())
    return Layout()


def is_writer() -> bool:
    """True on the one rank that writes the run directory, the log and checkpoints."""
    return layout().rank == 0


@contextlib.contextmanager
def process_group() -> Iterator[Layout]:
    """Under ``torchrun``: join the process group for the duration (rank ``RANK`` of
    ``WORLD_SIZE``, rendezvous from torchrun's environment), pin this rank to CUDA device
    ``LOCAL_RANK`` when CUDA is present, and send the stdout of ranks other than 0 to
    ``/dev/null`` (rank 0 prints the run's outcome). Without torchrun: nothing.

    Yields:
        The :class:`Layout`.
    """
    if not launched() or dist.is_initialized():
        yield layout()
        return
    if torch.cuda.is_available():
        device_id = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device_id)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device_id)  # the small CPU stats go through gloo
    else:
        dist.init_process_group("gloo")
    try:
        with rank_zero_stdout():
            yield layout()
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def rank_zero_stdout() -> Iterator[None]:
    """Under ``torchrun``, send the stdout of ranks other than 0 to ``/dev/null`` for the
    duration (rank 0 prints the outcome; errors still reach stderr). Without: nothing."""
    saved_stdout = sys.stdout
    if launched() and int(os.environ.get("RANK", "0")) != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (closed below)
    try:
        yield
    finally:
        if sys.stdout is not saved_stdout:
            sys.stdout.close()
            sys.stdout = saved_stdout


def check_layout(config: RunConfig, world_size: int | None = None, deferred: bool = True) -> None:
    """Refuse a config that does not divide over ``world_size`` ranks (default: this
    process's world).

    Raises:
        LayoutError: ``num_prompts_per_step`` is not a multiple of the world size, the
            per-rank rows ``GBS / N`` are not a multiple of ``micro_batch_size`` (without
            ``micro_batch_tokens``), or a
            feature that runs in one process only (the vLLM engine, inline evaluation)
            was asked for under torchrun or with more than one rank.
    """
    n = layout().world_size if world_size is None else world_size
    if n > 1 or launched():  # the policy is FSDP-sharded: these read it as one module
        if config.inference.engine != "hf":
            raise LayoutError(f"inference.engine {config.inference.engine} runs in one process, not under torchrun: use engine hf")
        if not deferred:
            raise LayoutError("DEFERRED_OFFLINE_EVAL=0 (inline evaluation) runs in one process, not under torchrun: unset it")
    if n == 1:
        return
    g = config.grpo
    if g.num_prompts_per_step % n:
        raise LayoutError(
            f"grpo.num_prompts_per_step {g.num_prompts_per_step} (GBS {config.global_batch_size}) does not divide over "
            f"{n} ranks: each rank generates whole prompt groups; use a multiple of {n} or another --nproc-per-node"
        )
    rows = config.global_batch_size // n
    if g.micro_batch_tokens is None and rows % g.micro_batch_size:
        raise LayoutError(
            f"grpo.micro_batch_size {g.micro_batch_size} does not divide the {rows} rows each of {n} ranks trains on "
            f"(GBS {config.global_batch_size} / {n}); set it to a divisor of {rows}"
        )


def prompt_share(num_prompts: int, here: Layout | None = None, tensor_parallel_size: int = 1) -> slice:
    """The prompts of a step this rank generates: its tensor-parallel group's,
    ``[g P/G, (g+1) P/G)`` for group ``g = r // T`` of ``G = N / T`` (at T = 1, the
    rank's own ``[r P/N, (r+1) P/N)``, which it also trains on; at T > 1 each rank of the
    group trains on its 1/T of them:
    :func:`~mlperf_grpo.inference.tensor_parallel.rank_share`).

    Raises:
        LayoutError: ``num_prompts`` is not a multiple of the world size.
    """
    here = layout() if here is None else here
    if num_prompts % here.world_size:
        raise LayoutError(f"{num_prompts} prompts do not divide over {here.world_size} ranks")
    per_group = num_prompts * tensor_parallel_size // here.world_size
    group = here.rank // tensor_parallel_size
    return slice(group * per_group, (group + 1) * per_group)
