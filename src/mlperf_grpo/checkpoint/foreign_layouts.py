"""Checkpoint series written by other trainers, as one kind of record.

Two layouts besides our own (``format.py``):

- **NeMo-RL** (``nemo_rl/utils/checkpoint.py``, ``nemo_rl/algorithms/grpo.py``): a
  ``step_N/`` per checkpoint, published by renaming ``tmp_step_N/``::

      step_N/training_info.json   current_step, consumed_samples (prompts),
                                  training_step_end_time_ms (Unix ms), ...
      step_N/config.yaml
      step_N/policy/weights/      the model: a torch distributed checkpoint (DCP, their
                                  default): ``.metadata`` + ``*.distcp``, either here
                                  (DTensor v1: the state dict nested under ``"model"``)
                                  or in ``model/`` (v2: flat, Hugging Face names); or
                                  Hugging Face safetensors (``model_save_format:
                                  safetensors``), in ``model/consolidated/``, ``model/``
                                  or here; in ``model/`` possibly one file per rank
                                  (Automodel's sharded save), assembled whole; or, from
                                  the Megatron backend (the benchmark reference's), a
                                  Megatron-Bridge save root whose ``iter_*/`` is a
                                  Megatron-core ``torch_dist`` checkpoint of Megatron-named
                                  tensors (``megatron_layout.py``, names mapped with
                                  ``megatron_names.py`` and model.path's ``config.json``)
      step_N/policy/tokenizer/

- **Hugging Face directories plus a manifest** (any other trainer): ``manifest.jsonl``,
  one JSON object per checkpoint: ``step``, ``path`` (a Hugging Face model directory,
  relative to the manifest's folder or absolute), ``training_step_end_time_ms``. Its
  weights are exactly the files its ``model.safetensors.index.json`` names (``hf_index``).

Each becomes a :class:`ForeignCheckpoint`. What these layouts do not record (weight
hashes, the canary logits, the trainer's non-weight file fingerprints) is listed in
``unchecked`` and reported, never invented. DCP weights and per-rank safetensors are
read with ``torch.distributed.checkpoint.load(no_dist=True)`` (``dcp_read.py``): no
process group.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from mlperf_grpo.checkpoint import dcp_read, hf_index, megatron_layout
from mlperf_grpo.checkpoint.format import INDEX_FILE, INFO_FILE, NON_WEIGHT_FILES, SAFETENSORS_DTYPES
from mlperf_grpo.checkpoint.format import CheckpointCorruptError, CheckpointError
from mlperf_grpo.checkpoint.reader import read_json_record

NEMO_RL = "nemo-rl"
HF_DIRS = "hf-dirs"
OURS = "ours"
FORMATS = (OURS, NEMO_RL, HF_DIRS)
MANIFEST_FILE = "manifest.jsonl"
DCP_METADATA = dcp_read.DCP_METADATA
_STEP_DIR = re.compile(r"^step_(\d+)\Z")
_TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}

UNCHECKED = {
    NEMO_RL: ("weight file hashes (the layout records none)", "canary logits (the layout records none)",
              "tokenizer and model config files (the engine uses model.path's)"),
    HF_DIRS: ("weight file hashes (the manifest records none)", "canary logits (the manifest records none)",
              "tokenizer files (the engine uses model.path's)"),
}
"""What each layout cannot prove, reported to the user (the engine's tensors are still
compared with the tensors read, after every refit)."""


@dataclass(frozen=True)
class ForeignInfo:
    """The fields of a foreign checkpoint's record the evaluator uses.

    ``samples_count``: completions, ``step * global_batch_size`` (the MLPerf meaning).
    ``consumed_samples``: prompts (NeMo-RL's meaning), None when not recorded.
    ``training_step_end_time_ms``: the weight-update time, Unix ms.
    """

    current_step: int
    samples_count: int
    training_step_end_time_ms: int
    consumed_samples: int | None = None


@dataclass(frozen=True)
class ForeignCheckpoint:
    """One checkpoint of a foreign series.

    ``path``: the checkpoint's directory (``step_N/`` or the Hugging Face directory);
    ``record``: the file its step and weight-update time were read from;
    ``weights_kind``: ``safetensors``, ``dcp`` or ``megatron``; ``weight_files``: the
    safetensors files, or the DCP directory (the one holding ``.metadata``); ``dcp_nested``: the DCP
    state dict is nested under ``"model"`` (NeMo-RL DTensor v1); ``config_dir``: a
    directory holding the checkpoint's ``config.json``, or None; ``hf_config``: the
    ``config.json`` Megatron names are mapped with (model.path's), or None.
    """

    step: int
    path: Path
    info: ForeignInfo
    record: Path
    weights_kind: str
    weight_files: tuple[Path, ...]
    dcp_nested: bool = False
    config_dir: Path | None = None
    hf_config: Path | None = None


def detect_format(root: Path) -> str:
    """``ours``, ``nemo-rl`` or ``hf-dirs`` from what ``root`` holds.

    Raises:
        CheckpointError: none of the three layouts is recognised; says what was looked for.
    """
    if root.is_file() or (root / MANIFEST_FILE).is_file():
        return HF_DIRS
    for entry in sorted(root.glob("step_*")) if root.is_dir() else []:
        if _STEP_DIR.match(entry.name) and entry.is_dir():
            if (entry / "policy" / "weights").is_dir():
                return NEMO_RL
            try:
                record = json.loads((entry / INFO_FILE).read_text())
            except (OSError, ValueError):
                record = None
            if isinstance(record, dict) and isinstance(record.get("weights"), dict):
                return OURS
    raise CheckpointError(
        f"{root}: no checkpoint layout recognised (looked for {MANIFEST_FILE}, step_N/policy/weights/ of NeMo-RL, "
        f"step_N/{INFO_FILE} of mlperf-grpo); pass --format"
    )


def _int_field(record: dict, name: str, where: str, *, required: bool = True) -> int | None:
    value = record.get(name)
    if value is None and not required:
        return None
    if name not in record:
        raise CheckpointError(f"{where}: field '{name}' is missing; the evaluator needs it "
                              f"({_WHY.get(name, 'see the README')})")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise CheckpointError(f"{where}: field '{name}' must be an integer, got {value!r}")
    return int(value)


_WHY = {
    "training_step_end_time_ms": "run_stop is backdated to this weight-update time, Unix ms",
    "current_step": "the step names the eval's samples_count",
    "step": "the step names the eval's samples_count",
}


# --------------------------------------------------------------------------- NeMo-RL

def _nemo_weights(step_dir: Path) -> tuple[str, tuple[Path, ...], bool]:
    """``(kind, files, nested)`` of ``step_N/policy/weights/`` (see the module docstring).

    Raises:
        CheckpointError: neither DCP metadata nor safetensors files found.
    """
    weights = step_dir / "policy" / "weights"
    iteration = megatron_layout.find_iteration_dir(weights) if weights.is_dir() else None
    if iteration is not None:
        return "megatron", (iteration,), False
    if (weights / DCP_METADATA).is_file():
        return "dcp", (weights,), True
    if (weights / "model" / DCP_METADATA).is_file():
        return "dcp", (weights / "model",), False
    for folder in (weights / "model" / "consolidated", weights / "model", weights):
        files = hf_index.weight_files(folder)
        if files:
            return "safetensors", files, False
    raise CheckpointError(f"{weights}: no model weights (neither a torch distributed checkpoint's {DCP_METADATA} "
                          "nor *.safetensors, here or in model/); the checkpoint is incomplete")


def read_nemo_rl_checkpoint(step_dir: Path, step: int, global_batch_size: int,
                            hf_config: Path | None = None) -> ForeignCheckpoint:
    """One NeMo-RL ``step_N/`` (``hf_config``: model.path's ``config.json``, which maps
    a Megatron checkpoint's names).

    Raises:
        CheckpointError: ``training_info.json`` missing, not JSON, or without an integer
            ``current_step`` or ``training_step_end_time_ms`` (names the file and field);
            no weights under ``policy/weights/``.
    """
    path = step_dir / INFO_FILE
    record = read_json_record(path)
    if not isinstance(record, dict):
        raise CheckpointError(f"{path}: must be a JSON object")
    info = ForeignInfo(
        current_step=_int_field(record, "current_step", str(path)),
        samples_count=step * global_batch_size,
        training_step_end_time_ms=_int_field(record, "training_step_end_time_ms", str(path)),
        consumed_samples=_int_field(record, "consumed_samples", str(path), required=False),
    )
    kind, files, nested = _nemo_weights(step_dir)
    config_dir = files[0].parent if kind == "safetensors" and (files[0].parent / "config.json").is_file() else None
    return ForeignCheckpoint(step, step_dir, info, path, kind, files, nested, config_dir, hf_config)


def discover_nemo_rl(root: Path, global_batch_size: int, hf_config: Path | None = None,
                     ) -> tuple[list[ForeignCheckpoint], list[Path], tuple[int, str] | None]:
    """NeMo-RL ``step_N/`` in ascending step order up to the first unreadable one; the
    same contract as :func:`mlperf_grpo.checkpoint.discover_series` (``tmp_step_*``
    listed apart, never read)."""
    ignored = sorted(p for p in root.glob("tmp_step_*")) if root.is_dir() else []
    dirs = sorted((int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else [])
                  if (m := _STEP_DIR.match(p.name)) and p.is_dir())
    found: list[ForeignCheckpoint] = []
    for step, path in dirs:
        try:
            found.append(read_nemo_rl_checkpoint(path, step, global_batch_size, hf_config))
        except CheckpointError as err:
            return found, ignored, (step, str(err))
    return found, ignored, None


# --------------------------------------------------------------------------- manifest

def read_manifest(manifest: Path, global_batch_size: int) -> list[ForeignCheckpoint]:
    """The checkpoints a ``manifest.jsonl`` lists, in ascending step order.

    Raises:
        CheckpointError: the manifest is unreadable, a line is not a JSON object, lacks
            ``step``, ``path`` or ``training_step_end_time_ms`` (names the line and field),
            repeats a step, or names a directory without ``*.safetensors``; the
            directory's index names a missing file or not every file
            (:func:`hf_index.weight_files`).
    """
    try:
        lines = manifest.read_text().splitlines()
    except OSError as err:
        raise CheckpointError(f"cannot read the manifest {manifest}: {err.strerror}") from None
    found: dict[int, ForeignCheckpoint] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{manifest}:{number}"
        try:
            record = json.loads(line)
        except ValueError as err:
            raise CheckpointError(f"{where}: not valid JSON ({err}); each line must be one JSON object") from None
        if not isinstance(record, dict):
            raise CheckpointError(f"{where}: a line must be a JSON object")
        step = _int_field(record, "step", where)
        t_update = _int_field(record, "training_step_end_time_ms", where)
        if not isinstance(record.get("path"), str) or not record["path"]:
            raise CheckpointError(f"{where}: field 'path' is missing or not a string; it names the checkpoint's "
                                  "Hugging Face model directory")
        if step in found:
            raise CheckpointError(f"{where}: step {step} is listed twice")
        directory = (manifest.parent / record["path"]).resolve()
        try:
            files = hf_index.weight_files(directory)
        except CheckpointError as err:
            raise CheckpointError(f"{where}: {err}") from None
        if not files:
            raise CheckpointError(f"{where}: {directory} holds no *.safetensors weights")
        info = ForeignInfo(current_step=step, samples_count=step * global_batch_size, training_step_end_time_ms=t_update)
        found[step] = ForeignCheckpoint(step, directory, info, manifest, "safetensors", files,
                                        config_dir=directory if (directory / "config.json").is_file() else None)
    if not found:
        raise CheckpointError(f"{manifest}: no checkpoints listed")
    return [found[s] for s in sorted(found)]


# --------------------------------------------------------------------------- reading

def tensor_specs(checkpoint: ForeignCheckpoint) -> dict[str, tuple[str, list[int]]]:
    """Tensor name -> (torch dtype name, e.g. ``float32``; shape), from safetensors
    headers or DCP metadata only (so the layouts compare equal; per-rank safetensors
    give each tensor's whole shape, assembled from the slices' offsets).

    Raises:
        CheckpointError: a header or the DCP metadata cannot be read, per-rank slices
            do not cover a tensor, or whole tensors are not where the folder's index puts
            them, or are stored twice (:func:`hf_index.check_placement`); names the file.
    """
    if checkpoint.weights_kind == "megatron":
        return megatron(checkpoint).specs()
    if checkpoint.weights_kind == "dcp":
        return _specs(dcp_read.read_dcp_metadata(checkpoint.weight_files[0]), checkpoint.dcp_nested)
    if _per_rank(checkpoint):
        return _specs(dcp_read.shards_metadata(checkpoint.weight_files[0].parent, checkpoint.weight_files), False)
    from safetensors import safe_open

    specs: dict[str, tuple[str, list[int]]] = {}
    names_by_file: dict[Path, list[str]] = {}
    for path in checkpoint.weight_files:
        try:
            with safe_open(str(path), framework="pt") as f:
                names_by_file[path] = list(f.keys())
                for name in names_by_file[path]:
                    sl = f.get_slice(name)
                    dtype = _TORCH_DTYPES.get(sl.get_dtype())
                    specs[name] = (str(dtype).removeprefix("torch.") if dtype else sl.get_dtype(), list(sl.get_shape()))
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing; the checkpoint is incomplete") from None
        except Exception as err:  # noqa: BLE001  (safetensors raises several types)
            raise CheckpointError(f"{path}: not a readable safetensors file ({err}); the checkpoint is corrupt") from None
    hf_index.check_placement(checkpoint.weight_files[0].parent, names_by_file, whole=True)
    return specs


def _specs(metadata, nested: bool) -> dict[str, tuple[str, list[int]]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {_dcp_name(key, nested): (str(meta.properties.dtype).removeprefix("torch."), list(meta.size))
            for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)}


def megatron(checkpoint: ForeignCheckpoint) -> megatron_layout.MegatronCheckpoint:
    """The checked Megatron dist checkpoint of a ``megatron`` checkpoint (errors as
    :func:`megatron_layout.open_checkpoint`)."""
    return megatron_layout.open_checkpoint(checkpoint.weight_files[0], checkpoint.step, checkpoint.hf_config)


def _per_rank(checkpoint: ForeignCheckpoint) -> bool:
    """Safetensors written one file per rank (slices placed by ``DCP_SHARDING_INFO``)."""
    return checkpoint.weights_kind == "safetensors" and dcp_read.sharding_info(checkpoint.weight_files[0]) is not None


def _dcp_name(key: str, nested: bool) -> str:
    return key.removeprefix("model.") if nested else key


def read_weights(checkpoint: ForeignCheckpoint) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as a CPU state dict (Hugging Face names).

    DCP: every data file is checked against the metadata first (present, long enough,
    each record's CRC-32: :func:`dcp_read.check_dcp_files`), then the tensors are
    allocated from the metadata and filled by ``torch.distributed.checkpoint.load(...,
    no_dist=True)`` (no process group). Per-rank safetensors are assembled whole
    (:func:`dcp_read.read_shards`).

    Raises:
        CheckpointError: a weight file is missing (names it).
        CheckpointCorruptError: a weight file is truncated, fails its CRC-32 or cannot
            be parsed; names it.
    """
    if checkpoint.weights_kind == "megatron":
        return megatron_layout.read_weights(megatron(checkpoint))
    if checkpoint.weights_kind == "dcp":
        directory = checkpoint.weight_files[0]
        metadata = dcp_read.read_dcp_metadata(directory)
        dcp_read.check_dcp_files(directory, metadata)
        return {_dcp_name(key, checkpoint.dcp_nested): t for key, t in dcp_read.load_dcp(directory, metadata).items()}
    if _per_rank(checkpoint):
        return dcp_read.read_shards(checkpoint.weight_files[0].parent, checkpoint.weight_files)
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint.weight_files:
        try:
            tensors.update(load_file(str(path)))
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing; the checkpoint is incomplete") from None
        except Exception as err:  # noqa: BLE001
            raise CheckpointCorruptError(f"{path}: not valid safetensors ({err})") from None
    return tensors


_CHECKPOINT_DIR = re.compile(r"^(tmp_)?step_\d+\Z")
_WRITER_FILE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
"""Shard names our writer gives (``format.shard_name``), and transformers' single-file name."""


def _written_by_us(name: str) -> bool:
    return name in (INFO_FILE, INDEX_FILE, *NON_WEIGHT_FILES) or bool(_WRITER_FILE.match(name))


def remove_step_dirs(root: Path) -> str:
    """Teardown of our trainer's series kept in ``root`` among other files (``evaluate
    --checkpoints DIR --format ours``): in each ``step_N/`` and ``tmp_step_N/`` directly
    under ``root``, delete the files our checkpoint writer names (``training_info.json``,
    the shards, the index, :data:`~mlperf_grpo.checkpoint.format.NON_WEIGHT_FILES`), then
    the directory once it is empty. Nothing else is touched: no file or folder outside
    those directories, no subfolder, no file of another name.

    Returns:
        One line saying what was deleted, and what was kept because it is not ours.
    Raises:
        OSError: a file cannot be deleted (what was deleted before it stays deleted).
    """
    deleted, kept = [], []
    entries = [e for e in (root.iterdir() if root.is_dir() else []) if _CHECKPOINT_DIR.match(e.name)]
    for entry in sorted(entries, key=lambda e: (e.name.startswith("tmp_"), int(e.name.rsplit("_", 1)[1]))):
        if not entry.is_dir() or entry.is_symlink():
            continue
        for item in sorted(entry.iterdir()):
            if item.is_file() and not item.is_symlink() and _written_by_us(item.name):
                item.unlink()
            else:
                kept.append(f"{entry.name}/{item.name}")
        if not any(entry.iterdir()):
            entry.rmdir()
        deleted.append(entry.name)
    line = f"note: teardown deleted the checkpoint files of {', '.join(deleted) or 'no checkpoint'} in {root}"
    return line + (f"; kept what our trainer does not write: {', '.join(kept)}" if kept else "")
