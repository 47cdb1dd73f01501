"""The host staging copy of a checkpoint: the slot's buffers, filling them on the training
path, and the fingerprint checksums read back from them in the background.

A :class:`StagingSlot` holds the weights a rank owns laid out as its shard files' exact
bytes. :func:`fill_slot` copies the weights into it (on CUDA: ``non_blocking``
device-to-host copies into page-locked memory on their own stream, overlapping what the
caller's ``info`` computes on the compute stream, then one sync; on the CPU a memcpy).
:func:`staged_checksums` computes every staged tensor's
:data:`~mlperf_grpo.model.fingerprint.FINGERPRINT_V2` checksums from that host copy, in
parallel threads (:func:`~mlperf_grpo.model.fingerprint.host_checksums`), off the clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent.futures import Executor, wait
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import torch

from mlperf_grpo.checkpoint.direct_io import ALIGNMENT_BYTES, aligned_empty
from mlperf_grpo.checkpoint.format import safetensors_header
from mlperf_grpo.checkpoint.shard_plan import ShardPlan, tensor_bytes
from mlperf_grpo.model.fingerprint import element_bits, host_checksums

Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
"""What :meth:`~mlperf_grpo.checkpoint.writer.AsyncCheckpointer.save` takes: a state dict
(tied names found by storage and stored once) or ``(name, tensor)`` pairs, each a distinct
tensor (e.g. a tensor-parallel engine's ``full_weights()``, every rank iterating it to the
end)."""

CHECKSUM_RANGE_ELEMENTS = 1 << 24
"""Elements per task of :func:`staged_checksums` (32 MiB of bfloat16): a large tensor is
split so the threads share it."""

Info = TypeVar("Info")


@dataclass
class StagingSlot:
    """One host copy of the weights this rank owns, laid out as its shard files' exact
    bytes: one flat byte buffer (pinned when the weights are on CUDA) holding shard after
    shard, each starting at a multiple of
    :data:`~mlperf_grpo.checkpoint.direct_io.ALIGNMENT_BYTES` with its safetensors header
    (spaces pad it so the data starts aligned too) followed by its tensors back to back,
    exactly as in the file. So a shard is written with O_DIRECT and hashed as one
    contiguous aligned range. The headers depend only on the tensors' names, dtypes and
    shapes: written once, when the slot is built. Reused from checkpoint to checkpoint;
    rebuilt only if the plan changes."""

    layout: tuple = ()
    plan: ShardPlan | None = None
    flat: torch.Tensor | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """name -> view into ``flat`` with the tensor's dtype and shape (this rank's only)."""
    files: list[str] = field(default_factory=list)
    """This rank's shard file names (the plan's global numbering), one per ``shards`` entry."""
    shards: list[tuple[list[str], int, int]] = field(default_factory=list)
    """(tensor names in file order, start byte, end byte of the file image) per shard."""

    def build(self, plan: ShardPlan, rank: int, pin: bool) -> None:
        """Lay out ``rank``'s files of ``plan`` (page-locked memory when ``pin``)."""
        mine = plan.rank_files(rank)
        # largest element size first keeps every view aligned (safetensors orders so too)
        groups = [sorted(group, key=lambda n: -plan.specs[n].element_size()) for _, group in mine]
        headers = [safetensors_header([(n, plan.specs[n]) for n in names], {"format": "pt"}, ALIGNMENT_BYTES)
                   for names in groups]
        offsets, self.shards, offset = {}, [], 0
        for names, header in zip(groups, headers):
            start = offset
            offset += len(header)
            for n in names:
                offsets[n] = offset
                offset += tensor_bytes(plan.specs[n])
            self.shards.append((names, start, offset))
            offset = -(-offset // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
        self.flat = aligned_empty(offset, pin=pin)
        for header, (_, start, _) in zip(headers, self.shards):
            self.flat[start: start + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        self.tensors = {
            n: self.flat[offsets[n]: offsets[n] + tensor_bytes(t)].view(t.dtype).view(t.shape)
            for n, t in plan.owned(rank).items()
        }
        self.files = [name for name, _ in mine]
        self.plan, self.layout = plan, plan.layout


def unique_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop names that are the same tensor as an earlier name (tied embeddings, e.g.
    ``lm_head.weight``), as ``save_pretrained`` stores them: once, under the first name;
    ``from_pretrained`` re-ties them.

    Two names are tied when they view the same bytes the same way: one storage (its
    device and address), the same offset, shape, stride and dtype. An empty tensor
    (``numel() == 0``) is never tied: every empty storage has address 0, so the address
    says nothing about it (safetensors/safetensors#280), and each is kept under its name.
    """
    seen: set[tuple] = set()
    out = {}
    for name, tensor in state_dict.items():
        if tensor.numel() > 0:
            key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                   tensor.stride(), tensor.dtype)
            if key in seen:
                continue
            seen.add(key)
        out[name] = tensor.detach()
    return out


def as_planned(pairs: Iterable[tuple[str, torch.Tensor]], plan: ShardPlan) -> Iterable[tuple[str, torch.Tensor]]:
    """``pairs`` as they come, each checked against the plan's next tensor (name, dtype,
    shape), all of them consumed.

    Raises:
        ValueError: a pair differs from the plan, or one is missing or extra.
    """
    expected = iter(plan.specs.items())
    for name, src in pairs:
        planned, spec = next(expected, (None, None))
        if name != planned or src.dtype != spec.dtype or src.shape != spec.shape:
            raise ValueError(f"the weights given to save differ from those given to prepare at {name!r} "
                             f"(planned: {planned!r}): call prepare with these weights")
        yield name, src
    missing = next(expected, None)
    if missing is not None:
        raise ValueError(f"the weights given to save lack {missing[0]!r}, given to prepare")


def fill_slot(slot: StagingSlot, pairs: Iterable[tuple[str, torch.Tensor]], persistent: bool,
              info: Info | Callable[[], Info]) -> Info:
    """Copy the slot's tensors from ``pairs`` (every pair is consumed; those the slot does
    not hold are skipped) and return ``info`` (called, when a function, while the copies
    run). When this returns the copies are complete: the caller may change the sources.

    ``persistent``: the sources are the engine's own tensors, as the optimizer left them
    on the compute stream (one wait of the copy stream for it); else each pair is made on
    the compute stream just before it comes (a gather) and freed after, so the copy
    stream waits for each and the source's memory is kept until its copy ends.
    Raises whatever iterating ``pairs`` or ``info`` raises (the slot is then partly filled).
    """
    owned = slot.tensors
    if not slot.flat.is_pinned():  # CPU: a memcpy
        for name, src in pairs:
            if name in owned:
                owned[name].copy_(src)
        return info() if callable(info) else info
    copies = torch.cuda.Stream()
    if persistent:
        copies.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(copies):
            for name, src in pairs:
                if name in owned:
                    owned[name].copy_(src, non_blocking=True)
    else:
        for name, src in pairs:  # the generator runs here, on the compute stream
            if name in owned:
                copies.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(copies):
                    owned[name].copy_(src, non_blocking=True)
                if src.is_cuda:  # its memory is not reused before the copy ends
                    src.record_stream(copies)
    copied = torch.cuda.Event()
    copied.record(copies)
    # on the compute stream, overlapping the copies (which only the copy engine does):
    # whatever ``info`` computes (the canary logits)
    info = info() if callable(info) else info
    computed = torch.cuda.Event()
    computed.record()
    copied.synchronize()  # one sync for all copies, before training changes the weights
    computed.synchronize()
    return info


def staged_checksums(slot: StagingSlot, pool: Executor) -> dict[str, list[int]]:
    """name -> :func:`~mlperf_grpo.model.fingerprint.tensor_checksums` ``[sum, weighted sum]``
    (int64 values as Python ints) of each tensor of a filled slot, computed on the host
    from the staged copy by ``pool``'s threads (runs of at most
    :data:`CHECKSUM_RANGE_ELEMENTS` elements, summed modulo 2**64 per tensor: the v2
    sums over a partition add up). The same values as the source tensors' on their
    device. Call from a thread other than ``pool``'s (it waits for their results).
    """
    tasks = []
    for name, tensor in slot.tensors.items():
        bits = element_bits(tensor)
        for first in range(0, bits.size, CHECKSUM_RANGE_ELEMENTS):
            tasks.append((name, pool.submit(host_checksums, bits[first: first + CHECKSUM_RANGE_ELEMENTS], first)))
    wait([task for _, task in tasks])  # every task has stopped reading the slot, even when one failed
    sums = {name: [0, 0] for name in slot.tensors}
    for name, task in tasks:
        a, b = task.result()
        sums[name][0] += a
        sums[name][1] += b
    return {name: [_int64(a), _int64(b)] for name, (a, b) in sums.items()}


def _int64(value: int) -> int:
    """``value`` modulo 2**64 read as a two's-complement int64."""
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value
