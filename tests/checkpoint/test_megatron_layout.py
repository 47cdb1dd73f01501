"""The reference's Megatron-core ``torch_dist`` checkpoints, written by Megatron-core
itself (``megatron_writer.py``: megatron-core 0.16.1, CPU, gloo, at 1, 2 and 4 writing
ranks, both common-state layouts), read back without Megatron into the Hugging Face
model: every tensor bit-identical, logits identical; a rank's share; the faults."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from foreign_layouts import write_megatron

from mlperf_grpo.checkpoint import megatron_layout as ml
from mlperf_grpo.checkpoint import megatron_names as names
from mlperf_grpo.checkpoint.format import CheckpointCorruptError, CheckpointError

if importlib.util.find_spec("megatron") is None:  # not imported here: only the writer's processes import it
    pytest.skip("the fixtures are written by megatron-core (the test extra installs it)", allow_module_level=True)
pytestmark = pytest.mark.slow

CASES = [("qwen3_5_moe", 1, "legacy"), ("qwen3_5_moe", 2, "inline"), ("qwen3_5_moe", 4, "legacy"),
         ("qwen3", 1, "inline"), ("qwen3", 2, "legacy"), ("qwen3", 4, "inline"), ("qwen3_moe", 2, "inline")]
"""(model, writing ranks, common-state layout): each layout at each rank count once per model."""


def tiny_model(kind: str, directory: Path) -> Path:
    """A random-init tiny Hugging Face model saved to ``directory``. ``qwen3_5_moe``: a
    gated delta-net layer and a full-attention layer, each with routed and shared
    experts, untied; ``qwen3``: grouped-query attention, tied embeddings; both with a
    vocabulary of 20 that Megatron pads (to a multiple of 8 x ranks); ``qwen3_moe``: routed
    experts only, homogeneous layers (stacked on a leading axis, experts on the next). Every tensor is
    drawn from N(0, 1) except the delta-net's norm: 1 + k/64 (|k| <= 8), which
    Megatron's zero-centred ``w - 1`` and the reader's ``+ 1`` give back exactly."""
    from transformers import (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    torch.manual_seed(0)
    if kind == "qwen3_5_moe":
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(
            vocab_size=20, hidden_size=32, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
            moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
            linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention"], tie_word_embeddings=False))
    elif kind == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=20, hidden_size=32, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
            moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=20, hidden_size=32, num_hidden_layers=2, num_attention_heads=8,
                                             num_key_value_heads=4, head_dim=8, intermediate_size=16, tie_word_embeddings=True))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + torch.randint(-8, 9, p.shape) / 64 if name.endswith("linear_attn.norm.weight") else torch.randn(p.shape))
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """``{(model, ranks, common): iter_dir}`` and the Hugging Face directories."""
    base = tmp_path_factory.mktemp("megatron")
    hf = {kind: tiny_model(kind, base / kind) for kind in ("qwen3_5_moe", "qwen3", "qwen3_moe")}
    out = {}
    for ranks in (1, 2, 4):
        jobs = []
        for kind, r, common in CASES:
            if r == ranks:
                out[(kind, r, common)] = base / f"{kind}-{r}-{common}" / "step_3" / "policy" / "weights" / "iter_0000000"
                jobs.append((hf[kind], out[(kind, r, common)], common))
        write_megatron(jobs, ranks)
    return out, hf


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_each_tensor_reads_back_bit_identical_and_logits_identical(written, tmp_path, case):
    from transformers import AutoModelForCausalLM

    out, hf = written
    kind = case[0]
    ckpt = ml.open_checkpoint(out[case], 3, hf[kind] / "config.json")
    got = ml.read_weights(ckpt)
    want = load_file(str(hf[kind] / "model.safetensors"))
    assert sorted(got) == sorted(want)  # the saved form's names, lm_head absent when tied
    assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]
    assert ckpt.specs() == {n: (str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in want.items()}
    read = tmp_path / "read"
    read.mkdir()
    shutil.copy(hf[kind] / "config.json", read / "config.json")
    save_file(got, str(read / "model.safetensors"))
    ids = torch.tensor([[1, 5, 9, 19, 3, 0, 7, 12]])
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(d).eval()(ids).logits for d in (hf[kind], read)]
    assert torch.equal(*logits)


def test_the_padded_vocabulary_and_the_stacked_layers_are_megatrons(written):
    out, _ = written
    metadata = ml.dcp_read.read_dcp_metadata(out[("qwen3", 4, "inline")])
    sizes = {k: list(m.size) for k, m in metadata.state_dict_metadata.items() if hasattr(m, "size")}
    assert sizes["embedding.word_embeddings.weight"] == [32, 32]  # 20 rows padded to a multiple of 8 x 4 ranks
    assert sizes["decoder.layers.self_attention.linear_qkv.weight"] == [2, (8 + 2 * 4) * 8, 32]  # layers stacked
    assert "output_layer.weight" not in sizes and any(k.startswith("common_state/") for k in metadata.state_dict_metadata)
    hybrid = ml.dcp_read.read_dcp_metadata(out[("qwen3_5_moe", 2, "inline")]).state_dict_metadata
    assert list(hybrid["decoder.layers.0.self_attention.in_proj.weight.beta"].size) == [8, 32]  # per layer, split
    assert list(hybrid["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"].size) == [4, 16, 32]


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_rank_reads_its_slices_and_only_the_blocks_covering_them(written, ranks):
    out, hf = written
    ckpt = ml.open_checkpoint(out[("qwen3_5_moe", 4, "legacy")], 3, hf["qwen3_5_moe"] / "config.json")
    full = ml.read_weights(ckpt)
    for rank in range(ranks):
        blocks, dest = {}, {}
        for name, t in full.items():  # a column split of 2-d tensors, rows of the rest, as engines shard
            dim = 1 if t.dim() == 2 and "o_proj" in name else 0
            n = -(-t.shape[dim] // ranks)
            offsets = [0] * t.dim()
            sizes = list(t.shape)
            offsets[dim], sizes[dim] = min(rank * n, t.shape[dim]), max(0, min(n, t.shape[dim] - rank * n))
            blocks[name] = (tuple(offsets), tuple(sizes))
            dest[name] = torch.empty(sizes, dtype=t.dtype)
        ml.read_into(ckpt, dest, blocks, check=set())
        for name, (offsets, sizes) in blocks.items():
            index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            assert torch.equal(dest[name], full[name][index]), name
        boxes = ml._boxes(ml._copies(ckpt.recipes, blocks), blocks,
                          {k: tuple(m.size) for k, m in ckpt.metadata.state_dict_metadata.items() if k in ckpt.dtypes})
        read = sum(torch.Size(s).numel() for _, (_, s), _ in boxes)
        assert read <= sum(torch.Size(m.size).numel() for k, m in ckpt.metadata.state_dict_metadata.items()
                           if k in ckpt.dtypes) // ranks + 4 * 32 * 8  # its share, plus whole norms and gates


def _copy(written, case, tmp_path) -> Path:
    out, _ = written
    step = tmp_path / "step_3"
    shutil.copytree(out[case].parent.parent.parent, step)
    return step / "policy" / "weights" / "iter_0000000"


def test_a_truncated_data_file_is_named(written, tmp_path):
    directory = _copy(written, ("qwen3", 2, "legacy"), tmp_path)
    with open(directory / "__1_0.distcp", "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointCorruptError, match=r"__1_0\.distcp: truncated"):
        ml.read_weights(ml.open_checkpoint(directory, 3, written[1]["qwen3"] / "config.json"))


def test_a_missing_common_pt_is_named(written, tmp_path):
    directory = _copy(written, ("qwen3_5_moe", 1, "legacy"), tmp_path)
    (directory / "common.pt").unlink()
    with pytest.raises(CheckpointError, match=r"common\.pt is missing"):
        ml.open_checkpoint(directory, 3, written[1]["qwen3_5_moe"] / "config.json")


def test_a_metadata_written_for_another_step_is_refused(written, tmp_path):
    directory = _copy(written, ("qwen3", 1, "inline"), tmp_path)
    other = tmp_path / "step_4" / "policy" / "weights" / "iter_0000000"
    shutil.copytree(directory, other)
    with pytest.raises(CheckpointError, match=r"written for step_3 .* not step_4"):
        ml.open_checkpoint(other, 4, written[1]["qwen3"] / "config.json")


def test_the_step_a_metadata_was_written_for_is_read_from_its_path_tmp_step_included():
    from types import SimpleNamespace

    def metadata(path):
        return SimpleNamespace(storage_meta=SimpleNamespace(checkpoint_id=path))

    ml._check_step(Path("x"), metadata("/r/tmp_step_18/policy/weights/iter_0000000"), 18)  # NeMo-RL renames tmp_step_18
    ml._check_step(Path("x"), metadata("elsewhere/iter_0000000"), 19)  # no step named: nothing to compare
    with pytest.raises(CheckpointError, match="written for step_18 .* not step_19"):
        ml._check_step(Path("x"), metadata("/r/tmp_step_18/policy/weights/iter_0000000"), 19)


def test_a_tensor_the_table_does_not_know_is_named(written):
    out, hf = written
    metadata = ml.dcp_read.read_dcp_metadata(out[("qwen3_5_moe", 1, "legacy")])
    specs = {k: tuple(m.size) for k, m in metadata.state_dict_metadata.items() if hasattr(m, "size")}
    dims = names.dims_from_config(json.loads((hf["qwen3_5_moe"] / "config.json").read_text()), "config.json")
    with pytest.raises(CheckpointError, match=r"'decoder\.layers\.1\.self_attention\.linear_qkv\.bias' is not in the qwen3_5_moe_text"):
        names.plan({**specs, "decoder.layers.1.self_attention.linear_qkv.bias": (192,)}, dims, "here")
    with pytest.raises(CheckpointError, match=r"'decoder\.layers\.0\.self_attention\.in_proj\.weight\.key' is missing"):
        names.plan({k: s for k, s in specs.items() if not k.endswith("in_proj.weight.key")}, dims, "here")
    assert not names.is_model_key("optimizer.state.exp_avg.decoder.final_layernorm.weight")
    assert not names.is_model_key("mtp.layers.0.eh_proj.weight") and names.is_model_key("output_layer.weight")


def test_another_backend_is_refused(written, tmp_path):
    directory = _copy(written, ("qwen3", 1, "inline"), tmp_path)
    (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    with pytest.raises(CheckpointError, match="sharded_backend 'zarr'; only Megatron-core's torch_dist"):
        ml.open_checkpoint(directory, 3, written[1]["qwen3"] / "config.json")


@pytest.mark.parametrize("kind", ["qwen3-tied", "llama"])
def test_a_real_megatron_gpt_models_checkpoint_gives_its_own_logits_in_the_hugging_face_model(tmp_path, kind):
    """Names and the query-group layout from a model Megatron-core builds itself
    (``megatron_gpt.py``: its ``sharded_state_dict``, its forward), not from our writer.
    Float32 with other kernels and summation orders: logits (|logit| < 10 here) agree to
    within 1e-4 (measured: 3e-6), while a wrong head or row order moves them by O(1)."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    if kind == "llama":
        config = LlamaConfig(vocab_size=20, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=8, intermediate_size=16, tie_word_embeddings=False, rms_norm_eps=1e-5)
    else:
        config = Qwen3Config(vocab_size=20, hidden_size=32, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                             head_dim=8, intermediate_size=16, tie_word_embeddings=True)
    config.save_pretrained(tmp_path)
    target = tmp_path / "step_3" / "policy" / "weights" / "iter_0000000"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               str(Path(__file__).with_name("megatron_gpt.py")), str(tmp_path / "config.json"), str(target),
               str(tmp_path / "logits.pt"), "24"]  # the vocabulary padded from 20 to 24
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    weights = ml.read_weights(ml.open_checkpoint(target, 3, tmp_path / "config.json"))
    read = tmp_path / "read"
    read.mkdir()
    shutil.copy(tmp_path / "config.json", read / "config.json")
    save_file(weights, str(read / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(read).eval()
    from megatron_gpt import IDS

    with torch.no_grad():
        ours = model(torch.tensor(IDS)).logits
    megatron = torch.load(tmp_path / "logits.pt")
    assert megatron.shape[-1] == 24 and ours.shape[-1] == 20
    assert ours.abs().max() < 10 and torch.allclose(ours, megatron[..., :20], rtol=0, atol=1e-4)
