"""Compiled decoder layers under activation checkpointing (model/compile.py) are compiled whole:
no graph break at the checkpoint (the kernels package's context variable in the attention's forward
broke it, and the layers ran eager), the linear fusion applies, a layer saves its inputs only, and
the loss and gradients are the eager checkpointed layers'."""

import copy
import math
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves
from transformers import Qwen3Config, Qwen3ForCausalLM

from mlperf_grpo.model.compile import compile_decoder_layers, decoder_layers
from mlperf_grpo.train import fsdp
from mlperf_grpo.train.trainer import checkpoint_layers
from test_linear_fusion import second_run_gemms

needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                              reason="torch.compile on the CPU needs a C compiler")
LAYERS, INTERMEDIATE = 2, 64
# a pass's GEMMs: a compiled layer's fused linears 4 forward and 8 backward, and at most the 4
# forward ones again in its recomputation; the head 1 forward and 2 backward. The eager
# checkpointed layers (the graph broken at the checkpoint): 7 + 7 + 14 a layer, 59 in all
MOST_GEMMS = LAYERS * (4 + 8 + 4) + 3
# float32 sums of up to K = INTERMEDIATE products in another order (inductor's kernels, the fused
# input gradients): each rounds by about sqrt(K) 2**-24 of its terms' magnitude; 16 of that covers
# what the layers and loss pass on (seen: a tenth of it at most)
FLOAT32_TOL = 16 * math.sqrt(INTERMEDIATE) * 2.0**-24


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # each test's compiles within Dynamo's recompile limit
    torch._dynamo.utils.counters.clear()


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=INTERMEDIATE,
                                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=8))
    model.config.use_cache = False
    return model.train()


def _pass(model, ids):
    """Loss and float32 gradients (full tensors, names without the checkpoint wrapper's) of one
    pass after a first one that compiles, and its GEMMs."""
    def once():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    loss, gemms = second_run_gemms(once)
    grads = {n.replace("_checkpoint_wrapped_module.", ""): getattr(p.grad, "full_tensor", lambda g=p.grad: g)()
             for n, p in model.named_parameters()}
    return loss, grads, gemms


@needs_cc
@pytest.mark.parametrize("path", ["one-process", "fsdp"])
def test_checkpointed_layers_compile_without_a_graph_break_and_give_the_eager_loss_and_gradients(request, path):
    eager = _model()
    compiled = copy.deepcopy(eager)
    checkpoint_layers(eager)
    if path == "fsdp":  # checkpoint_wrapper, then compile, then fully_shard
        request.getfixturevalue("one_rank_group")
        compiled = fsdp.shard_policy(compiled, None, activation_checkpointing=True, compile_layers=True)
    else:  # transformers' checkpointing, as trainer.policy_and_engine
        checkpoint_layers(compiled)
        compile_decoder_layers(compiled)
    ids = torch.randint(0, 64, (3, 11))
    loss, grads, _ = _pass(eager, ids)
    compiled_loss, compiled_grads, gemms = _pass(compiled, ids)
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}  # was 1: "HOP: Unsafe side effect"
    assert gemms <= MOST_GEMMS  # was 59: eager layers
    assert abs(float(compiled_loss - loss)) <= FLOAT32_TOL * abs(float(loss))
    for name, g in grads.items():
        torch.testing.assert_close(compiled_grads[name], g, rtol=0, atol=FLOAT32_TOL * float(g.abs().max()), msg=name)


class _SavedByLayer(torch.nn.Module):
    """A decoder layer whose call records, for each tensor saved for the backward, whether it is
    one of the layer's parameters, one of its inputs or something else (floating tensors of more
    than one element; the compiled graph also saves scalars and the generator's state)."""

    def __init__(self, layer: torch.nn.Module, saved: list[str]):
        super().__init__()
        self.layer, self.saved = layer, saved

    def forward(self, *args, **kwargs):
        params = {p.untyped_storage().data_ptr() for p in self.layer.parameters()}
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}

        def pack(t):
            if t.is_floating_point() and t.numel() > 1:
                ptr = t.untyped_storage().data_ptr()
                self.saved.append("parameter" if ptr in params else "input" if ptr in inputs else f"other {tuple(t.shape)}")
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return self.layer(*args, **kwargs)


@needs_cc
@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_compiled_checkpointed_layer_saves_its_inputs_and_parameters_only(checkpointed):
    model = _model()
    if checkpointed:
        checkpoint_layers(model)
    compile_decoder_layers(model)
    layers, saved = decoder_layers(model), []
    for i, layer in enumerate(layers):
        layers[i] = _SavedByLayer(layer, saved)
    ids = torch.randint(0, 64, (3, 11))
    model(input_ids=ids, labels=ids).loss.backward()
    activations = [kind for kind in saved if kind.startswith("other")]
    if checkpointed:  # hidden states, cos and sin: what the recomputation starts from
        assert activations == [] and saved.count("input") == 3 * LAYERS, saved
    else:  # the check sees what the layers hold without checkpointing
        assert len(activations) >= LAYERS, saved
