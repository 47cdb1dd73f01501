"""Writes a Hugging Face model as the reference's Megatron-core ``torch_dist`` checkpoint,
with Megatron-core itself (``megatron-core`` 0.16.1 from PyPI; CPU, gloo), at ``W``
writing ranks that hold the model split ``W``-way tensor-parallel::

    python -m torch.distributed.run --nproc-per-node W tests/checkpoint/megatron_writer.py \\
        --job HF_DIR ITER_DIR legacy|inline [--job ...] [--padded-vocab-multiple 8]

Independent of the reader under test (``checkpoint/megatron_names.py`` goes the other
way, from the split functions): each rank's *local* Megatron parameters are built from
the Hugging Face tensors as Megatron-Bridge's ``hf_to_megatron`` builds them (merge, then
scatter to tensor-parallel ranks; ``models/conversion/param_mapping.py`` at 067f987:
``merge_qkv_weights``, ``GatedMLPMapping``, ``merge_gdn_linear_weights`` +
``_fuse_gdn_separate_to_grouped``, ``GDNConv1dMapping``/``ChunkedMapping``,
``RMSNorm2ZeroCenteredRMSNormMapping``, ``ColumnParallelMapping``/``RowParallelMapping``),
then wrapped by Megatron-core's own sharding helpers exactly as its modules do
(``utils.make_tp_sharded_tensor_for_checkpoint`` / ``make_sharded_tensor_for_checkpoint``,
``transformer/mlp.apply_swiglu_sharded_factory``, ``ssm/gated_delta_net._split_tensor_factory``,
layer offsets as ``TransformerBlock.sharded_state_dict``, expert offsets as
``SequentialMLP.sharded_state_dict``), and saved by ``dist_checkpointing.save``. So the
file layout (keys, global shapes, ``.distcp`` records, ``common.pt``, ``metadata.json``)
is Megatron-core's. ``--common inline`` stores the common state the way Megatron-LM does
since PR #5160 (``serialization.save`` at d98e8a6: a ``common_state`` ``ShardedObject`` in
the DCP, no ``common.pt``), with 0.16.1's own save steps.

Layer layout: a model whose layers differ (``qwen3_5_moe``: gated delta-net and full
attention) is keyed per layer (``decoder.layers.N.``; ``non_homogeneous_layers``); a
homogeneous one (``qwen3``) stacks its layers on a leading axis (``decoder.layers.``).
Norm names are those of the Transformer Engine layer specs the reference uses.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch


def _cpu_shims() -> None:
    """Megatron-core's save calls these even on the CPU."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"  # used as a device for a status tensor


class _Rank:
    """This rank's view: ``tp`` ranks of tensor parallelism, rank ``r``."""

    def __init__(self, hf: dict[str, torch.Tensor], config: dict, multiple: int) -> None:
        self.hf, self.c = hf, config
        self.r, self.tp = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.sd: dict = {}
        self.vocab_multiple = multiple * self.tp  # Megatron pads to make_vocab_size_divisible_by x TP

    # ---- Megatron-core wrappers (the module code's calls)
    def column(self, key: str, full: torch.Tensor, prepend=()):
        from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint
        return make_tp_sharded_tensor_for_checkpoint(full.chunk(self.tp, 0)[self.r].clone(), key, 0, prepend_offsets=prepend)

    def row(self, key: str, full: torch.Tensor, prepend=()):
        from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint
        return make_tp_sharded_tensor_for_checkpoint(full.chunk(self.tp, 1)[self.r].clone(), key, 1, prepend_offsets=prepend)

    def replicated(self, key: str, full: torch.Tensor, prepend=()):
        from megatron.core.utils import make_sharded_tensor_for_checkpoint
        return make_sharded_tensor_for_checkpoint(full.clone(), key, prepend_offsets=prepend)

    def swiglu(self, key: str, gate: torch.Tensor, up: torch.Tensor, prepend=()):
        """GatedMLPMapping.hf_to_megatron: rank r holds [gate_r; up_r]; the module's
        sharded_state_dict wraps it with apply_swiglu_sharded_factory."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint
        local = torch.cat([gate.chunk(self.tp, 0)[self.r], up.chunk(self.tp, 0)[self.r]], 0).clone()
        return apply_swiglu_sharded_factory(make_tp_sharded_tensor_for_checkpoint(local, key, 0, prepend_offsets=prepend), prepend)

    def split(self, key: str, local: torch.Tensor, sections: list[int], names: list[str], prepend=()):
        from megatron.core.ssm.gated_delta_net import _split_tensor_factory
        from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint
        return _split_tensor_factory(make_tp_sharded_tensor_for_checkpoint(local, key, 0, prepend_offsets=prepend),
                                     sections, names, 0)

    def put(self, name: str, value) -> None:
        """A sharded entry; the state-dict key is only unique (the sharded key places it)."""
        self.sd[f"{len(self.sd)}:{name}"] = value

    # ---- Hugging Face -> Megatron (Megatron-Bridge's merges)
    def padded_vocab(self, t: torch.Tensor) -> torch.Tensor:
        rows = math.ceil(t.shape[0] / self.vocab_multiple) * self.vocab_multiple
        pad = torch.full((rows - t.shape[0], t.shape[1]), 7.0, dtype=t.dtype)  # any value: trimmed by the reader
        return torch.cat([t, pad], 0)

    def qkv(self, p: str) -> torch.Tensor:
        """merge_qkv_weights: per query group [q heads (and their gate rows), k, v]."""
        c, h = self.c, self.c["hidden_size"]
        heads = c["num_attention_heads"]
        groups, d = c.get("num_key_value_heads") or heads, c.get("head_dim") or h // heads
        gated = c["model_type"].startswith("qwen3_5")  # attention_output_gate
        q = self.hf[f"{p}self_attn.q_proj.weight"].view(heads, 2 * d if gated else d, h)
        k = self.hf[f"{p}self_attn.k_proj.weight"].view(groups, d, h)
        v = self.hf[f"{p}self_attn.v_proj.weight"].view(groups, d, h)
        q, z = q.chunk(2, dim=1) if gated else (q, None)
        per = heads // groups
        parts = []
        for g in range(groups):
            parts += [q[g * per:(g + 1) * per]] + ([z[g * per:(g + 1) * per]] if gated else []) + [k[g:g + 1], v[g:g + 1]]
        return torch.cat(parts, 0).reshape(-1, h)

    def gdn_in_proj_local(self, p: str) -> torch.Tensor:
        """_fuse_gdn_separate_to_grouped + merge_gdn_linear_weights(tp_size), then rank r's rows."""
        c, h = self.c, self.c["hidden_size"]
        nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        qf, kf, vf = torch.split(self.hf[f"{p}linear_attn.in_proj_qkv.weight"], [nk * dk, nk * dk, nv * dv], 0)
        z, b, a = (self.hf[f"{p}linear_attn.in_proj_{x}.weight"] for x in "zba")
        per = nv // nk
        qkvz = torch.cat([qf.reshape(nk, dk, h), kf.reshape(nk, dk, h), vf.reshape(nk, per * dv, h), z.reshape(nk, per * dv, h)], 1)
        ba = torch.cat([b.reshape(nk, per, h), a.reshape(nk, per, h)], 1)
        q, k, v, zz = torch.split(qkvz, [dk, dk, per * dv, per * dv], 1)
        bb, aa = torch.split(ba, [per, per], 1)
        full = torch.cat([w.reshape(self.tp, -1, h) for w in (q, k, v, zz, bb, aa)], 1).reshape(-1, h)
        return full.chunk(self.tp, 0)[self.r].clone()

    def gdn_conv_local(self, p: str) -> torch.Tensor:
        """GDNConv1dMapping.hf_to_megatron (ChunkedMapping): q, k, v channels each split
        over the ranks, rank r holds [q_r; k_r; v_r]."""
        c = self.c
        qk, vd = c["linear_num_key_heads"] * c["linear_key_head_dim"], c["linear_num_value_heads"] * c["linear_value_head_dim"]
        w = self.hf[f"{p}linear_attn.conv1d.weight"]
        parts = [w[:qk], w[qk:2 * qk], w[2 * qk:2 * qk + vd]]
        return torch.cat([x.chunk(self.tp, 0)[self.r] for x in parts], 0).clone()


def _attention(rk: _Rank, p: str, k: str, pre) -> None:
    rk.put(f"{k}self_attention.linear_qkv.weight", rk.column(f"{k}self_attention.linear_qkv.weight", rk.qkv(p), pre))
    rk.put(f"{k}self_attention.linear_qkv.layer_norm_weight",
           rk.replicated(f"{k}self_attention.linear_qkv.layer_norm_weight", rk.hf[f"{p}input_layernorm.weight"], pre))
    for ours, theirs in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")) if f"{p}self_attn.q_norm.weight" in rk.hf else ():
        rk.put(f"{k}self_attention.{ours}.weight", rk.replicated(f"{k}self_attention.{ours}.weight", rk.hf[f"{p}self_attn.{theirs}.weight"], pre))
    rk.put(f"{k}self_attention.linear_proj.weight", rk.row(f"{k}self_attention.linear_proj.weight", rk.hf[f"{p}self_attn.o_proj.weight"], pre))


def _gated_delta_net(rk: _Rank, p: str, k: str, pre) -> None:
    c, tp = rk.c, rk.tp
    qk, vd = c["linear_num_key_heads"] * c["linear_key_head_dim"] // tp, c["linear_num_value_heads"] * c["linear_value_head_dim"] // tp
    nv = c["linear_num_value_heads"] // tp
    rk.put(f"{k}self_attention.in_proj.weight", rk.split(f"{k}self_attention.in_proj.weight", rk.gdn_in_proj_local(p),
           [qk, qk, vd, vd, nv, nv], ["query", "key", "value", "z", "beta", "alpha"], pre))
    rk.put(f"{k}self_attention.conv1d.weight", rk.split(f"{k}self_attention.conv1d.weight", rk.gdn_conv_local(p),
           [qk, qk, vd], ["query", "key", "value"], pre))
    rk.put(f"{k}self_attention.in_proj.layer_norm_weight",
           rk.replicated(f"{k}self_attention.in_proj.layer_norm_weight", rk.hf[f"{p}input_layernorm.weight"], pre))
    for name in ("A_log", "dt_bias"):
        rk.put(f"{k}self_attention.{name}", rk.column(f"{k}self_attention.{name}", rk.hf[f"{p}linear_attn.{name}"], pre))
    rk.put(f"{k}self_attention.out_norm.weight",  # RMSNorm2ZeroCenteredRMSNormMapping: HF - 1
           rk.replicated(f"{k}self_attention.out_norm.weight", rk.hf[f"{p}linear_attn.norm.weight"] - 1, pre))
    rk.put(f"{k}self_attention.out_proj.weight", rk.row(f"{k}self_attention.out_proj.weight", rk.hf[f"{p}linear_attn.out_proj.weight"], pre))


