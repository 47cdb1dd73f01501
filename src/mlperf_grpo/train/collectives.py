"""The few collectives the trainer uses, each the identity outside a ``torchrun``
process group (:func:`~mlperf_grpo.train.ranks.in_process_group`), so one code path
serves 1 or N ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mlperf_grpo.train.ranks import in_process_group


def all_reduce_sum(values: list[float]) -> list[float]:
    """The sum over ranks of each value (float64 on the CPU, gloo); the values
    themselves outside a torchrun process group."""
    if not in_process_group():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(value: int) -> int:
    """The largest of every rank's ``value``; ``value`` itself outside a process group."""
    if not in_process_group():
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``[n, ...]`` CPU tensor along dim 0, in rank order
    (``[N n, ...]``); ``t`` itself outside a torchrun process group."""
    if not in_process_group():
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def barrier() -> None:
    """Wait for every rank (e.g. after the optimizer step, so the weight-update time is
    when all ranks' updates returned); nothing without a process group.

    Training also ends with one, after its last collective, for a reason of gloo's: its
    worker threads drop their reference to a finished collective's tensors after the
    caller has moved on, and that takes the GIL. A worker still waiting for it when the
    interpreter finalizes is ended by CPython inside C++, and the process aborts after a
    run that succeeded ("terminate called without an active exception", SIGABRT;
    pytorch/pytorch#190489, open). The barrier's wait releases the GIL to them.
    """
    if in_process_group():
        dist.barrier()


def broadcast_object(obj: object) -> object:
    """Rank 0's ``obj`` on every rank; ``obj`` outside a torchrun process group."""
    if not in_process_group():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def full_value(t: torch.Tensor) -> float:
    """A scalar as a Python float; a ``DTensor`` (e.g. the gradient norm that
    ``clip_grad_norm_`` computes over sharded gradients) is reduced over its ranks first."""
    from torch.distributed.tensor import DTensor

    return float(t.full_tensor() if isinstance(t, DTensor) else t)
