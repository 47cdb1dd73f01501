"""One tensor-parallel rank's share of a foreign checkpoint (issue 28, item 3, for the
layouts of ``foreign_layouts.py``): ``full[slice]`` of every tensor, into one host
buffer the size of the share (:data:`~mlperf_grpo.checkpoint.share_read.SHARE_KEY`),
reading only what overlaps the slices:

- a DCP directory: every data file is checked as :func:`foreign_layouts.read_weights`
  checks it (present, long enough, each record's CRC-32), the files divided among the
  group's ranks by bytes (:func:`~mlperf_grpo.checkpoint.share_read.divide_by_bytes`:
  each file checked by one rank), then ``torch.distributed.checkpoint.load(no_dist=True)``
  of a state dict of this rank's slices (:func:`~mlperf_grpo.checkpoint.dcp_read.load_dcp`
  ``into=``): only the saved chunks that overlap them are read, one record in memory at
  a time;
- per-rank Hugging Face safetensors: every file's header, and the slices' cover of
  every tensor, checked on every rank (:func:`~mlperf_grpo.checkpoint.dcp_read.shards_metadata`:
  headers only), then the overlapping part of each file's slices
  (``HuggingFaceStorageReader``: ``safe_open(...).get_slice``);
- whole safetensors: each tensor's slice (``get_slice``).

The group's outcomes are combined by the caller
(:func:`~mlperf_grpo.checkpoint.share_read.agree_on_read`), so a file one rank found
damaged fails the read on every rank. No process group is used here (the read runs in
the prefetch thread, beside the main thread's collectives).
"""

from __future__ import annotations

import math
import threading

import torch

from mlperf_grpo.checkpoint import dcp_read, megatron_layout
from mlperf_grpo.checkpoint import foreign_layouts as foreign
from mlperf_grpo.checkpoint.format import CheckpointCorruptError, CheckpointError
from mlperf_grpo.checkpoint.foreign_layouts import ForeignCheckpoint
from mlperf_grpo.checkpoint.reader import ReadBuffers, ReadStopped
from mlperf_grpo.checkpoint.share_read import SHARE_KEY, Index, divide_by_bytes

_ALIGN = 64
"""Byte alignment of each tensor in the share buffer (any dtype's view needs its itemsize)."""

Block = tuple[tuple[int, ...], tuple[int, ...]]
"""``(offsets, sizes)`` of one rank's block of a full tensor, one entry per dim."""


def share_blocks(specs: dict[str, tuple[str, list[int]]], slices: dict[str, Index | None]) -> dict[str, Block]:
    """Tensor name -> this rank's block of it: ``slices[name]`` (a ``slice`` per leading
    dim, step 1; missing dims whole) as offsets and sizes; a name without a slice (or
    with None: a packed parameter) whole.

    Raises:
        CheckpointError: a slice with a step other than 1, or more dims than the tensor.
    """
    out = {}
    for name, (_, shape) in specs.items():
        index = slices.get(name) or ()
        if len(index) > len(shape):
            raise CheckpointError(f"{name}: an index of {len(index)} dimensions into a tensor of shape {shape}")
        ranges = [(index[d] if d < len(index) else slice(None)).indices(n) for d, n in enumerate(shape)]
        if any(step != 1 for _, _, step in ranges):
            raise CheckpointError(f"{name}: only slices of step 1 are read from a foreign layout")
        out[name] = (tuple(a for a, _, _ in ranges), tuple(max(0, b - a) for a, b, _ in ranges))
    return out


def share_bytes(specs: dict[str, tuple[str, list[int]]], blocks: dict[str, Block]) -> int:
    """Bytes of the share buffer for ``blocks`` (each tensor aligned to 64 bytes)."""
    return sum(_aligned(math.prod(blocks[n][1]) * _dtype(specs[n][0]).itemsize) for n in blocks)


def reserve_foreign_share(buffers: ReadBuffers, checkpoint: ForeignCheckpoint, slices: dict[str, Index | None]) -> None:
    """Allocate (and pin, when ``buffers`` pin) now the share buffer :func:`read_foreign_share`
    of ``checkpoint`` needs; a checkpoint whose headers are unusable gets nothing (its
    read reports it)."""
    try:
        specs = foreign.tensor_specs(checkpoint)
    except CheckpointError:
        return
    buffers.get(SHARE_KEY, share_bytes(specs, share_blocks(specs, slices)))


