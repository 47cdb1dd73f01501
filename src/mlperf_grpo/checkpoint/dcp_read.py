"""Reads of ``torch.distributed.checkpoint`` (DCP) output in one process, no process
group (``load(..., no_dist=True)``), for the foreign layouts (``foreign_layouts.py``):

- a DCP directory (``.metadata`` + ``*.distcp``, ``FileSystemWriter``): every data file
  the metadata names is checked before the load (present, long enough, and each
  ``torch.save`` record's CRC-32 as the writer computed it), so a missing, truncated or
  damaged file is named instead of surfacing as DCP's ``CheckpointException`` (a
  ``BaseException``) about "rank 0";
- Hugging Face safetensors written one file per rank (Automodel's sharded save, the
  NeMo-RL default: ``shard-0000R-model-0000K-of-0000N.safetensors``, each tensor's slice
  placed by the ``DCP_SHARDING_INFO`` ``saved_offsets`` of its file's header), assembled
  by torch's ``HuggingFaceStorageReader``, after checking that the slices cover every
  element of every tensor exactly once.

What a DCP directory cannot prove: a flipped byte inside a record written without a
CRC (``SerializationFormat.SAFETENSORS`` or a transform such as compression) passes;
the safetensors shards record no hash at all (only their headers are checked).
"""

from __future__ import annotations

import functools
import io
import json
import math
import struct
import warnings
import zipfile
import zlib
from collections import defaultdict
from pathlib import Path

import torch

from mlperf_grpo.checkpoint.format import CheckpointCorruptError, CheckpointError

DCP_METADATA = ".metadata"
SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
"""The safetensors ``__metadata__`` key of a per-rank file (torch ``_hf_utils``)."""
_ZIP_MAGIC = b"PK\x03\x04"


def read_dcp_metadata(directory: Path):
    """The ``Metadata`` of the DCP in ``directory``.

    Raises:
        CheckpointError: ``.metadata`` missing or not readable; names it.
    """
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(directory)).read_metadata()
    except Exception as err:  # noqa: BLE001  (torch raises several types for a bad file)
        raise CheckpointError(f"{directory / DCP_METADATA}: not a readable torch distributed checkpoint ({err})") from None


def data_files(metadata) -> dict[str, int]:
    """Each data file ``metadata`` names (its path relative to the DCP directory) -> the
    bytes it places there (the end of its last record)."""
    ends: dict[str, int] = defaultdict(int)
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends[info.relative_path], info.offset + info.length)
    return dict(ends)


def check_dcp_files(directory: Path, metadata, only: set[str] | None = None) -> None:
    """Every data file ``metadata`` names (or those of ``only``: relative paths, e.g. a
    tensor-parallel rank's part of them) is present and holds the bytes it places
    there; each record written by ``torch.save`` (a zip archive) matches the CRC-32s in
    its own directory. Costs one more read of every data byte than the load (256 MiB of
    float32 from the page cache: 2.8 s, the load 3.4 s, on 2 cores at load average 19),
    one record in memory at a time.

    Raises:
        CheckpointError: a data file is missing (the checkpoint is incomplete).
        CheckpointCorruptError: a data file is shorter than the metadata says, or a
            record fails its CRC-32; names the file and the byte range.
    """
    by_file: dict[str, list] = defaultdict(list)
    for index, info in metadata.storage_data.items():
        by_file[info.relative_path].append((info.offset, info.length, index.fqn, getattr(info, "transform_descriptors", None)))
    for name, items in sorted(by_file.items()):
        if only is not None and name not in only:
            continue
        path = directory / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing ({directory / DCP_METADATA} names it); the checkpoint is incomplete") from None
        end = max(offset + length for offset, length, _, _ in items)
        if size < end:
            raise CheckpointCorruptError(f"{path}: truncated: {size} bytes, its metadata places data up to byte {end}")
        with open(path, "rb") as f:
            for offset, length, fqn, transforms in sorted(items):
                f.seek(offset)
                record = f.read(length)
                if not transforms and record.startswith(_ZIP_MAGIC) and not _crc_ok(record):
                    raise CheckpointCorruptError(
                        f"{path}: bytes {offset}..{offset + length} ({fqn}) fail the CRC-32 that torch.save recorded: "
                        "the file is damaged")


def _crc_ok(record: bytes) -> bool:
    """Each stored member of the zip archive ``record`` (as ``torch.save`` writes them)
    matches the CRC-32 its central directory records; computed with ``zlib.crc32`` on
    the record's memory (no copy)."""
    view = memoryview(record)
    try:
        with zipfile.ZipFile(io.BytesIO(record)) as archive:
            for member in archive.infolist():
                if member.compress_type != zipfile.ZIP_STORED:
                    continue
                at = member.header_offset
                if bytes(view[at:at + 4]) != _ZIP_MAGIC:
                    return False
                name_bytes, extra_bytes = struct.unpack_from("<HH", view, at + 26)  # the local header's lengths
                start = at + 30 + name_bytes + extra_bytes
                if start + member.compress_size > len(view) or zlib.crc32(view[start:start + member.compress_size]) != member.CRC:
                    return False
    except (zipfile.BadZipFile, struct.error, ValueError):
        return False
    return True


