"""Test helper: rewrite a series our trainer wrote into other trainers' layouts.

- :func:`to_nemo_rl`: NeMo-RL's ``step_N/{training_info.json, config.yaml, policy/weights,
  policy/tokenizer}`` (``nemo_rl/utils/checkpoint.py``, ``nemo_rl/algorithms/grpo.py``),
  weights as safetensors (``policy/weights/model/``, automodel's ``model_save_format:
  safetensors``), as a DTensor v1 torch distributed checkpoint (``policy/weights/`` with
  the state dict under ``"model"``, ``nemo_rl/utils/native_checkpoint.py``) or as a v2 one
  (``policy/weights/model/``, flat); or as Automodel writes Hugging Face safetensors
  (``nemo_automodel/components/checkpoint/checkpointing.py``, ``save_model``): one file
  per rank in ``policy/weights/model/`` (``sharded``: 4 ranks, each tensor split along
  dim 0 as FSDP2's ``Shard(0)`` does, each file's header giving its slices'
  ``DCP_SHARDING_INFO`` ``saved_offsets`` as torch's ``HuggingFaceStorageWriter`` writes
  them) and, for ``consolidated``, also ``model/consolidated/`` (whole tensors, the index
  and a ``config.json`` written with ``to_json_string(use_diff=False)``: every default
  key); or (``megatron``) as the reference's Megatron backend saves them: a Megatron-Bridge
  save root (``latest_checkpointed_iteration.txt``, ``iter_0000000/``) holding a
  Megatron-core ``torch_dist`` checkpoint written by megatron-core itself at 2 ranks
  (``tests/checkpoint/megatron_writer.py``). Their record carries no weight hashes or canary.
- :func:`to_hf_dirs`: one Hugging Face model directory per checkpoint plus
  ``manifest.jsonl``.

Only fields those trainers write are kept; the tensors are our checkpoint's, unchanged.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import save_file
from transformers import AutoConfig

from mlperf_grpo.checkpoint import INFO_FILE, discover_checkpoints, read_weights


RANKS = 4
"""Ranks of the per-rank layouts (the upstream default is one file per rank)."""


def rank_slices(tensor: torch.Tensor, ranks: int) -> list[tuple[int, torch.Tensor]]:
    """``(dim-0 offset, slice)`` of each rank's share, as ``torch.chunk`` splits (FSDP2's
    ``Shard(0)``): ``ceil(n / ranks)`` rows each, the last ranks' shorter or empty."""
    if tensor.dim() == 0:
        return [(0, tensor)] + [(0, None)] * (ranks - 1)  # a scalar: one rank holds it
    rows = -(-tensor.shape[0] // ranks)
    return [(r * rows, tensor[r * rows:(r + 1) * rows]) for r in range(ranks)]


def write_per_rank(tensors: dict[str, torch.Tensor], folder: Path, ranks: int) -> None:
    """``folder/shard-0000R-model-00001-of-00001.safetensors`` for R = 1..ranks, each the
    rank's slices with ``{"DCP_SHARDING_INFO": {name: {"saved_offsets": [...]}}}`` in its
    header (torch ``filesystem._write_files_from_queue``, SAFETENSORS format); a rank
    whose slice of a tensor is empty writes nothing for it."""
    folder.mkdir(parents=True, exist_ok=True)
    for rank in range(ranks):
        mine, offsets = {}, {}
        for name, tensor in tensors.items():
            offset, part = rank_slices(tensor, ranks)[rank]
            if part is None or part.numel() == 0:
                continue
            mine[name] = part.contiguous()
            offsets[name] = {"saved_offsets": [offset] + [0] * (tensor.dim() - 1)}
        save_file(mine, str(folder / f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors"),
                  metadata={"DCP_SHARDING_INFO": json.dumps(offsets), "DCP_VERSION": "1.0", "format": "pt"})


def write_consolidated(tensors: dict[str, torch.Tensor], model_dir: Path, folder: Path) -> None:
    """Automodel's ``model/consolidated/``: whole tensors, ``model.safetensors.index.json``
    and the model's ``config.json`` with every default key written
    (``to_json_string(use_diff=False)``), as its ``_save_generated_hf_assets`` does."""
    folder.mkdir(parents=True)
    name = "model-00001-of-00001.safetensors"
    save_file(tensors, str(folder / name), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {n: name for n in tensors}}))
    (folder / "config.json").write_text(AutoConfig.from_pretrained(model_dir).to_json_string(use_diff=False))


