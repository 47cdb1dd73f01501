"""Another trainer's Hugging Face directories are read by their index (issue 44): exactly
the files and the placement ``model.safetensors.index.json`` names; a stale copy in a
later shard, a left-over ``model.safetensors`` beside indexed shards, a tensor stored
twice and a missing indexed shard are refused in one line naming the file."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from mlperf_grpo.checkpoint import CheckpointError
from mlperf_grpo.checkpoint import foreign_layouts as foreign

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
STEP3 = {"a.weight": torch.zeros(2, 3), "b.weight": torch.zeros(3)}
STEP4 = {"a.weight": torch.ones(2, 3), "b.weight": torch.ones(3)}


def sharded_dir(folder, tensors, index=True):
    """``a.weight`` in shard 1, ``b.weight`` in shard 2, and the index naming them."""
    folder.mkdir(parents=True)
    save_file({"a.weight": tensors["a.weight"]}, str(folder / SHARDS[0]))
    save_file({"b.weight": tensors["b.weight"]}, str(folder / SHARDS[1]))
    if index:
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {"a.weight": SHARDS[0], "b.weight": SHARDS[1]}}))
    return folder


def manifest_of(root, folder):
    (root / "manifest.jsonl").write_text(json.dumps({"step": 4, "path": folder.name, "training_step_end_time_ms": 1}) + "\n")
    return root / "manifest.jsonl"


def read(root, folder):
    (checkpoint,) = foreign.read_manifest(manifest_of(root, folder), 32)
    foreign.tensor_specs(checkpoint)  # the series check, before anything is logged
    return foreign.read_weights(checkpoint)


def test_an_indexed_directory_gives_exactly_its_tensors(tmp_path):
    tensors = read(tmp_path, sharded_dir(tmp_path / "ckpt-4", STEP4))
    assert set(tensors) == set(STEP4) and all(torch.equal(tensors[n], STEP4[n]) for n in STEP4)


def test_a_stale_tensor_in_a_later_shard_is_refused_naming_file_and_tensor(tmp_path):
    folder = sharded_dir(tmp_path / "ckpt-4", STEP4)
    save_file({"a.weight": STEP3["a.weight"], "b.weight": STEP4["b.weight"]}, str(folder / SHARDS[1]))  # re-save cut short
    with pytest.raises(CheckpointError, match=f"{SHARDS[1]} holds tensor 'a.weight', which model.safetensors.index.json "
                                              f"places in {SHARDS[0]}"):
        read(tmp_path, folder)


def test_a_left_over_single_file_beside_indexed_shards_is_refused(tmp_path):
    folder = sharded_dir(tmp_path / "ckpt-4", STEP4)
    save_file(STEP3, str(folder / "model.safetensors"))  # an earlier save of one file
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not named by .*model\.safetensors\.index\.json"):
        read(tmp_path, folder)


def test_a_missing_indexed_shard_is_named_by_its_file_name(tmp_path):
    folder = sharded_dir(tmp_path / "ckpt-4", STEP4)
    (folder / SHARDS[1]).unlink()
    with pytest.raises(CheckpointError, match=f"{SHARDS[1]} is missing"):
        read(tmp_path, folder)


def test_a_tensor_the_index_places_in_a_shard_that_lacks_it_is_refused(tmp_path):
    folder = sharded_dir(tmp_path / "ckpt-4", STEP4)
    save_file({"c.weight": torch.ones(1)}, str(folder / SHARDS[1]))
    with pytest.raises(CheckpointError, match="does not name|lacks tensor"):
        read(tmp_path, folder)


def test_an_index_naming_the_wrong_shard_is_not_called_a_stale_copy(tmp_path):
    """The index places a.weight in shard 2, which lacks it; shard 1 holds its only copy:
    the line names the shard that lacks it, never 'remove the copy' (breaker finding)."""
    folder = sharded_dir(tmp_path / "ckpt-4", STEP4)
    save_file({"a.weight": STEP4["a.weight"], "c.weight": torch.ones(1)}, str(folder / SHARDS[0]))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a.weight": SHARDS[1], "b.weight": SHARDS[1], "c.weight": SHARDS[0]}}))
    with pytest.raises(CheckpointError, match=f"{SHARDS[1]} lacks tensor 'a.weight'"):
        read(tmp_path, folder)


def test_without_an_index_a_tensor_stored_twice_is_refused(tmp_path):
    folder = sharded_dir(tmp_path / "ckpt-4", STEP4, index=False)
    save_file({"a.weight": STEP3["a.weight"]}, str(folder / "model-extra.safetensors"))
    with pytest.raises(CheckpointError, match="tensor 'a.weight' is stored twice"):
        read(tmp_path, folder)


def test_nemo_rl_consolidated_weights_follow_the_same_rule(tmp_path):
    folder = sharded_dir(tmp_path / "step_4" / "policy" / "weights" / "model" / "consolidated", STEP4)
    save_file(STEP3, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="is not named by"):
        foreign._nemo_weights(tmp_path / "step_4")