def load_dcp(directory: Path, metadata, storage_reader=None,
             into: dict[str, tuple[torch.Tensor, tuple[int, ...]]] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a DCP (state-dict keys as saved), filled by
    ``torch.distributed.checkpoint.load(no_dist=True)``; ``storage_reader`` defaults to a
    ``FileSystemReader`` of ``directory``.

    Args:
        into: None: every full tensor, allocated from ``metadata``. Else key ->
            ``(destination, offsets)``: the block of the full tensor that starts at
            ``offsets`` (one per dim) and has the destination's shape is read into the
            destination (e.g. a tensor-parallel rank's slice, a view into its host
            buffer): only the saved chunks overlapping it are read (:func:`slice_planner`),
            and only the keys given.
    Raises:
        CheckpointCorruptError: the load failed (any error, DCP's ``CheckpointException``
            included); names ``directory`` and the first underlying error.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if into is None:
        state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
                 for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)}
        planner = None
    else:
        state, planner = {key: dest for key, (dest, _) in into.items()}, slice_planner({k: o for k, (_, o) in into.items()})
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=storage_reader or FileSystemReader(str(directory)), planner=planner, no_dist=True)
    except (Exception, CheckpointException) as err:  # noqa: BLE001  (CheckpointException is a BaseException)
        cause = next(iter(err.failures.values()), err) if isinstance(err, CheckpointException) else err
        first = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        raise CheckpointCorruptError(f"{directory}: the torch distributed checkpoint cannot be read ({first})") from None
    return state


@functools.lru_cache(maxsize=1)
def _slice_planner_class():
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class _SlicePlanner(DefaultLoadPlanner):
        def __init__(self, offsets: dict[str, tuple[int, ...]]) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.offsets = offsets

        def create_local_plan(self) -> LoadPlan:
            items = []
            for key, dest in self.state_dict.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(self.offsets[key]), sizes=dest.size())
                items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
            return LoadPlan(items)

        def lookup_tensor(self, index) -> torch.Tensor:  # the destination is the block itself, not a sharded tensor
            return self.state_dict[index.fqn]

    return _SlicePlanner


def slice_planner(offsets: dict[str, tuple[int, ...]]):
    """A ``DefaultLoadPlanner`` (its class defined once torch's DCP is imported) whose plan reads, for each key of the state dict (a
    destination tensor), the block of the saved full tensor starting at ``offsets[key]``
    with the destination's shape: the read items of every saved chunk that overlaps it
    (``planner_helpers.create_read_items_for_chunk_list``, as DCP plans a DTensor's local
    shard), each copied into its part of the destination; nothing else is read."""
    return _slice_planner_class()(offsets)


# --------------------------------------------------------------------------- per-rank safetensors

def sharding_info(path: Path) -> dict | None:
    """``{name: {"saved_offsets": [...]}}`` of a per-rank safetensors file, or None for
    a file that holds whole tensors.

    Raises:
        CheckpointCorruptError: the header is not readable safetensors, or its
            ``DCP_SHARDING_INFO`` is not JSON; names the file.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(SHARDING_INFO_KEY)
        return None if raw is None else json.loads(raw)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete") from None
    except Exception as err:  # noqa: BLE001  (safetensors raises several types)
        raise CheckpointCorruptError(f"{path}: not a readable safetensors file ({err}); the checkpoint is corrupt") from None


def shards_metadata(directory: Path, files: tuple[Path, ...]):
    """The DCP ``Metadata`` of the per-rank safetensors ``files`` (all of ``directory``'s,
    as torch's reader lists them), after checking each file's header and that the
    slices of every tensor cover it exactly (no element missing or given twice: a
    missing rank's file would leave uninitialised rows).

    Raises:
        CheckpointError, CheckpointCorruptError: a header is unreadable, or a tensor's
            slices do not cover it; names the file or the tensor.
    """
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    for path in files:
        sharding_info(path)
    try:
        metadata = HuggingFaceStorageReader(str(directory)).read_metadata()
    except Exception as err:  # noqa: BLE001
        raise CheckpointCorruptError(f"{directory}: the per-rank safetensors files cannot be assembled ({err})") from None
    for name, meta in metadata.state_dict_metadata.items():
        covered = sum(math.prod(chunk.sizes) for chunk in meta.chunks)
        if covered != math.prod(meta.size) or not _disjoint(meta.chunks):
            raise CheckpointError(
                f"{directory}: the slices of {name!r} in the per-rank files ({len(files)} found: {files[0].name}, ...) cover "
                f"{covered} of its {math.prod(meta.size)} elements {list(meta.size)}: a rank's file is missing or repeated")
    return metadata


def _disjoint(chunks) -> bool:
    """No two non-empty chunks (boxes ``[offset, offset + size)`` per dimension) overlap."""
    boxes = [[(o, o + s) for o, s in zip(c.offsets, c.sizes)] for c in chunks if math.prod(c.sizes) > 0]

    def overlap(p, q) -> bool:
        return all(a0 < b1 and b0 < a1 for (a0, a1), (b0, b1) in zip(p, q))

    return not any(overlap(p, q) for i, p in enumerate(boxes) for q in boxes[i + 1:])


def read_shards(directory: Path, files: tuple[Path, ...]) -> dict[str, torch.Tensor]:
    """Each tensor of the per-rank files, assembled whole (:func:`shards_metadata`).

    Raises:
        CheckpointError, CheckpointCorruptError: as :func:`shards_metadata` and :func:`load_dcp`.
    """
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    return load_dcp(directory, shards_metadata(directory, files), HuggingFaceStorageReader(str(directory)))
