"""Reading deferred checkpoints: discovery, cheap series checks, verified reads.

- :func:`discover_checkpoints`: the published ``step_N/`` in step order (``tmp_step_*``
  listed apart, never read).
- :func:`tensor_specs`: names, dtypes and shapes from the safetensors headers only.
- :func:`check_model_files`: the non-weight files fingerprinted at training time against
  a directory (the checkpoint's copies, or the model the evaluator's engine loads).
- :func:`read_weights`: each shard's bytes read once, hashed, and parsed by
  ``safetensors.torch.load`` from those same bytes (verification costs no extra pass).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from mlperf_grpo.checkpoint.format import (
    END_FILE,
    HASH_ALGORITHM,
    INDEX_FILE,
    INFO_FILE,
    NON_WEIGHT_FILES,
    CheckpointCorruptError,
    CheckpointError,
    TrainingEnd,
    TrainingInfo,
    hash_bytes,
    tensor_specs_digest,
)

_STEP_DIR = re.compile(r"^step_(\d+)$")


def read_training_info(directory: Path) -> TrainingInfo:
    """Parse ``directory/training_info.json``.

    Raises:
        CheckpointError: missing, not JSON, or with missing/extra/mistyped fields.
    """
    path = directory / INFO_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is not readable JSON: {err}") from None
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
        match = _STEP_DIR.match(entry.name)
        if entry.name.startswith("tmp_step_"):
            ignored.append(entry)
        elif match and entry.is_dir():
            dirs.append((int(match.group(1)), entry))
    found: list[Checkpoint] = []
    for step, path in sorted(dirs):
        try:
            found.append(Checkpoint(step=step, path=path, info=read_training_info(path)))
        except CheckpointError as err:
            return found, ignored, (step, str(err))
    return found, ignored, None


def published_steps(checkpoint_root: Path) -> list[int]:
    """Steps of the published ``step_N/`` directories under the root, ascending (names
    only: a ``tmp_step_N/`` is unfinished and not counted)."""
    if not checkpoint_root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in checkpoint_root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())


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


def read_weights(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """The checkpoint's weights as a CPU state dict, verified as they are read: each
    shard's bytes are read once, hashed, and parsed from the same bytes.

    Raises:
        CheckpointCorruptError: a shard's hash or size differs from ``training_info.json``,
            or it does not parse; names the file.
        CheckpointError: a shard is missing.
    """
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint.shard_paths():
        expected = checkpoint.info.weights["shards"][path.name]
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing; the checkpoint is incomplete") from None
        if len(data) != expected.get("bytes") or hash_bytes(data) != expected.get("hash"):
            raise CheckpointCorruptError(
                f"{checkpoint.path.name}/{path.name}: {HASH_ALGORITHM} differs from {INFO_FILE}; the checkpoint is corrupt"
            )
        try:
            tensors.update(load_safetensors(data))
        except SafetensorError as err:
            raise CheckpointCorruptError(f"{checkpoint.path.name}/{path.name}: not valid safetensors ({err})") from None
    return tensors


def remove_checkpoints(checkpoint_root: Path) -> None:
    """Teardown: delete every ``step_*`` and ``tmp_step_*`` directory under the root."""
    if checkpoint_root.is_dir():
        shutil.rmtree(checkpoint_root)
