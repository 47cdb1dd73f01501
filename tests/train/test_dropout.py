"""The policy's dropout is off: its loss passes run in training mode and must score the
tokens as the engine (eval mode) sampled them."""

import shutil

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM

from mlperf_grpo.config.load import parse_config
from mlperf_grpo.model.files import BUILTIN_MODEL_DIR
from mlperf_grpo.train.trainer import disable_dropout, policy_and_engine

V = 15  # the built-in tokenizer's ids


def _gpt2():  # nn.Dropout modules, attention's dropout read from attn_dropout.p
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=64,
                                      resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5))


def _opt():  # float attributes passed to functional dropout (dropout, activation_dropout, attention's)
    return OPTForCausalLM(OPTConfig(vocab_size=V, hidden_size=16, ffn_dim=32, num_hidden_layers=2,
                                    num_attention_heads=2, max_position_embeddings=64, word_embed_proj_dim=16,
                                    dropout=0.5, attention_dropout=0.5, activation_dropout=0.5))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("make", [_gpt2, _opt])
def test_a_policy_without_dropout_scores_in_training_mode_as_in_eval_mode(make):
    torch.manual_seed(0)
    model = make()
    ids = torch.randint(0, V, (2, 12))
    expected = _logits(model.eval(), ids)
    assert not torch.equal(_logits(model.train(), ids), expected)  # dropout on: the test can fail
    disable_dropout(model)
    assert torch.equal(_logits(model.train(), ids), expected)


def test_the_trainer_loads_its_policy_without_dropout(tmp_path):
    torch.manual_seed(0)
    model_dir = tmp_path / "gpt2"
    _gpt2().save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUILTIN_MODEL_DIR / name, model_dir / name)
    config = parse_config({"model": {"path": str(model_dir)}, "grpo": {"num_prompts_per_step": 2, "first_eval_step": 1}})
    policy, engine = policy_and_engine(config, compiled=False)
    engine.close()
    ids = torch.randint(0, V, (2, 12))
    assert torch.equal(_logits(policy.train(), ids), _logits(policy.eval(), ids))


def test_a_policy_without_dropout_skips_no_layer_in_training_mode():
    # OPT's layerdrop skips a whole decoder layer at random in training mode (not a dropout module)
    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(vocab_size=V, hidden_size=16, ffn_dim=32, num_hidden_layers=2,
                                     num_attention_heads=2, max_position_embeddings=64, word_embed_proj_dim=16,
                                     layerdrop=0.5))
    ids = torch.randint(0, V, (2, 12))
    expected = _logits(model.eval(), ids)
    assert any(not torch.equal(_logits(model.train(), ids), expected) for _ in range(8))  # P(no skip) = 1/4 each
    disable_dropout(model)
    assert all(torch.equal(_logits(model.train(), ids), expected) for _ in range(8))
