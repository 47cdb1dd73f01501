"""Reading one tensor-parallel rank's share of a checkpoint (issue 28, item 3).

A rank of a group of ``group_size`` that evaluates with a sharded engine needs only its
slice of each tensor (``engine.weight_slices()``). :func:`read_share` reads exactly those
bytes from the safetensors files (the offsets in each file's header; one ``preadv`` per
contiguous run) into one host buffer the size of the share, and hashes the shard files
this rank is assigned (:func:`hashing_ranks`: the files divided among the group by
bytes, each file hashed by one rank, streamed through two buffers of
:data:`~mlperf_grpo.checkpoint.reader.READ_CHUNK_BYTES`). The ranks' outcomes are then
combined over the group on the main thread (:func:`agree_on_read`), so a file that
fails its hash fails the read on every rank, whichever rank hashed it.

Host memory per rank: the share (about total/T plus the replicated tensors) and
:data:`HASH_BUFFER_BYTES`; no whole shard. The bytes a rank slices are not the bytes
another rank hashed: a file changed between the two would pass here, and is caught by
the device fingerprint of the refit (combined over the group).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from mlperf_grpo.checkpoint.format import HASH_ALGORITHM, INFO_FILE, CheckpointCorruptError, CheckpointError, new_hasher
from mlperf_grpo.checkpoint.reader import (
    READ_CHUNK_BYTES,
    Checkpoint,
    ReadBuffers,
    ReadStopped,
    _read_header,
    header_entries,
)

Index = tuple[slice, ...]
"""One rank's index into a full tensor: a ``slice`` per leading dimension (missing ones whole)."""

HASH_BUFFER_BYTES = 2 * READ_CHUNK_BYTES
"""Host bytes a rank uses to hash its files: one chunk hashed while the next is read."""

SHARE_KEY, HASH_KEYS = "/share", ("/hash0", "/hash1")
""":class:`ReadBuffers` keys (no shard file name has a ``/``)."""

_ALIGN = 64
"""Byte alignment of each tensor in the share buffer (any dtype's view needs its itemsize)."""


def hashing_ranks(checkpoint: Checkpoint, group_size: int) -> dict[str, int]:
    """Shard file name -> the rank of the group that hashes it: largest files first,
    each to the rank with the fewest bytes so far (ties: the lowest rank). Computed from
    ``training_info.json`` alone, so every rank of the group gets the same answer."""
    shards = checkpoint.info.weights["shards"]
    return divide_by_bytes({name: int(shard.get("bytes") or 0) for name, shard in shards.items()}, group_size)


def divide_by_bytes(sizes: dict[str, int], group_size: int) -> dict[str, int]:
    """File name -> the rank of a group of ``group_size`` that checks it, given each
    file's bytes: largest files first, each to the rank with the fewest bytes so far
    (ties: the lowest rank), so every rank given the same sizes gets the same answer."""
    load = [0] * group_size
    owner: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(group_size), key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += sizes[name]
    return owner


def read_share(checkpoint: Checkpoint, slices: dict[str, Index], buffers: ReadBuffers, group_rank: int, group_size: int,
               stop: threading.Event | None = None) -> dict[str, torch.Tensor]:
    """This rank's slice of every tensor of the checkpoint, and the hashes of its files.

    Args:
        checkpoint: a published checkpoint (its shard list and hashes in ``training_info.json``).
        slices: tensor name -> this rank's index into the full tensor (a tensor not in
            it is read whole: replicated); names not in the checkpoint are ignored (tied).
        buffers: the share goes to their ``SHARE_KEY`` buffer (page-locked when they pin),
            the hashing to ``HASH_KEYS`` (two of ``READ_CHUNK_BYTES``, never pinned).
        group_rank, group_size: this rank in its tensor-parallel group; it hashes the
            files :func:`hashing_ranks` gives it.
        stop: checked between chunks and runs; once set, :class:`ReadStopped`.
    Returns:
        name -> ``full[slices[name]]`` (shape of that slice, the file's dtype), views into
        the share buffer: valid until the next read into ``buffers``.
    Raises:
        ReadStopped: ``stop`` was set.
        CheckpointError: a shard is missing.
        CheckpointCorruptError: a shard's size differs from ``training_info.json``, its
            header is not valid safetensors, or (a file this rank hashes) its
            :data:`HASH_ALGORITHM` differs. Combine the ranks' outcomes with
            :func:`agree_on_read`.
    """
    plan, share_bytes = _plan(checkpoint, slices)
    share = buffers.get(SHARE_KEY, share_bytes)
    view = memoryview(share.numpy())
    tensors: dict[str, torch.Tensor] = {}
    descriptors: dict[Path, int] = {}
    try:
        for name, path, dtype, shape, start, ranges, local, at in sorted(plan, key=lambda p: (p[1], p[4])):  # file order
            if path not in descriptors:
                descriptors[path] = os.open(path, os.O_RDONLY)
            nbytes = math.prod(local) * dtype.itemsize
            _read_runs(descriptors[path], path, view[at: at + nbytes], start, shape, ranges, dtype.itemsize, stop)
            tensors[name] = share[at: at + nbytes].view(dtype).view(local)
    finally:
        for fd in descriptors.values():
            os.close(fd)
    owners = hashing_ranks(checkpoint, group_size)
    for path in checkpoint.shard_paths():
        if owners[path.name] == group_rank:
            _check_hash(checkpoint, path, buffers, stop)
    return tensors


