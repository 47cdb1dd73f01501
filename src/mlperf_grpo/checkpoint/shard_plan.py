"""Which rank writes which tensors of a checkpoint, and in which shard file.

Every rank computes the same :class:`ShardPlan` from the same inputs (the checkpoint's
tensor names, dtypes and shapes in the order the engine gives them, the world size and
``max_shard_size``), so no rank has to tell another what it owns. Each tensor has one
owner (tied names were dropped before: stored once, as ``save_pretrained`` does), each
rank's tensors lie in whole shard files, and the files are numbered once for the whole
checkpoint (``model-0000k-of-0000n.safetensors``: rank 0's files first, then rank 1's),
so the published directory is one ordinary Hugging Face checkpoint whoever wrote it.

Balance: the tensors, in their given order, are cut into ``world_size`` contiguous runs
by bytes: a tensor whose first byte lies at offset ``s`` of the checkpoint's ``B`` bytes
goes to rank ``floor(s N / B)``. A rank's tensors all start inside its ``B / N`` bytes,
so it holds at most ``B / N`` bytes plus the one tensor that runs past their end:
at most ``B / N + max tensor bytes`` (tested in ``tests/checkpoint/test_checkpoint_ranks.py``).
Within a rank, tensors go into files as ``huggingface_hub.split_torch_state_dict_into_shards``
puts them (transformers' own ``save_pretrained`` split); with one rank that is exactly
the split of the whole checkpoint a one-process writer always made.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from huggingface_hub import split_torch_state_dict_into_shards

from mlperf_grpo.checkpoint.format import shard_name


@dataclass(frozen=True)
class ShardPlan:
    """The checkpoint's tensors (``specs``: name -> a meta tensor of its dtype and shape,
    in the given order) split over ``world_size`` ranks.

    ``files``: per shard file, in the global numbering (index ``i`` is file
    ``shard_name(i + 1, len(files))``), ``(owner rank, tensor names in the file)``.
    """

    world_size: int
    specs: dict[str, torch.Tensor]
    files: tuple[tuple[int, tuple[str, ...]], ...]
    layout: tuple
    """:func:`layout_of` the specs over ``world_size``: equal layouts give equal plans."""

    @property
    def total_bytes(self) -> int:
        """Bytes of every tensor's data (the index's ``total_size``)."""
        return sum(tensor_bytes(t) for t in self.specs.values())

    def file_names(self) -> list[str]:
        """Every shard file's name, in the global numbering."""
        return [shard_name(i + 1, len(self.files)) for i in range(len(self.files))]

    def weight_map(self) -> dict[str, str]:
        """The index's ``weight_map``: tensor name -> its shard file, in name order."""
        names = self.file_names()
        return dict(sorted((t, names[i]) for i, (_, group) in enumerate(self.files) for t in group))

    def rank_files(self, rank: int) -> list[tuple[str, tuple[str, ...]]]:
        """``(file name, tensor names)`` of each file ``rank`` writes (none: an empty list)."""
        names = self.file_names()
        return [(names[i], group) for i, (owner, group) in enumerate(self.files) if owner == rank]

    def owned(self, rank: int) -> dict[str, torch.Tensor]:
        """name -> meta spec of each tensor ``rank`` stages and writes, in the given order."""
        mine = {t for _, group in self.rank_files(rank) for t in group}
        return {n: t for n, t in self.specs.items() if n in mine}


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's data (``numel x element_size``)."""
    return t.numel() * t.element_size()


def spec_of(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``t``'s dtype and shape (what the plan and the headers need)."""
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def layout_of(pairs: Iterable[tuple[str, torch.Tensor]], world_size: int) -> tuple:
    """``(world_size, ((name, dtype, shape), ...))``: everything a :class:`ShardPlan` is
    computed from besides ``max_shard_size``."""
    return world_size, tuple((n, t.dtype, tuple(t.shape)) for n, t in pairs)


def plan_shards(specs: Iterable[tuple[str, torch.Tensor]], world_size: int, max_shard_size: int | str) -> ShardPlan:
    """The :class:`ShardPlan` of these tensors (``(name, tensor)`` pairs of any device,
    meta included; only names, dtypes and shapes are read) over ``world_size`` ranks
    (see the module docstring for the rule and its bound).

    Raises:
        ValueError: ``world_size < 1`` or a name given twice.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    metas: dict[str, torch.Tensor] = {}
    for name, t in specs:
        if name in metas:
            raise ValueError(f"tensor {name!r} is given twice")
        metas[name] = spec_of(t)
    total = sum(tensor_bytes(t) for t in metas.values())
    owners: list[dict[str, torch.Tensor]] = [{} for _ in range(world_size)]
    start = 0
    for name, t in metas.items():
        owners[min(world_size - 1, start * world_size // total) if total else 0][name] = t
        start += tensor_bytes(t)
    files = []
    for rank, mine in enumerate(owners):
        if mine:  # meta tensors have no storage: nothing is taken for tied (tied names are gone)
            split = split_torch_state_dict_into_shards(mine, max_shard_size=max_shard_size)
            files += [(rank, tuple(group)) for group in split.filename_to_tensors.values()]
    return ShardPlan(world_size, metas, tuple(files), layout_of(metas.items(), world_size))
