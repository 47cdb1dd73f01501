"""Reading deferred checkpoints: discovery, cheap series checks, verified reads.

- :func:`discover_checkpoints`: the published ``step_N/`` in step order (``tmp_step_*``
  listed apart, never read).
- :func:`tensor_specs`: names, dtypes and shapes from the safetensors headers only.
- :func:`check_model_files`: the non-weight files fingerprinted at training time against
  a directory (the checkpoint's copies, or the model the evaluator's engine loads).
- :func:`read_verified`: each shard's bytes read once into a reusable (pinned) host
  buffer, hashed from that memory while the next chunk is read, and viewed as tensors
  by the safetensors header (verification costs no extra pass, parsing no copy);
  :func:`read_weights` is the same into fresh memory.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from mlperf_grpo.checkpoint.format import (
    END_FILE,
    HASH_ALGORITHM,
    INDEX_FILE,
    INFO_FILE,
    NON_WEIGHT_FILES,
    SAFETENSORS_DTYPES,
    CheckpointCorruptError,
    CheckpointError,
    TrainingEnd,
    TrainingInfo,
    hash_bytes,
    new_hasher,
    tensor_specs_digest,
)
from mlperf_grpo.checkpoint.host_memory import page_locked_empty
from mlperf_grpo.step_dirs import CHECKPOINT_DIR, TMP_PREFIX, step_of


def read_json_record(path: Path) -> object:
    """The parsed JSON of a checkpoint's record file (``training_info.json``, ours or
    NeMo-RL's).

    Raises:
        CheckpointError: the file is missing (the checkpoint is incomplete) or not JSON.
    """
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is not readable JSON: {err}") from None


def read_training_info(directory: Path) -> TrainingInfo:
    """Parse ``directory/training_info.json``.

    Raises:
        CheckpointError: missing, not JSON, or with missing/extra/mistyped fields.
    """
    path = directory / INFO_FILE
    data = read_json_record(path)
    try:
        info = TrainingInfo(**data)
    except TypeError as err:
        raise CheckpointError(f"{path} has the wrong fields: {err}") from None
    for name in ("current_step", "training_step_end_time_ms", "samples_count", "global_batch_size"):
        value = getattr(info, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise CheckpointError(f"{path}: field '{name}' must be an integer, got {value!r}")
    weights = info.weights
    if (
        not isinstance(weights, dict)
        or weights.get("hash_algorithm") != HASH_ALGORITHM
        or not isinstance(weights.get("shards"), dict)
        or not weights["shards"]
        or not isinstance(info.files, dict)
    ):
        raise CheckpointError(f"{path}: field 'weights' must list the shards with their {HASH_ALGORITHM} hashes")
    if not isinstance(info.evaluation, dict):
        raise CheckpointError(f"{path}: field 'evaluation' must map each evaluation setting to its value")
    return info


@dataclass(frozen=True)
class Checkpoint:
    """A published ``step_N/`` directory and its record."""

    step: int
    path: Path
    info: TrainingInfo

    def shard_paths(self) -> list[Path]:
        """The weight shard files, in the order recorded."""
        return [self.path / name for name in self.info.weights["shards"]]


def discover_series(checkpoint_root: Path) -> tuple[list[Checkpoint], list[Path], tuple[int, str] | None]:
    """Published checkpoints in ascending step order up to the first unreadable one.

    Returns:
        ``(checkpoints, ignored, unreadable)``: the readable ``step_N/`` before the first
        whose ``training_info.json`` is missing or malformed, the ignored ``tmp_step_*``
        dirs, and ``(step, message)`` of that first unreadable checkpoint (or ``None``).
    """
    if not checkpoint_root.is_dir():
        return [], [], None
    ignored: list[Path] = []
    dirs: list[tuple[int, Path]] = []
    for entry in sorted(checkpoint_root.iterdir()):
        step = step_of(entry.name)
        if entry.name.startswith(TMP_PREFIX):
            ignored.append(entry)
        elif step is not None and entry.is_dir():
            dirs.append((step, entry))
    found: list[Checkpoint] = []
    for step, path in sorted(dirs):
        try:
            found.append(Checkpoint(step=step, path=path, info=read_training_info(path)))
        except CheckpointError as err:
            return found, ignored, (step, str(err))
    return found, ignored, None


def discover_checkpoints(checkpoint_root: Path) -> tuple[list[Checkpoint], list[Path]]:
    """Published checkpoints in ascending step order, and ignored ``tmp_step_*`` dirs.

    Raises:
        CheckpointError: a ``step_N/`` has a missing or malformed ``training_info.json``.
    """
    found, ignored, unreadable = discover_series(checkpoint_root)
    if unreadable is not None:
        raise CheckpointError(unreadable[1])
    return found, ignored


def read_training_end(checkpoint_root: Path) -> TrainingEnd | None:
    """``training_end.json`` (``None`` when training was killed before writing it).

    Raises:
        CheckpointError: present but unreadable or malformed.
    """
    path = checkpoint_root / END_FILE
    if not path.exists():
        return None
    try:
        return TrainingEnd(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as err:
        raise CheckpointError(f"{path} is not a valid end-of-training record: {err}") from None


def _read_header(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if size <= 0 or size > path.stat().st_size:
                raise ValueError("bad header length")
            header = json.loads(f.read(size))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors header ({err}); the checkpoint is corrupt") from None
    return header


def tensor_specs(checkpoint: Checkpoint) -> dict[str, tuple[str, list[int]]]:
    """Tensor name -> (safetensors dtype, shape), from the shard headers only, checked
    against the index and ``training_info.json`` (same shards, same tensor digest).

    Raises:
        CheckpointError: names the checkpoint and what disagrees.
    """
    name = checkpoint.path.name
    try:
        index = json.loads((checkpoint.path / INDEX_FILE).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{name}/{INDEX_FILE} is missing or malformed ({err}); the checkpoint is incomplete") from None
    if set(index.values()) != set(checkpoint.info.weights["shards"]):
        raise CheckpointError(f"{name}: the shards in {INDEX_FILE} differ from those in {INFO_FILE}")
    specs: dict[str, tuple[str, list[int]]] = {}
    for path in checkpoint.shard_paths():
        for tensor, meta in _read_header(path).items():
            if tensor == "__metadata__":
                continue
            if index.get(tensor) != path.name:
                raise CheckpointError(f"{name}: tensor {tensor!r} in {path.name} is not in {INDEX_FILE} for that shard")
            specs[tensor] = (meta.get("dtype"), list(meta.get("shape", [])))
    if set(specs) != set(index):
        missing = sorted(set(index) - set(specs))
        raise CheckpointError(f"{name}: tensors listed in {INDEX_FILE} are missing from the shards: {missing[:3]}")
    if tensor_specs_digest(specs) != checkpoint.info.weights.get("tensors"):
        raise CheckpointError(f"{name}: tensor names, shapes or dtypes differ from those recorded in {INFO_FILE}")
    return specs


def check_same_tensors(checkpoints: list[Checkpoint]) -> None:
    """Every checkpoint holds the same tensor names, shapes and dtypes as the first one
    (headers only: milliseconds for any size).

    Raises:
        CheckpointError: names the first checkpoint that differs and one differing tensor.
    """
    if not checkpoints:
        return
    first = tensor_specs(checkpoints[0])
    for c in checkpoints[1:]:
        specs = tensor_specs(c)
        if specs == first:
            continue
        differing = sorted(set(specs) ^ set(first)) or sorted(n for n in specs if specs[n] != first[n])
        raise CheckpointError(
            f"{c.path.name}: tensor names, shapes or dtypes differ from {checkpoints[0].path.name} "
            f"(first difference: {differing[0]!r})"
        )


def check_model_files(recorded: dict[str, dict], directory: Path, what: str) -> None:
    """The non-weight files in ``directory`` are those fingerprinted at training time.

    Args:
        recorded: ``training_info.json``'s ``files``.
        directory: where the files are read from; ``what`` names it in messages.
    Raises:
        CheckpointError: a file was changed, added or removed; names the file.
    """
    present = {n for n in NON_WEIGHT_FILES if (directory / n).is_file()}
    for name in sorted(present | set(recorded)):
        if name not in present:
            raise CheckpointError(f"{what}: {directory / name} was present at training time and is missing now")
        if name not in recorded:
            raise CheckpointError(f"{what}: {directory / name} was added after training; it would change what is evaluated")
        if hash_bytes((directory / name).read_bytes()) != recorded[name].get("hash"):
            raise CheckpointError(
                f"{what}: {directory / name} differs from the file the checkpoints were trained with "
                f"({HASH_ALGORITHM} in {INFO_FILE}); restore it, or evaluate with the model directory used for training"
            )


READ_CHUNK_BYTES = 64 << 20
"""Bytes per ``readinto`` of a shard; each chunk is hashed while the next one is read."""

_SAFETENSORS_TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


class ReadBuffers:
    """Reusable host memory for the shards of one checkpoint: one uint8 buffer per shard
    file name, grown when a shard is larger, page-locked when ``pin``
    (:func:`~mlperf_grpo.checkpoint.host_memory.page_locked_empty`: a device copy from it
    is a DMA that needs no staging copy). Reading a series of equal-sized checkpoints
    allocates once; the tensors of :func:`read_verified` are views into these buffers and
    stay valid until the next read into the same buffers."""

    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, size_bytes: int, pin: bool | None = None) -> torch.Tensor:
        """A uint8 buffer of exactly ``size_bytes`` for shard ``name`` (or another use's
        key); page-locked when ``pin`` (default: the set's ``pin``)."""
        if name not in self._buffers or self._buffers[name].numel() < size_bytes:
            self._buffers.pop(name, None)  # the old one is freed before the new one is allocated
            buffer = page_locked_empty(size_bytes) if (self.pin if pin is None else pin) else torch.empty(size_bytes, dtype=torch.uint8)
            self._buffers[name] = buffer
        return self._buffers[name][:size_bytes]

    def allocated(self) -> dict[str, int]:
        """Key -> bytes of every buffer allocated so far (the host memory this set holds)."""
        return {name: buffer.numel() for name, buffer in self._buffers.items()}

    def reserve(self, checkpoint: Checkpoint) -> None:
        """Allocate (and pin) now the buffers a read of ``checkpoint`` needs, at the
        shard sizes ``training_info.json`` records, so the read allocates nothing.
        Page-locking takes time (on an H200 host, 2.8 GB: 0.19 s) and may hold up the
        device work of other threads meanwhile: done ahead, it stays out of a refit. A shard whose
        file is missing or differs in size from the record gets nothing here (an absurd
        recorded size allocates nothing): the read reports it as :func:`read_verified` does."""
        for name, shard in checkpoint.info.weights["shards"].items():
            try:
                size = (checkpoint.path / name).stat().st_size
            except OSError:
                continue
            if size == shard.get("bytes"):
                self.get(name, size)


class ReadStopped(Exception):
    """A read given up at a chunk boundary because its ``stop`` event was set (its reader
    is closing); nothing it read may be used."""


def read_verified(checkpoint: Checkpoint, buffers: ReadBuffers, stop: threading.Event | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's weights (name -> tensor, views into ``buffers``), each shard read
    once into its buffer and hashed (:data:`HASH_ALGORITHM`) from the same memory while
    the next chunk is read; the tensors come from the safetensors header of the verified
    bytes (no parse copy). Give the views to a device with ``copy_``/``to``. ``stop``:
    checked before each chunk of :data:`READ_CHUNK_BYTES`.

    Raises:
        ReadStopped: ``stop`` was set.
        CheckpointCorruptError: a shard's size or hash differs from ``training_info.json``,
            or its verified bytes are not valid safetensors; names the file.
        CheckpointError: a shard is missing.
    """
    tensors: dict[str, torch.Tensor] = {}
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-read-hash") as hashing:
        for path in checkpoint.shard_paths():
            expected = checkpoint.info.weights["shards"][path.name]
            where = f"{checkpoint.path.name}/{path.name}"
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise CheckpointError(f"{path} is missing; the checkpoint is incomplete") from None
            if size != expected.get("bytes"):
                raise CheckpointCorruptError(f"{where}: {size} bytes, {INFO_FILE} recorded {expected.get('bytes')!r}; the checkpoint is corrupt")
            data = buffers.get(path.name, size)
            if _read_hashed(path, data, hashing, stop) != expected.get("hash"):
                raise CheckpointCorruptError(f"{where}: {HASH_ALGORITHM} differs from {INFO_FILE}; the checkpoint is corrupt")
            tensors.update(_tensor_views(data, where))
    return tensors


def _read_hashed(path: Path, data: torch.Tensor, hashing: ThreadPoolExecutor, stop: threading.Event | None) -> str:
    """Read the file into ``data`` (its exact size) chunk by chunk, hashing each chunk in
    ``hashing`` while the next is read (xxhash releases the interpreter lock); raise
    :class:`ReadStopped` before a chunk once ``stop`` is set."""
    view = memoryview(data.numpy())
    digest = new_hasher()
    pending = None
    with open(path, "rb", buffering=0) as f:
        offset = 0
        while offset < len(view):
            if stop is not None and stop.is_set():
                if pending is not None:
                    pending.result()
                raise ReadStopped(f"{path}: read stopped")
            got = f.readinto(view[offset: offset + READ_CHUNK_BYTES])
            if not got:
                raise CheckpointCorruptError(f"{path}: shorter than its size while read; was it changed during evaluation?")
            if pending is not None:
                pending.result()
            pending = hashing.submit(digest.update, view[offset: offset + got])
            offset += got
    if pending is not None:
        pending.result()
    return digest.hexdigest()


def header_entries(header: dict, base: int, file_bytes: int) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """Tensor name -> ``(dtype, shape, start, end)`` (byte offsets in the file) of a
    parsed safetensors header whose data starts at byte ``base`` of a file of
    ``file_bytes``, each checked to lie in the file with the size of its shape.

    Raises:
        ValueError, KeyError, TypeError: the header is not valid safetensors.
    """
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_TORCH_DTYPES[meta["dtype"]]
        start, end = (base + int(o) for o in meta["data_offsets"])
        shape = [int(d) for d in meta["shape"]]
        if not base <= start <= end <= file_bytes or end - start != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {name!r} lies outside the file or has the wrong size")
        out[name] = (dtype, shape, start, end)
    return out


def _tensor_views(data: torch.Tensor, where: str) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file held in ``data`` (uint8), as views where aligned
    (the format's specification, https://github.com/huggingface/safetensors#format)."""
    try:
        size = int.from_bytes(bytes(data[:8].numpy()), "little")
        header = json.loads(bytes(data[8: 8 + size].numpy()))
        out = {}
        for name, (dtype, shape, start, end) in header_entries(header, 8 + size, data.numel()).items():
            raw = data[start:end]
            if start % dtype.itemsize:
                raw = raw.clone()  # views of a wider dtype need an aligned start
            out[name] = raw.view(dtype).view(shape)
        return out
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointCorruptError(f"{where}: not valid safetensors ({err})") from None


def read_weights(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """The checkpoint's weights as a CPU state dict in fresh memory, verified as read
    (:func:`read_verified`).

    Raises:
        CheckpointCorruptError, CheckpointError: as :func:`read_verified`.
    """
    return read_verified(checkpoint, ReadBuffers())


def remove_checkpoints(checkpoint_root: Path) -> None:
    """Teardown of our own run: delete every ``step_N/`` and ``tmp_step_N/`` directory
    and ``training_end.json`` under the root, then the root itself if nothing else is in
    it; anything else a user or another command put there (e.g. the ``eval/`` results of
    an ``evaluate --checkpoints`` of this folder) stays."""
    if not checkpoint_root.is_dir():
        return
    for entry in checkpoint_root.iterdir():
        if entry.is_dir() and not entry.is_symlink() and CHECKPOINT_DIR.match(entry.name):
            shutil.rmtree(entry)
    (checkpoint_root / END_FILE).unlink(missing_ok=True)
    if not any(checkpoint_root.iterdir()):
        checkpoint_root.rmdir()