def reserve_share(buffers: ReadBuffers, checkpoint: Checkpoint, slices: dict[str, Index]) -> None:
    """Allocate (and pin, when ``buffers`` pin) now what :func:`read_share` of
    ``checkpoint`` with ``slices`` needs, so the read allocates nothing (page-locking
    kept away from a refit or a generation: see ``ReadBuffers.reserve``). A checkpoint
    whose files or headers are unusable gets nothing here: its read reports it."""
    try:
        share_bytes = _plan(checkpoint, slices)[1]
    except CheckpointError:
        return
    buffers.get(SHARE_KEY, share_bytes)
    for key in HASH_KEYS:
        buffers.get(key, READ_CHUNK_BYTES, pin=False)


def _plan(checkpoint: Checkpoint, slices: dict[str, Index]) -> tuple[list[tuple], int]:
    """Per tensor, in name order, ``(name, path, dtype, full shape, data offset in the
    file, ranges, local shape, offset in the share buffer)``; and the share's bytes."""
    layout = _layout(checkpoint)
    plan, offset = [], 0
    for name in sorted(layout):
        path, dtype, shape, start = layout[name]
        ranges = _ranges(slices.get(name, ()), shape, f"{checkpoint.path.name}: {name}")
        local = [len(range(*r)) for r in ranges]
        plan.append((name, path, dtype, shape, start, ranges, local, offset))
        offset += -(-math.prod(local) * dtype.itemsize // _ALIGN) * _ALIGN
    return plan, offset


def _layout(checkpoint: Checkpoint) -> dict[str, tuple[Path, torch.dtype, list[int], int]]:
    """Tensor name -> (shard path, dtype, full shape, byte offset of its data in the
    file), from every shard's header, checked against the file sizes recorded."""
    out = {}
    for path in checkpoint.shard_paths():
        where = f"{checkpoint.path.name}/{path.name}"
        expected = checkpoint.info.weights["shards"][path.name].get("bytes")
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing; the checkpoint is incomplete") from None
        if size != expected:
            raise CheckpointCorruptError(f"{where}: {size} bytes, {INFO_FILE} recorded {expected!r}; the checkpoint is corrupt")
        header = _read_header(path)
        with open(path, "rb") as f:
            base = 8 + int.from_bytes(f.read(8), "little")
        try:
            for name, (dtype, shape, start, _) in header_entries(header, base, size).items():
                out[name] = (path, dtype, shape, start)
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointCorruptError(f"{where}: not valid safetensors ({err})") from None
    return out


def _ranges(index: Index, shape: list[int], what: str) -> list[tuple[int, int, int]]:
    if len(index) > len(shape):
        raise CheckpointError(f"{what}: an index of {len(index)} dimensions into a tensor of shape {shape}")
    ranges = [(index[d] if d < len(index) else slice(None)).indices(size) for d, size in enumerate(shape)]
    if any(step <= 0 for _, _, step in ranges):
        raise CheckpointError(f"{what}: only positive slice steps are read")
    return ranges


def runs(shape: list[int], ranges: list[tuple[int, int, int]], itemsize: int) -> tuple[int, list[int]]:
    """The contiguous pieces of ``full[ranges]`` in a C-order tensor of ``shape``:
    ``(bytes per run, byte offset of each run from the tensor's start)``, runs in the
    slice's own C order (so they fill its destination one after another). The trailing
    whole dimensions, and the one before them when its step is 1, make one run."""
    strides = [math.prod(shape[d + 1:]) * itemsize for d in range(len(shape))]
    k = len(shape)
    while k > 0 and ranges[k - 1] == (0, shape[k - 1], 1):
        k -= 1
    run_bytes = math.prod(shape[k:]) * itemsize
    base, outer = 0, k
    if k > 0 and ranges[k - 1][2] == 1:
        run_bytes *= len(range(*ranges[k - 1]))
        base, outer = ranges[k - 1][0] * strides[k - 1], k - 1
    offsets = [base + sum(i * s for i, s in zip(position, strides))
               for position in itertools.product(*(range(*ranges[d]) for d in range(outer)))]
    return run_bytes, offsets


def _read_runs(fd: int, path: Path, dest: memoryview, start: int, shape: list[int], ranges: list[tuple[int, int, int]],
               itemsize: int, stop: threading.Event | None) -> None:
    """Read the runs of one tensor's slice (:func:`runs`) into ``dest`` (its exact size),
    at most ``READ_CHUNK_BYTES`` a call; stoppable between calls."""
    run_bytes, offsets = runs(shape, ranges, itemsize)
    at = 0
    for offset in offsets if run_bytes else []:
        for piece in range(0, run_bytes, READ_CHUNK_BYTES):
            if stop is not None and stop.is_set():
                raise ReadStopped(f"{path}: read stopped")
            count = min(READ_CHUNK_BYTES, run_bytes - piece)
            if os.preadv(fd, [dest[at: at + count]], start + offset + piece) != count:
                raise CheckpointCorruptError(f"{path}: shorter than its size while read; was it changed during evaluation?")
            at += count


def _check_hash(checkpoint: Checkpoint, path: Path, buffers: ReadBuffers, stop: threading.Event | None) -> None:
    """Hash one shard file streamed through the two ``HASH_KEYS`` buffers (one chunk
    hashed in a thread while the next is read; xxhash releases the interpreter lock)."""
    chunks = [memoryview(buffers.get(key, READ_CHUNK_BYTES, pin=False).numpy()) for key in HASH_KEYS]
    digest, pending = new_hasher(), None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="share-hash") as hashing, open(path, "rb", buffering=0) as f:
        try:
            for turn in itertools.count():
                if stop is not None and stop.is_set():
                    raise ReadStopped(f"{path}: read stopped")
                chunk = chunks[turn % 2]
                got = f.readinto(chunk)
                if pending is not None:
                    pending.result()  # the other buffer is free again
                if not got:
                    break
                pending = hashing.submit(digest.update, chunk[:got])
        finally:
            if pending is not None:
                pending.result()
    if digest.hexdigest() != checkpoint.info.weights["shards"][path.name].get("hash"):
        raise CheckpointCorruptError(
            f"{checkpoint.path.name}/{path.name}: {HASH_ALGORITHM} differs from {INFO_FILE}; the checkpoint is corrupt")


_READ_ERRORS = {cls.__name__: cls for cls in (CheckpointCorruptError, CheckpointError, ReadStopped)}


def agree_on_read(error: BaseException | None, group: object = None) -> BaseException | None:
    """Combine the outcomes of the group's :func:`read_share` calls of one checkpoint (a
    collective over ``group``, ``torch.distributed``'s ``all_gather_object``; call it on
    the main thread of every rank): ``None`` when every rank read and hashed its part,
    else the error of the lowest failed rank, the same on every rank (a checkpoint
    error of another rank as its own class, anything else as a ``RuntimeError`` naming
    the rank).

    Args:
        error: what this rank's read raised, or ``None``.
        group: the tensor-parallel group (None: the default group).
    """
    import torch.distributed as dist

    outcome = None if error is None else (type(error).__name__, str(error))
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, outcome, group=group)
    for rank, failed in enumerate(gathered):
        if failed is not None:
            if failed == outcome:
                return error
            kind, message = failed
            return _READ_ERRORS[kind](message) if kind in _READ_ERRORS else RuntimeError(f"group rank {rank}: {kind}: {message}")
    return None
