"""Deferred checkpoints: weights-only safetensors plus ``training_info.json``.

Layout (NeMo-RL's, with our own fields added)::

    <run>/checkpoints/step_N/model.safetensors
    <run>/checkpoints/step_N/training_info.json

A checkpoint is written under ``tmp_step_N/``, every file fsynced, then renamed to
``step_N/`` and the parent directory fsynced: a ``step_N/`` is always complete, and a
``tmp_step_N/`` (a write that was interrupted) is never read as a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

WEIGHTS_FILE = "model.safetensors"
INFO_FILE = "training_info.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint or the checkpoint series is missing, incomplete or inconsistent."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (disk full, I/O error); the message names the path
    and the bytes the checkpoint needs. Published ``step_N/`` directories are untouched."""


@dataclass(frozen=True)
class TrainingInfo:
    """Contents of ``training_info.json``.

    ``consumed_samples`` counts prompts (NeMo-RL's meaning); ``samples_count`` counts
    completions (``step * global_batch_size``, the MLPerf meaning).
    ``training_step_end_time_ms`` is the weight-update time: Unix ms taken right after
    the optimizer step returned, before any refit or checkpoint write.
    ``weights`` maps file name -> ``{"sha256": hex, "bytes": size}``.
    ``canary_logits`` are the rollout engine's logits on the canary input with these
    weights (see fingerprint.py), which the evaluator's engine must reproduce.
    """

    current_step: int
    consumed_samples: int
    training_step_end_time_ms: int
    samples_count: int
    global_batch_size: int
    num_generations_per_prompt: int
    dtype: str
    weights: dict
    canary_logits: list


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks of ``chunk_bytes``."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _without_aliases(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop names that share storage with an earlier name (tied embeddings): safetensors
    refuses aliased tensors, and the engine re-ties them on load."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, tensor in state_dict.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().contiguous().cpu()
    return out


def step_dir(checkpoint_root: Path, step: int) -> Path:
    """``<checkpoint_root>/step_N``: where a published checkpoint of ``step`` lives."""
    return checkpoint_root / f"step_{step}"


def write_checkpoint(
    checkpoint_root: Path,
    state_dict: dict[str, torch.Tensor],
    info: TrainingInfo,
) -> Path:
    """Write ``step_N/`` atomically (tmp dir, fsync, rename) and return its path.

    Args:
        checkpoint_root: ``<run>/checkpoints``; created if missing.
        state_dict: the policy weights, already in the checkpoint dtype.
        info: the record to store; its ``weights`` field is filled in here.
    Raises:
        CheckpointWriteError: the write failed (e.g. ENOSPC); ``tmp_step_N/`` is removed
            as far as possible, and one left behind is never evaluated.
    """
    tensors = _without_aliases(state_dict)
    needed_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    tmp = checkpoint_root / f"tmp_step_{info.current_step}"
    try:
        return _write_and_publish(checkpoint_root, tmp, tensors, info)
    except (OSError, SafetensorError) as err:  # safetensors reports ENOSPC as SafetensorError
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(checkpoint_root).free if checkpoint_root.exists() else 0
        reason = getattr(err, "strerror", None) or str(err).removeprefix("Error while serializing: ")
        raise CheckpointWriteError(
            f"cannot write checkpoint {tmp}: {reason}; it needs about "
            f"{needed_bytes} bytes and {free} bytes are free"
        ) from None
    except BaseException:  # Ctrl-C or a stop signal mid-write: discard the partial checkpoint
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_and_publish(checkpoint_root: Path, tmp: Path, tensors: dict[str, torch.Tensor], info: TrainingInfo) -> Path:
    checkpoint_root.mkdir(parents=True, exist_ok=True)
    final = step_dir(checkpoint_root, info.current_step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    weights_path = tmp / WEIGHTS_FILE
    save_file(tensors, str(weights_path), metadata={"format": "pt"})
    _fsync_path(weights_path)
    record = asdict(info)
    record["weights"] = {WEIGHTS_FILE: {"sha256": sha256_file(weights_path), "bytes": weights_path.stat().st_size}}
    info_path = tmp / INFO_FILE
    with open(info_path, "w") as f:
        json.dump(record, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    _fsync_path(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_path(checkpoint_root)
    return final


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
    if not isinstance(info.weights, dict) or WEIGHTS_FILE not in info.weights:
        raise CheckpointError(f"{path}: field 'weights' must list {WEIGHTS_FILE} with its sha256")
    return info


@dataclass(frozen=True)
class Checkpoint:
    """A published ``step_N/`` directory and its record."""

    step: int
    path: Path
    info: TrainingInfo

    def load_weights(self) -> dict[str, torch.Tensor]:
        """The weights as a CPU state dict (no optimizer state exists to load)."""
        return load_file(str(self.path / WEIGHTS_FILE))


def discover_checkpoints(checkpoint_root: Path) -> tuple[list[Checkpoint], list[Path]]:
    """Published checkpoints in ascending step order, and ignored ``tmp_step_*`` dirs.

    Raises:
        CheckpointError: a ``step_N/`` has a missing or malformed ``training_info.json``.
    """
    if not checkpoint_root.is_dir():
        return [], []
    found: list[Checkpoint] = []
    ignored: list[Path] = []
    for entry in sorted(checkpoint_root.iterdir()):
        match = _STEP_DIR.match(entry.name)
        if entry.name.startswith("tmp_step_"):
            ignored.append(entry)
        elif match and entry.is_dir():
            found.append(Checkpoint(step=int(match.group(1)), path=entry, info=read_training_info(entry)))
    found.sort(key=lambda c: c.step)
    return found, ignored


def remove_checkpoints(checkpoint_root: Path) -> None:
    """Teardown: delete every ``step_*`` and ``tmp_step_*`` directory under the root."""
    if checkpoint_root.is_dir():
        shutil.rmtree(checkpoint_root)
