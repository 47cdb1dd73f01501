"""The on-disk checkpoint layout and its ``training_info.json`` record.

One published checkpoint is a complete Hugging Face model directory (NeMo-RL's
``step_N/training_info.json`` added), so ``AutoModelForCausalLM.from_pretrained(step_N)``
and vLLM load it as it is::

    <run>/checkpoints/step_N/
        config.json  generation_config.json  tokenizer*.json ...   copied from the model
        model-00001-of-0000n.safetensors ...                       rollout-dtype weights
        model.safetensors.index.json                               transformers' index
        training_info.json                                         our record (below)
    <run>/checkpoints/training_end.json   written once when training ends (not on SIGKILL)

A checkpoint is written under ``tmp_step_N/``, every file fsynced, then renamed to
``step_N/`` in step order: a ``step_N/`` is always complete, a ``tmp_step_N/`` is never
read as a checkpoint.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import xxhash

from mlperf_grpo.errors import CheckpointError

INFO_FILE = "training_info.json"
INDEX_FILE = "model.safetensors.index.json"
"""transformers' ``SAFE_WEIGHTS_INDEX_NAME``."""
END_FILE = "training_end.json"
SHARD_PATTERN = "model-{index:05d}-of-{count:05d}.safetensors"
HASH_ALGORITHM = "xxh3_128"
"""Hash of weight shards and non-weight files (``xxhash.xxh3_128``, hex digest)."""

NON_WEIGHT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)
"""Files outside the weights that change what the engine generates or how answers are
read (model config, generation config, tokenizer, special tokens, chat template): copied
into every checkpoint and fingerprinted in ``training_info.json`` (issue 8, part 2)."""

SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float64: "F64",
}


class CheckpointCorruptError(CheckpointError):
    """A weight shard's bytes differ from the hash recorded when it was written."""


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
    ``dtype``: the rollout dtype of every stored tensor.
    ``weights``: ``{"hash_algorithm": "xxh3_128", "shards": {file: {"hash": hex,
    "bytes": size}}, "tensors": hex, "fingerprint": {"algorithm": name, "digest": hex}}``;
    ``tensors`` is :func:`tensor_specs_digest` of every stored tensor's name, dtype and
    shape (checked against the shard headers); ``fingerprint`` is
    :func:`mlperf_grpo.model.fingerprint.weights_fingerprint` of the stored tensors (what an
    engine must hold after a refit; absent in checkpoints written before it existed).
    ``files``: non-weight file name -> ``{"hash": hex, "bytes": size}`` (same algorithm),
    as the model directory held them when training started.
    ``canary_logits`` are the rollout engine's logits on the canary input with these
    weights (see model/fingerprint.py), which the evaluator's engine must reproduce.
    ``evaluation``: the settings that decide what evaluating it measures
    (``mlperf_grpo.evaluate.settings.evaluation_settings``: config key -> value); the
    evaluator's config must give the same (empty in checkpoints written before it existed).
    """

    current_step: int
    consumed_samples: int
    training_step_end_time_ms: int
    samples_count: int
    global_batch_size: int
    num_generations_per_prompt: int
    dtype: str
    canary_logits: list
    weights: dict = field(default_factory=dict)
    files: dict = field(default_factory=dict)
    evaluation: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def new_hasher() -> "xxhash.xxh3_128":
    """A streaming hasher of :data:`HASH_ALGORITHM` (releases the GIL on large inputs)."""
    return xxhash.xxh3_128()


def hash_bytes(data: bytes | memoryview) -> str:
    """Hex :data:`HASH_ALGORITHM` digest of ``data``."""
    return xxhash.xxh3_128_hexdigest(data)


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks (provenance records, not checkpoints)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def default_max_shard_size() -> int | str:
    """transformers' own default ``max_shard_size`` of ``save_pretrained`` (``"50GB"``
    in transformers 5, ``"5GB"`` in 4), read from the installed version."""
    from transformers import PreTrainedModel

    return inspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"].default


def shard_name(index: int, count: int) -> str:
    """``model-0000k-of-0000n.safetensors`` (1-based ``index``), transformers' naming."""
    return SHARD_PATTERN.format(index=index, count=count)


def tensor_specs_digest(specs: dict[str, tuple[str, list[int]]]) -> str:
    """Hex sha256 over ``name|dtype|shape`` of every tensor, in name order; ``specs`` maps
    name -> (safetensors dtype name, shape)."""
    digest = hashlib.sha256()
    for name in sorted(specs):
        dtype, shape = specs[name]
        digest.update(f"{name}|{dtype}|{list(shape)}\n".encode())
    return digest.hexdigest()


def safetensors_header(tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str], alignment_bytes: int = 8) -> bytes:
    """The header of a safetensors file holding ``tensors`` in the given order:
    8-byte little-endian length, then JSON padded with spaces (the format's
    specification allows trailing spaces, https://github.com/huggingface/safetensors#format)
    so that the whole header, and so the tensors' bytes that follow it back to back,
    ends at a multiple of ``alignment_bytes`` (a multiple of 8). Written by hand so the
    writer stages each shard's file image in place and writes (and hashes) it without
    the full extra copy ``safetensors.torch.save`` makes."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors:
        size = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % alignment_bytes)
    return len(text).to_bytes(8, "little") + text


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True)
class TrainingEnd:
    """``checkpoints/training_end.json``: written by the trainer when training ends in
    any way it can handle (finished, SIGTERM, Ctrl-C, a failed write), after every
    in-flight checkpoint was published or discarded. Absent after a SIGKILL.

    ``last_published_step``: the last ``step_N/`` the trainer published (``None``: none);
    the evaluator requires the series to reach it, so deleted checkpoints are not read
    as a shorter run. ``max_in_flight``: the K of that run.
    """

    last_published_step: int | None
    max_in_flight: int
    reason: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"
