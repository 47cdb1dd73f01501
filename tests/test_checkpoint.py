"""Deferred checkpoints: atomic publish, self-describing, tmp dirs never read."""

import json

import torch

from mlperf_grpo.checkpoint import TrainingInfo, discover_checkpoints, sha256_file, write_checkpoint


def _info(step):
    return TrainingInfo(step, step * 16, 1_000 + step, step * 256, 256, 16, "float32", {}, [0.5] * 4)


def test_write_then_discover(tmp_path):
    emb = torch.randn(4, 3)
    state = {"embed.weight": emb, "lm_head.weight": emb, "b": torch.ones(2)}  # tied alias
    path = write_checkpoint(tmp_path, state, _info(18))
    assert path.name == "step_18" and not (tmp_path / "tmp_step_18").exists()
    (tmp_path / "tmp_step_19").mkdir()  # an interrupted write
    found, ignored = discover_checkpoints(tmp_path)
    assert [c.step for c in found] == [18]
    assert [p.name for p in ignored] == ["tmp_step_19"]
    info = json.loads((path / "training_info.json").read_text())
    assert info["training_step_end_time_ms"] == 1018 and info["samples_count"] == 18 * 256
    assert info["weights"]["model.safetensors"]["sha256"] == sha256_file(path / "model.safetensors")
    loaded = found[0].load_weights()
    assert set(loaded) == {"embed.weight", "b"}  # the alias is stored once
    assert torch.equal(loaded["embed.weight"], emb)
