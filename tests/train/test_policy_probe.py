"""The loss pass's shortcuts checked on the policy before training (train/policy_probe.py):
packing where the model keeps packed rows apart (else padded passes, one note line),
the chunked log-prob head only for a model whose logits are its lm_head's output, and
training mode only for a model that scores in it as in eval mode."""

import dataclasses

import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, MixtralConfig, MixtralForCausalLM, OPTConfig,
                          OPTForCausalLM, PhimoeConfig, PhimoeForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig)

from mlperf_grpo.errors import ModelLoadError
from mlperf_grpo.model.load import load_model
from mlperf_grpo.train.grpo import PGLossOptions
from mlperf_grpo.train.optimize import OptimizeSettings
from mlperf_grpo.train.policy_probe import (checked_settings, logprob_head_problem, packing_problem,
                                            training_mode_problem)

V = 50


def _qwen3_5():
    # the benchmark's family: a gated delta-net layer (linear attention) and a full-attention one
    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"]))


def _opt():  # positions from the attention mask, not position_ids; dropout 0 as the trainer loads it
    return OPTForCausalLM(OPTConfig(vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2, dropout=0.0,
                                    num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=32))


def _gemma2():  # final_logit_softcapping after lm_head
    return Gemma2ForCausalLM(Gemma2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8))


def _settings(**kw):
    return OptimizeSettings(None, 1.0, PGLossOptions(), 1e9, micro_batch_tokens=64, **kw)


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_the_built_in_model_packs_and_keeps_its_settings(compute_dtype):
    policy = load_model("builtin:arithmetic-tiny", "float32").train()
    assert packing_problem(policy, compute_dtype) is None and packing_problem(policy, compute_dtype, 8) is None
    assert logprob_head_problem(policy) is None and training_mode_problem(policy) is None
    settings = _settings(compute_dtype=compute_dtype)
    assert checked_settings(policy, settings, "builtin") == (settings, None)
    assert policy.training  # put back


@pytest.mark.parametrize("make, said", [
    (_qwen3_5, "change by"),  # its recurrent state runs from one packed row into the next
    (_opt, "change by"),
])
def test_a_model_that_lets_packed_rows_see_each_other_trains_padded(make, said):
    torch.manual_seed(0)
    policy = make()
    line = packing_problem(policy, torch.float32)
    assert line is not None and said in line and "\n" not in line
    settings, note = checked_settings(policy, _settings(), "tiny")
    assert settings == dataclasses.replace(_settings(), packing="never")
    assert "rows not packed for this model" in note and "padding included" in note
    assert checked_settings(policy, _settings(packing="never"), "tiny") == (_settings(packing="never"), None)


def test_a_model_that_transforms_its_logits_after_lm_head_is_refused():
    torch.manual_seed(0)
    policy = _gemma2()
    assert "not its lm_head's output" in logprob_head_problem(policy)
    with pytest.raises(ModelLoadError, match="model tiny-gemma2: its logits are not its lm_head's output"):
        checked_settings(policy, _settings(), "tiny-gemma2")


def test_the_probes_compile_nothing_of_a_compiled_policy():
    # compiled, the probes' eval-mode, no-grad and one-row calls took 6 of Dynamo's 8 entries a
    # frame before the first training pass (a checkpointed layer then failed its recompute on a GPU)
    from torch._dynamo.utils import counters

    from mlperf_grpo.model.compile import compile_decoder_layers

    policy = load_model("builtin:arithmetic-tiny", "float32").train()
    policy.config.use_cache = False
    compile_decoder_layers(policy)
    torch._dynamo.reset()
    counters.clear()
    settings = _settings(compute_dtype=torch.float32, width_multiple=8)
    assert checked_settings(policy, settings, "builtin") == (settings, None)
    assert sum(counters["frames"].values()) == 0 and not counters["stats"]["unique_graphs"]


def _mixtral(jitter=0.1):  # router_jitter_noise: training mode scales the hidden states by uniform(1 - j, 1 + j)
    return MixtralForCausalLM(MixtralConfig(vocab_size=V, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                                            num_experts_per_tok=1, router_jitter_noise=jitter))


def _phimoe():  # training mode samples each token's experts (sparsemixer); a zero router ties them all
    model = PhimoeForCausalLM(PhimoeConfig(vocab_size=V, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                           num_experts_per_tok=2))
    torch.nn.init.zeros_(model.model.layers[0].mlp.router.weight)
    return model


@pytest.mark.parametrize("make", [_mixtral, _phimoe])
def test_a_model_that_scores_otherwise_in_training_mode_is_refused(make):
    torch.manual_seed(0)
    policy = make().train()
    assert training_mode_problem(policy) is not None and policy.training  # put back
    with pytest.raises(ModelLoadError, match="model tiny: its training-mode forward scores a row differently"):
        checked_settings(policy, _settings(), "tiny")


def test_the_same_model_without_its_training_noise_is_accepted():
    torch.manual_seed(0)
    assert training_mode_problem(_mixtral(jitter=0.0)) is None
