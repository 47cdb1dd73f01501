"""Test helper: rewrite a series our trainer wrote into other trainers' layouts.

- :func:`to_nemo_rl`: NeMo-RL's ``step_N/{training_info.json, config.yaml, policy/weights,
  policy/tokenizer}`` (``nemo_rl/utils/checkpoint.py``, ``nemo_rl/algorithms/grpo.py``),
  weights as safetensors (``policy/weights/model/``, automodel's ``model_save_format:
  safetensors``), as a DTensor v1 torch distributed checkpoint (``policy/weights/`` with
  the state dict under ``"model"``, ``nemo_rl/utils/native_checkpoint.py``) or as a v2 one
  (``policy/weights/model/``, flat). Their record carries no weight hashes or canary.
- :func:`to_hf_dirs`: one Hugging Face model directory per checkpoint plus
  ``manifest.jsonl``.

Only fields those trainers write are kept; the tensors are our checkpoint's, unchanged.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import save_file

from mlperf_grpo.checkpoint import INFO_FILE, discover_checkpoints, read_weights


def _series(run: Path):
    return discover_checkpoints(run / "checkpoints")[0]


def to_nemo_rl(run: Path, out: Path, weights: str) -> Path:
    """``weights``: ``safetensors``, ``dcp`` (v1, nested) or ``dcp-v2`` (flat, in ``model/``)."""
    config = yaml.safe_load((run / "config.yaml").read_text())
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
        if weights == "safetensors":
            (weights_dir / "model").mkdir()
            save_file(tensors, str(weights_dir / "model" / "shard-00001-model-00001-of-00001.safetensors"))
        elif weights == "dcp":
            dcp.save({"model": tensors}, checkpoint_id=str(weights_dir), no_dist=True)
        elif weights == "dcp-v2":
            dcp.save(tensors, checkpoint_id=str(weights_dir / "model"), no_dist=True)
        else:
            raise ValueError(weights)
        tokenizer = step_dir / "policy" / "tokenizer"
        tokenizer.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (c.path / name).is_file():
                shutil.copy(c.path / name, tokenizer / name)
    (out / f"tmp_step_{c.step + 1}").mkdir()  # a save in flight when training stopped: never read
    return out


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
