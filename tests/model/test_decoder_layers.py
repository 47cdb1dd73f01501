"""The decoder layers that FSDP shards and ``model.compile`` compiles are found in every
family's layout: a list in the base model (Llama, GPT-2) or one level down (OPT's
``model.decoder.layers``, where torchrun's FSDP sharding of an OPT policy exited 1 with
"0 lists of decoder layers")."""

import pytest
import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

from mlperf_grpo.model.compile import compile_decoder_layers, decoder_layers
from mlperf_grpo.train import fsdp

LAYERS = 3


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=LAYERS,
                                            num_attention_heads=2, num_key_value_heads=2))
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=16, n_layer=LAYERS, n_head=2, n_positions=64))
    return OPTForCausalLM(OPTConfig(vocab_size=32, hidden_size=16, ffn_dim=32, num_hidden_layers=LAYERS,
                                    num_attention_heads=2, word_embed_proj_dim=16, max_position_embeddings=64,
                                    dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0))


@pytest.mark.parametrize("family,holder", [("llama", "model"), ("gpt2", "transformer"), ("opt", "model.decoder")])
def test_the_decoder_layers_are_the_one_list_of_each_family(family, holder):
    model = _model(family)
    layers = decoder_layers(model)
    assert layers is model.get_submodule(holder).get_submodule("h" if family == "gpt2" else "layers")
    assert len(layers) == LAYERS


def test_an_opt_policy_compiles_its_layers_and_their_siblings_not_the_decoder_holding_them():
    model = _model("opt")
    compile_decoder_layers(model)
    decoder = model.model.decoder
    compiled = {name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None}
    assert compiled == {f"model.decoder.layers.{i}" for i in range(LAYERS)} | {"model.decoder.final_layer_norm"}
    assert decoder.layers is decoder_layers(model)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_an_opt_policy_shards_and_trains_over_a_one_rank_group(one_rank_group):
    """FSDP2 over one rank computes the unsharded model's loss and gradients: its
    all-gather and reduce-scatter over one rank are copies and its divide factor is 1, so
    only the order of float32 sums may differ (a few roundings of 2**-24 each, relative):
    rtol 1e-6 on the loss, 1e-5 on each gradient (atol 1e-7 for entries that cancel to ~0)."""
    plain, sharded = _model("opt"), _model("opt")
    sharded = fsdp.shard_policy(sharded, None, activation_checkpointing=True)
    tokens = torch.randint(0, 32, (2, 7))
    plain.train(), sharded.train()
    losses = [m(input_ids=tokens, labels=tokens).loss for m in (plain, sharded)]
    for loss in losses:
        loss.backward()
    assert torch.allclose(losses[0], losses[1], rtol=1e-6, atol=0)
    grads = {n: p.grad for n, p in plain.named_parameters()}
    for name, param in sharded.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        assert torch.allclose(param.grad.full_tensor(), grads[name], rtol=1e-5, atol=1e-7), name