def read_foreign_share(checkpoint: ForeignCheckpoint, slices: dict[str, Index | None], buffers: ReadBuffers,
                       group_rank: int, group_size: int, stop: threading.Event | None = None) -> dict[str, torch.Tensor]:
    """This rank's slice of every tensor of a foreign checkpoint.

    Args:
        checkpoint: a NeMo-RL or manifest checkpoint (``foreign_layouts.py``).
        slices: Hugging Face name -> this rank's index into the full tensor (the engine's
            ``weight_slices()``; a name not in it, or None, is read whole).
        buffers: the share goes to their ``SHARE_KEY`` buffer (page-locked when they pin).
        group_rank, group_size: this rank in its tensor-parallel group (a DCP's data files
            are divided among the group's ranks for their CRC check).
        stop: checked between tensors (safetensors) and before the load (DCP); once set,
            :class:`ReadStopped`.
    Returns:
        name -> ``full[slices[name]]`` (that slice's shape, the saved dtype), views into
        the share buffer: valid until the next read into ``buffers``.
    Raises:
        CheckpointError: a weight file is missing, or per-rank slices do not cover a tensor.
        CheckpointCorruptError: a file is truncated, fails its CRC-32 or cannot be parsed.
        ReadStopped: ``stop`` was set.
    """
    specs = foreign.tensor_specs(checkpoint)
    blocks = share_blocks(specs, slices)
    share = buffers.get(SHARE_KEY, share_bytes(specs, blocks))
    dest, at = {}, 0
    for name in sorted(blocks):
        dtype, sizes = _dtype(specs[name][0]), blocks[name][1]
        nbytes = math.prod(sizes) * dtype.itemsize
        dest[name] = share[at: at + nbytes].view(dtype).view(sizes)
        at += _aligned(nbytes)
    if stop is not None and stop.is_set():
        raise ReadStopped(f"{checkpoint.path}: read stopped")
    if checkpoint.weights_kind == "megatron":
        _read_megatron(checkpoint, dest, blocks, group_rank, group_size)
    elif checkpoint.weights_kind == "dcp":
        _read_dcp(checkpoint, dest, blocks, group_rank, group_size)
    elif dcp_read.sharding_info(checkpoint.weight_files[0]) is not None:
        directory = checkpoint.weight_files[0].parent
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        metadata = dcp_read.shards_metadata(directory, checkpoint.weight_files)
        dcp_read.load_dcp(directory, metadata, HuggingFaceStorageReader(str(directory)),
                          into={n: (dest[n], blocks[n][0]) for n in dest})
    else:
        _read_safetensors(checkpoint, dest, blocks, stop)
    return dest


def _read_dcp(checkpoint: ForeignCheckpoint, dest: dict[str, torch.Tensor], blocks: dict[str, Block],
              group_rank: int, group_size: int) -> None:
    """A DCP directory's slices: this rank's data files checked first, then the load."""
    directory = checkpoint.weight_files[0]
    metadata = dcp_read.read_dcp_metadata(directory)
    owners = divide_by_bytes(dcp_read.data_files(metadata), group_size)
    dcp_read.check_dcp_files(directory, metadata, only={f for f, rank in owners.items() if rank == group_rank})
    prefix = "model." if checkpoint.dcp_nested else ""
    dcp_read.load_dcp(directory, metadata, into={prefix + n: (dest[n], blocks[n][0]) for n in dest})


def _read_megatron(checkpoint: ForeignCheckpoint, dest: dict[str, torch.Tensor], blocks: dict[str, Block],
                   group_rank: int, group_size: int) -> None:
    """A Megatron ``torch_dist`` checkpoint's slices (``megatron_layout.read_into``): the
    model's data files checked as for a DCP directory (divided among the ranks), then
    only the Megatron blocks covering this rank's slices read."""
    ckpt = foreign.megatron(checkpoint)
    owners = divide_by_bytes(megatron_layout.files_for(ckpt, set(ckpt.dtypes)), group_size)
    megatron_layout.read_into(ckpt, dest, blocks, check={f for f, rank in owners.items() if rank == group_rank})


def _read_safetensors(checkpoint: ForeignCheckpoint, dest: dict[str, torch.Tensor], blocks: dict[str, Block],
                      stop: threading.Event | None) -> None:
    """Whole-tensor safetensors files: each tensor's block through ``get_slice`` (only
    its bytes are read from the file's memory map)."""
    from safetensors import safe_open

    for path in checkpoint.weight_files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if stop is not None and stop.is_set():
                        raise ReadStopped(f"{path}: read stopped")
                    offsets, sizes = blocks[name]
                    dest[name].copy_(f.get_slice(name)[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])
        except (ReadStopped, CheckpointError):
            raise
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing; the checkpoint is incomplete") from None
        except Exception as err:  # noqa: BLE001  (safetensors raises several types)
            raise CheckpointCorruptError(f"{path}: not valid safetensors ({err})") from None


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN
