"""Direct tests of weight_names.py: which parameter each saved tensor loads into, for a
Qwen3-MoE model (per-expert tensors merged into one ``[E, 2 I, H]`` and one ``[E, H, I]``
parameter, as transformers 5's ``from_pretrained`` does) and for renamed legacy names.
The models are built on the meta device (no memory); the saved names are written out here
by hand, in the layout ``save_pretrained`` writes."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from mlperf_grpo.model.weight_names import ExpertParts, loaded_shapes, saved_sources

pytest.importorskip("transformers.conversion_mapping", reason="transformers 4 loads the files' names as they are")

E, H, I = 3, 8, 4  # experts, hidden size, expert intermediate size


def _moe():
    config = Qwen3MoeConfig(vocab_size=32, hidden_size=H, intermediate_size=16, moe_intermediate_size=I,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                            num_experts=E, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    with torch.device("meta"):
        return Qwen3MoeForCausalLM(config)


def _saved_moe_names():
    """name -> shape of the weight files of the model above: one tensor per expert and projection."""
    names = {"model.embed_tokens.weight": (32, H), "model.norm.weight": (H,), "lm_head.weight": (32, H)}
    for layer in range(2):
        p = f"model.layers.{layer}."
        names |= {p + "self_attn.q_proj.weight": (8, H), p + "self_attn.k_proj.weight": (4, H),
                  p + "self_attn.v_proj.weight": (4, H), p + "self_attn.o_proj.weight": (H, 8),
                  p + "self_attn.q_norm.weight": (4,), p + "self_attn.k_norm.weight": (4,),
                  p + "mlp.gate.weight": (E, H), p + "input_layernorm.weight": (H,),
                  p + "post_attention_layernorm.weight": (H,)}
        for e in range(E):
            names |= {p + f"mlp.experts.{e}.gate_proj.weight": (I, H), p + f"mlp.experts.{e}.up_proj.weight": (I, H),
                      p + f"mlp.experts.{e}.down_proj.weight": (H, I)}
    return names


def test_moe_experts_are_merged_per_layer_gate_then_up():
    model, have = _moe(), _saved_moe_names()
    sources = saved_sources(model, have)
    assert set(sources) == {name for name, _ in model.named_parameters()}  # every parameter, nothing else
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts."
        # gate_up_proj[e, 0:I] is expert e's gate_proj, [e, I:2I] its up_proj; down_proj[e] its down_proj
        assert sources[p + "gate_up_proj"] == ExpertParts(
            {**{(e, 0): p + f"{e}.gate_proj.weight" for e in range(E)}, **{(e, 1): p + f"{e}.up_proj.weight" for e in range(E)}}, 2)
        assert sources[p + "down_proj"] == ExpertParts({(e, 0): p + f"{e}.down_proj.weight" for e in range(E)}, 1)
    unmerged = {name: key for name, key in sources.items() if not isinstance(key, ExpertParts)}
    assert unmerged == {key: key for key in have if ".experts." not in key}


def test_moe_loaded_shapes_leave_merged_parameters_unsized():
    model, have = _moe(), _saved_moe_names()
    shapes = loaded_shapes(model, have)
    params = dict(model.named_parameters())
    assert set(shapes) == set(params)
    for name, shape in shapes.items():
        if ".experts." in name:
            assert shape is None, name  # the merge's shape, [E, 2 I, H] or [E, H, I], is the parameter's
        else:
            assert shape == tuple(params[name].shape), name
    assert tuple(params["model.layers.0.mlp.experts.gate_up_proj"].shape) == (E, 2 * I, H)
    assert tuple(params["model.layers.0.mlp.experts.down_proj"].shape) == (E, H, I)


def test_a_legacy_name_is_renamed_and_a_plain_model_keeps_its_names():
    config = LlamaConfig(vocab_size=32, hidden_size=H, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=4)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    have = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert saved_sources(model, have) == {name: name for name in have}
    assert loaded_shapes(model, have) == have
    legacy = {"encoder.LayerNorm.gamma": (H,), "encoder.LayerNorm.beta": (H,)}  # TF-era names transformers renames
    assert saved_sources(model, legacy) == {"encoder.LayerNorm.weight": "encoder.LayerNorm.gamma",
                                            "encoder.LayerNorm.bias": "encoder.LayerNorm.beta"}
    assert loaded_shapes(model, legacy) == {"encoder.LayerNorm.weight": (H,), "encoder.LayerNorm.bias": (H,)}