def _mlp(rk: _Rank, p: str, k: str, pre) -> None:
    c, hf = rk.c, rk.hf
    experts = c.get("num_experts") or c.get("num_local_experts")  # transformers 5 names Qwen3-MoE's the latter
    if not experts:
        rk.put(f"{k}mlp.linear_fc1.weight", rk.swiglu(f"{k}mlp.linear_fc1.weight", hf[f"{p}mlp.gate_proj.weight"], hf[f"{p}mlp.up_proj.weight"], pre))
        rk.put(f"{k}mlp.linear_fc1.layer_norm_weight",
               rk.replicated(f"{k}mlp.linear_fc1.layer_norm_weight", hf[f"{p}post_attention_layernorm.weight"], pre))
        rk.put(f"{k}mlp.linear_fc2.weight", rk.row(f"{k}mlp.linear_fc2.weight", hf[f"{p}mlp.down_proj.weight"], pre))
        return
    rk.put(f"{k}pre_mlp_layernorm.weight", rk.replicated(f"{k}pre_mlp_layernorm.weight", hf[f"{p}post_attention_layernorm.weight"], pre))
    rk.put(f"{k}mlp.router.weight", rk.replicated(f"{k}mlp.router.weight", hf[f"{p}mlp.gate.weight"], pre))
    for e in range(experts):  # SequentialMLP.sharded_state_dict: key ...experts.experts., offset (axis, e, E)
        ep = (*pre, (len(pre), e, experts))
        x = f"{p}mlp.experts.{e}."
        rk.put(f"{k}mlp.experts.local_experts.{e}.linear_fc1.weight",
               rk.swiglu(f"{k}mlp.experts.experts.linear_fc1.weight", hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"], ep))
        rk.put(f"{k}mlp.experts.local_experts.{e}.linear_fc2.weight", rk.row(f"{k}mlp.experts.experts.linear_fc2.weight", hf[x + "down_proj.weight"], ep))
    if c.get("shared_expert_intermediate_size"):
        s = f"{p}mlp.shared_expert."
        rk.put(f"{k}mlp.shared_experts.linear_fc1.weight",
               rk.swiglu(f"{k}mlp.shared_experts.linear_fc1.weight", hf[s + "gate_proj.weight"], hf[s + "up_proj.weight"], pre))
        rk.put(f"{k}mlp.shared_experts.linear_fc2.weight", rk.row(f"{k}mlp.shared_experts.linear_fc2.weight", hf[s + "down_proj.weight"], pre))
        rk.put(f"{k}mlp.shared_experts.gate_weight", rk.replicated(f"{k}mlp.shared_experts.gate_weight", hf[f"{p}mlp.shared_expert_gate.weight"], pre))


def sharded_state_dict(rk: _Rank) -> dict:
    """The model's sharded state dict on this rank (``GPTModel.sharded_state_dict``)."""
    c, hf = rk.c, rk.hf
    layers = c["num_hidden_layers"]
    kinds = c.get("layer_types") or ["full_attention"] * layers
    per_layer = len(set(kinds)) > 1
    rk.put("embedding.word_embeddings.weight", rk.column("embedding.word_embeddings.weight", rk.padded_vocab(hf["model.embed_tokens.weight"])))
    for n in range(layers):
        p = f"model.layers.{n}."
        k, pre = (f"decoder.layers.{n}.", ()) if per_layer else ("decoder.layers.", ((0, n, layers),))
        (_attention if kinds[n] == "full_attention" else _gated_delta_net)(rk, p, k, pre)
        _mlp(rk, p, k, pre)
    rk.put("decoder.final_layernorm.weight", rk.replicated("decoder.final_layernorm.weight", hf["model.norm.weight"]))
    if not c.get("tie_word_embeddings", False):
        rk.put("output_layer.weight", rk.column("output_layer.weight", rk.padded_vocab(hf["lm_head.weight"])))
    rk.sd.update(checkpoint_version=3.0, iteration=0)  # common (non-sharded) entries, as Megatron-Bridge saves some
    return rk.sd


def save(sd: dict, out: Path, common: str) -> None:
    """``dist_checkpointing.save`` (``legacy``: 0.16.1 as is, ``common.pt``) or its steps
    with the common state inside the DCP (``inline``: Megatron-LM ``serialization.save``
    after PR #5160)."""
    from megatron.core import dist_checkpointing
    if common == "legacy":
        dist_checkpointing.save(sd, str(out))
        return
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    strategy = get_default_save_sharded_strategy()
    sharded, state = save_preprocess(sd, True, None)
    sharded["common_state"] = ShardedObject(key="common_state", data=state, global_shape=(1,), global_offset=(0,),
                                            replica_id=torch.distributed.get_rank())
    strategy.save(sharded, str(out))
    if torch.distributed.get_rank() == 0:
        save_config(CheckpointingConfig(strategy.backend, strategy.version), str(out))
    torch.distributed.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", nargs=3, action="append", required=True, metavar=("HF_DIR", "ITER_DIR", "COMMON"),
                        help="a Hugging Face model directory, the directory to write, legacy or inline")
    parser.add_argument("--padded-vocab-multiple", type=int, default=8)
    args = parser.parse_args()
    _cpu_shims()
    from safetensors.torch import load_file
    from megatron.core import parallel_state

    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=torch.distributed.get_world_size())
    for source, target, common in args.job:
        source, out = Path(source), Path(target).resolve()  # .metadata records the path written to
        config = json.loads((source / "config.json").read_text())
        config = config.get("text_config", config)
        hf = {}
        for f in sorted(source.glob("*.safetensors")):
            hf.update(load_file(str(f)))
        if torch.distributed.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
        torch.distributed.barrier()
        save(sharded_state_dict(_Rank(hf, config, args.padded_vocab_multiple)), out, common)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":  # the async writer's processes import this file
    main()
