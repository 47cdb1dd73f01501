"""The reference's own policy checkpoints: a Megatron-core dist checkpoint, format
``torch_dist``, read without Megatron and without a process group.

NeMo-RL's Megatron backend saves ``step_N/policy/weights/`` through Megatron-Bridge
(``training/checkpointing.py``): ``latest_checkpointed_iteration.txt`` names
``iter_0000000/``, which Megatron-core's ``dist_checkpointing.save``
(``serialization.py``) fills with

- ``metadata.json``: ``{"sharded_backend": "torch_dist", ...}`` (``core.save_config``);
- ``.metadata`` + ``__<rank>_<k>.distcp``: a ``torch.distributed.checkpoint`` of the
  Megatron-named global tensors (``strategies/torch.py``, ``FileSystemWriterAsync``:
  one ``torch.save`` record per tensor chunk, so the CRC-32 check of ``dcp_read`` applies);
- the common (non-sharded) state: ``common.pt`` (``strategies/common.py``; Megatron-LM
  before PR #5160) or a ``common_state`` object inside the DCP (after it,
  ``serialization.load_common_state_dict``). Only its presence is checked: the weights
  do not need it, and it unpickles Megatron classes.

Optimizer state (``optimizer.*``), ``_extra_state`` and other objects are not read.
Tensor names go to Hugging Face's through ``megatron_names.py``, with model.path's
``config.json``. A ``.metadata`` written for another step (its ``checkpoint_id`` names a
``step_M/`` directory) is refused, as are missing or short data files and failed CRCs.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from mlperf_grpo.checkpoint import dcp_read
from mlperf_grpo.checkpoint import megatron_names as names
from mlperf_grpo.checkpoint.format import CheckpointError

METADATA_JSON = "metadata.json"
LATEST_ITERATION = "latest_checkpointed_iteration.txt"
COMMON_PT = "common.pt"
COMMON_STATE = "common_state"
_BATCH_BYTES = 1 << 30
"""Bytes of Megatron tensor blocks read per ``torch.distributed.checkpoint.load`` call."""

Block = tuple[tuple[int, ...], tuple[int, ...]]


def find_iteration_dir(weights: Path) -> Path | None:
    """The dist checkpoint directory under a Megatron-Bridge save root (``weights``
    itself when it holds ``metadata.json``; else the one ``latest_checkpointed_iteration.txt``
    names; else a single ``iter_*``); None when ``weights`` is not one.

    Raises:
        CheckpointError: the iteration file names a missing directory, or several
            ``iter_*`` without it.
    """
    if (weights / METADATA_JSON).is_file():
        return weights
    latest = weights / LATEST_ITERATION
    if latest.is_file():
        text = latest.read_text().strip()
        folder = weights / (text if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else text)
        if not (folder / METADATA_JSON).is_file():
            raise CheckpointError(f"{latest} names {folder.name}, which holds no {METADATA_JSON}; the checkpoint is incomplete")
        return folder
    found = sorted(p for p in weights.glob("iter_*") if (p / METADATA_JSON).is_file())
    if len(found) > 1:
        raise CheckpointError(f"{weights}: several iterations ({', '.join(p.name for p in found)}) and no {LATEST_ITERATION}")
    return found[0] if found else None


@dataclass(frozen=True)
class MegatronCheckpoint:
    """A checked ``torch_dist`` directory: its DCP metadata and the Hugging Face recipes."""

    directory: Path
    metadata: object
    recipes: dict[str, names.Recipe]
    dtypes: dict[str, torch.dtype]

    def specs(self) -> dict[str, tuple[str, list[int]]]:
        """Hugging Face name -> (dtype name, shape), as ``foreign_layouts.tensor_specs``."""
        return {n: (str(self.dtypes[r.pieces[0].key]).removeprefix("torch."), list(r.shape)) for n, r in self.recipes.items()}


def open_checkpoint(directory: Path, step: int | None, hf_config: Path | None) -> MegatronCheckpoint:
    """Checks ``directory`` (backend, common state, the step its ``.metadata`` was
    written for) and plans its names.

    Raises:
        CheckpointError: ``metadata.json`` not torch_dist, the common state missing, a
            ``.metadata`` of another step, no ``config.json`` to map names with, a tensor
            the name table cannot place; each names the file or tensor.
    """
    _check_backend(directory)
    metadata = dcp_read.read_dcp_metadata(directory)
    _check_common_state(directory, metadata)
    _check_step(directory, metadata, step)
    if hf_config is None or not hf_config.is_file():
        raise CheckpointError(f"{directory}: Megatron names are mapped with the model's config.json (model.path); "
                              f"{hf_config or 'none'} is not a file")
    try:
        config = json.loads(hf_config.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{hf_config}: not readable JSON ({err})") from None
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors = {k: m for k, m in metadata.state_dict_metadata.items()
               if isinstance(m, TensorStorageMetadata) and names.is_model_key(k)}
    recipes = names.plan({k: tuple(m.size) for k, m in tensors.items()}, names.dims_from_config(config, str(hf_config)),
                         str(directory))
    return MegatronCheckpoint(directory, metadata, recipes, {k: m.properties.dtype for k, m in tensors.items()})


def _check_backend(directory: Path) -> None:
    path = directory / METADATA_JSON
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; not a Megatron dist checkpoint") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not readable JSON ({err})") from None
    backend = config.get("sharded_backend") if isinstance(config, dict) else None
    if backend != "torch_dist":
        raise CheckpointError(f"{path}: sharded_backend {backend!r}; only Megatron-core's torch_dist format is read")


def _check_common_state(directory: Path, metadata) -> None:
    if (directory / COMMON_PT).is_file():
        return
    if any(key.split("/", 1)[0] == COMMON_STATE for key in metadata.state_dict_metadata):
        return
    raise CheckpointError(f"{directory / COMMON_PT} is missing and the DCP holds no {COMMON_STATE} object (Megatron-LM "
                          "PR #5160 layout): the checkpoint is incomplete")


def _check_step(directory: Path, metadata, step: int | None) -> None:
    """The ``.metadata``'s ``storage_meta.checkpoint_id`` (the path it was written to)
    names no ``step_M/`` (or NeMo-RL's ``tmp_step_M/``, renamed once complete) other than
    ``step``."""
    where = str(getattr(getattr(metadata, "storage_meta", None), "checkpoint_id", "") or "")
    written = re.findall(r"(?:^|/)(?:tmp_)?step_(\d+)(?=/|$)", where)
    if step is not None and written and int(written[-1]) != step:
        raise CheckpointError(f"{directory / dcp_read.DCP_METADATA} was written for step_{written[-1]} ({where}), not "
                              f"step_{step}: the checkpoint's files are mixed up")


# --------------------------------------------------------------------------- reading

@dataclass(frozen=True)
class _Copy:
    """``dest[rows d0:d1, rest]`` = Megatron ``key[index][rows s0:s1, rest]``."""

    name: str
    key: str
    index: tuple[int, ...]
    src: tuple[int, int]
    dst: tuple[int, int]


def _copies(recipes: dict[str, names.Recipe], blocks: dict[str, Block]) -> list[_Copy]:
    out = []
    for name, (offsets, sizes) in blocks.items():
        lo, hi, at = offsets[0] if offsets else 0, (offsets[0] + sizes[0]) if offsets else 1, 0
        for p in recipes[name].pieces:
            a, b = max(lo, at), min(hi, at + p.stop - p.start)
            if a < b:
                out.append(_Copy(name, p.key, p.index, (p.start + a - at, p.start + b - at), (a - lo, b - lo)))
            at += p.stop - p.start
    return out


def _span(c: _Copy, blocks: dict[str, Block], ndim: int) -> tuple[list[int], list[int]]:
    """``(start, end)`` per dim of the Megatron block one copy reads."""
    rest_o, rest_s = blocks[c.name][0][1:], blocks[c.name][1][1:]
    start = [*c.index, c.src[0], *rest_o]
    end = [*(i + 1 for i in c.index), c.src[1], *(o + s for o, s in zip(rest_o, rest_s))]
    return start[:ndim], end[:ndim]


def _boxes(copies: list[_Copy], blocks: dict[str, Block], shapes: dict[str, tuple[int, ...]]) -> list[tuple[str, Block, list[_Copy]]]:
    """The Megatron blocks to read: per key, one block per run of overlapping row
    ranges (so a rank's gate rows and up rows of ``linear_fc1`` are two blocks, not the
    span between them), each the smallest covering its copies; with those copies."""
    by_key: dict[str, list[_Copy]] = defaultdict(list)
    for c in copies:
        by_key[c.key].append(c)
    out = []
    for key, group in sorted(by_key.items()):
        runs: list[list[_Copy]] = []
        for c in sorted(group, key=lambda c: c.src):
            if runs and c.src[0] <= max(x.src[1] for x in runs[-1]):
                runs[-1].append(c)
            else:
                runs.append([c])
        for run in runs:
            spans = [_span(c, blocks, len(shapes[key])) for c in run]
            lo = [min(s[0][d] for s in spans) for d in range(len(shapes[key]))]
            hi = [max(s[1][d] for s in spans) for d in range(len(shapes[key]))]
            out.append((key, (tuple(lo), tuple(h - o for h, o in zip(hi, lo))), run))
    return out


def files_for(ckpt: MegatronCheckpoint, keys: set[str]) -> dict[str, int]:
    """The data files holding chunks of ``keys`` -> bytes placed there."""
    ends: dict[str, int] = defaultdict(int)
    for index, info in ckpt.metadata.storage_data.items():
        if index.fqn in keys:
            ends[info.relative_path] = max(ends[info.relative_path], info.offset + info.length)
    return dict(ends)


def read_into(ckpt: MegatronCheckpoint, dest: dict[str, torch.Tensor], blocks: dict[str, Block],
              check: set[str] | None = None) -> None:
    """Fills ``dest[name]`` (shape ``blocks[name]``'s sizes) with that block of each
    Hugging Face tensor, reading only the Megatron blocks that cover them (at most
    about 1 GiB per load). ``check``: the data files to check first (``dcp_read.check_dcp_files``;
    None: every file holding the model's tensors).

    Raises:
        CheckpointError: a data file is missing.
        CheckpointCorruptError: a data file is short, fails a CRC-32 or cannot be read.
    """
    shapes = {k: tuple(m.size) for k, m in ckpt.metadata.state_dict_metadata.items() if k in ckpt.dtypes}
    boxes = _boxes(_copies(ckpt.recipes, blocks), blocks, shapes)
    dcp_read.check_dcp_files(ckpt.directory, ckpt.metadata,
                             only=set(files_for(ckpt, {k for k, _, _ in boxes})) if check is None else check)
    batches: list[tuple[dict[str, tuple[torch.Tensor, tuple[int, ...]]], list, list[int]]] = []
    for key, (offsets, sizes), run in boxes:  # a key at most once per load; about 1 GiB per load
        nbytes = math.prod(sizes) * ckpt.dtypes[key].itemsize
        batch = next((b for b in batches if key not in b[0] and b[2][0] + nbytes <= _BATCH_BYTES), None)
        if batch is None:
            batch = ({}, [], [0])
            batches.append(batch)
        batch[0][key] = (torch.empty(sizes, dtype=ckpt.dtypes[key]), offsets)
        batch[1].append((key, run))
        batch[2][0] += nbytes
    for into, runs, _ in batches:
        dcp_read.load_dcp(ckpt.directory, ckpt.metadata, into=into)
        for key, run in runs:
            _place(*into[key], run, dest, blocks)
    for name, recipe in ckpt.recipes.items():
        if recipe.add_one and name in dest:
            dest[name] += 1  # in the saved dtype, as RMSNorm2ZeroCenteredRMSNormMapping.megatron_to_hf


def _place(box: torch.Tensor, at: tuple[int, ...], copies: list[_Copy], dest: dict[str, torch.Tensor],
           blocks: dict[str, Block]) -> None:
    for c in copies:
        view = box
        for axis, i in enumerate(c.index):
            view = view.select(0, i - at[axis])
        n = len(c.index)
        rows = view.narrow(0, c.src[0] - at[n], c.src[1] - c.src[0])
        rest_o, rest_s = blocks[c.name][0][1:], blocks[c.name][1][1:]
        for d, (o, s) in enumerate(zip(rest_o, rest_s), start=1):
            rows = rows.narrow(d, o - at[n + d], s)
        dest[c.name].narrow(0, c.dst[0], c.dst[1] - c.dst[0]).copy_(rows)


def read_weights(ckpt: MegatronCheckpoint) -> dict[str, torch.Tensor]:
    """Every Hugging Face tensor, whole (saved dtype, CPU).

    Raises:
        As :func:`read_into`.
    """
    specs = ckpt.specs()
    dest = {n: torch.empty(shape, dtype=getattr(torch, dtype)) for n, (dtype, shape) in specs.items()}
    read_into(ckpt, dest, {n: ((0,) * len(shape), tuple(shape)) for n, (_, shape) in specs.items()})
    return dest