def _series(run: Path):
    return discover_checkpoints(run / "checkpoints")[0]


def to_nemo_rl(run: Path, out: Path, weights: str) -> Path:
    """``weights``: ``safetensors``, ``dcp`` (v1, nested), ``dcp-v2`` (flat, in ``model/``),
    ``sharded`` or ``consolidated`` (see the module docstring)."""
    config = yaml.safe_load((run / "config.yaml").read_text())
    megatron_jobs = []
    for c in _series(run):
        step_dir = out / f"step_{c.step}"
        weights_dir = step_dir / "policy" / "weights"
        weights_dir.mkdir(parents=True)
        (step_dir / INFO_FILE).write_text(json.dumps({
            "epoch": 0, "step": c.step, "total_steps": c.step, "current_step": c.step,
            "consumed_samples": c.info.consumed_samples,
            "training_step_end_time_ms": c.info.training_step_end_time_ms,
        }))
        (step_dir / "config.yaml").write_text(yaml.safe_dump({"grpo": config["grpo"], "policy": {"model_name": "builtin"}}))
        tensors = read_weights(c)
        if weights in ("sharded", "consolidated"):
            write_per_rank(tensors, weights_dir / "model", RANKS)
            if weights == "consolidated":
                write_consolidated(tensors, c.path, weights_dir / "model" / "consolidated")
        elif weights == "safetensors":
            (weights_dir / "model").mkdir()
            save_file(tensors, str(weights_dir / "model" / "shard-00001-model-00001-of-00001.safetensors"))
        elif weights == "dcp":
            dcp.save({"model": tensors}, checkpoint_id=str(weights_dir), no_dist=True)
        elif weights == "dcp-v2":
            dcp.save(tensors, checkpoint_id=str(weights_dir / "model"), no_dist=True)
        elif weights == "megatron":
            (weights_dir / "latest_checkpointed_iteration.txt").write_text("0")
            megatron_jobs.append((c.path, weights_dir / "iter_0000000", "legacy"))
        else:
            raise ValueError(weights)
        tokenizer = step_dir / "policy" / "tokenizer"
        tokenizer.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (c.path / name).is_file():
                shutil.copy(c.path / name, tokenizer / name)
    if megatron_jobs:
        write_megatron(megatron_jobs, 2)
    (out / f"tmp_step_{c.step + 1}").mkdir()  # a save in flight when training stopped: never read
    return out


MEGATRON_WRITER = Path(__file__).parent / "checkpoint" / "megatron_writer.py"


def write_megatron(jobs: list[tuple[Path, Path, str]], ranks: int) -> None:
    """``megatron_writer.py`` on ``ranks`` gloo processes: each job a Hugging Face model
    directory, the ``iter_*`` directory to write, ``legacy`` or ``inline`` common state
    (about 15 s on 2 busy cores). Skips the test without megatron-core."""
    import importlib.util
    import os
    import subprocess
    import sys

    import pytest

    if importlib.util.find_spec("megatron") is None:  # not imported here: only the writer's processes import it
        pytest.skip("megatron-core writes these fixtures (the test extra installs it)")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), str(MEGATRON_WRITER)]
    for hf, target, common in jobs:
        command += ["--job", str(hf), str(target), common]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def to_hf_dirs(run: Path, out: Path) -> Path:
    """``out/models/ckpt-N/`` (a Hugging Face model directory) and ``out/manifest.jsonl``."""
    lines = []
    for c in _series(run):
        target = out / "models" / f"ckpt-{c.step}"
        shutil.copytree(c.path, target, ignore=shutil.ignore_patterns(INFO_FILE))
        lines.append(json.dumps({"step": c.step, "path": f"models/ckpt-{c.step}",
                                 "training_step_end_time_ms": c.info.training_step_end_time_ms}))
    (out / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    return out
