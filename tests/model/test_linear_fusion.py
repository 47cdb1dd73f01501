"""Linears that read one input as one GEMM in the compiled decoder layers (model/linear_fusion.py):
the unfused layers' loss and gradients with 9 GEMMs fewer a layer and pass, and only where it is safe."""

import contextlib
import copy
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from mlperf_grpo.model.compile import compile_decoder_layers, decoder_layers, no_duck_sizing
from mlperf_grpo.model.linear_fusion import fuse_linears
from mlperf_grpo.train.compute_weights import compute_weights

needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                              reason="torch.compile on the CPU needs a C compiler")
LAYERS, INTERMEDIATE = 2, 64
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
             num_attention_heads=4, num_key_value_heads=2)
# float32 sums of up to K = INTERMEDIATE products in another order: each rounds differently by
# about sqrt(K) 2**-24 of its terms' magnitude; 16 of that covers what the layers and loss pass on
# (seen: a tenth of it at most)
FLOAT32_TOL = 16 * math.sqrt(INTERMEDIATE) * 2.0**-24


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # each test's compiles within Dynamo's recompile limit


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=8))
    return Qwen2ForCausalLM(Qwen2Config(**SHAPE))  # q/k/v with bias


def _plain_compile(model: torch.nn.Module) -> None:
    """:func:`compile_decoder_layers` without the fusion: its layers compiled again, without the pass."""
    compile_decoder_layers(model)
    for layer in decoder_layers(model):
        layer.compile(dynamic=True)


def _pass(model, ids, dtype=None, copies=False):
    """Loss and float32 gradients of one pass (after a first one that compiles), and its GEMMs;
    ``dtype``: under autocast, ``copies``: with the compute-dtype copies of the linears' weights."""
    def once():
        model.zero_grad(set_to_none=True)
        with compute_weights(model, dtype) if copies else contextlib.nullcontext():
            with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        return loss.detach()

    loss, gemms = second_run_gemms(once)
    return loss, {n: p.grad for n, p in model.named_parameters()}, gemms


def second_run_gemms(step):
    """``step()`` once (it compiles), then again under the profiler: ``(its result, the
    second run's aten::mm and addmm calls)``."""
    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = step()
    return out, sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm"))


def _assert_close(got: dict, expected: dict, tol: float) -> None:
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=tol * float(g.abs().max()), msg=name)


@needs_cc
@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_fused_layers_give_the_unfused_loss_and_gradients_in_float32_with_fewer_gemms(family):
    plain, fused = _model(family), _model(family)
    _plain_compile(plain)
    compile_decoder_layers(fused)
    ids = torch.randint(0, 64, (3, 11))
    loss, grads, gemms = _pass(plain, ids)
    fused_loss, fused_grads, fused_gemms = _pass(fused, ids)
    # a layer: q/k/v and gate/up 5 -> 2 forward GEMMs, 10 -> 4 backward
    assert gemms - fused_gemms == 9 * LAYERS
    assert abs(float(fused_loss - loss)) <= FLOAT32_TOL * abs(float(loss))
    _assert_close(fused_grads, grads, FLOAT32_TOL)


@needs_cc
def test_fused_layers_under_bfloat16_compute_weights_are_autocast_s_bits_and_near_the_unfused():
    """The compute-dtype copies (train/compute_weights.py) give autocast's bits with the fusion too:
    the fused weight is the same bfloat16 values, its gradient's slices the same sums. Against the
    unfused layers a group's input gradient is one bfloat16 rounding, not one a linear: each
    gradient within a few bfloat16 roundings (2**-8) of its largest entry (seen: 0.5%)."""
    base = _model("qwen3")
    ids = torch.randint(0, 64, (3, 11))
    runs = {}
    for name, fuse, copies in (("plain", False, True), ("fused", True, True), ("autocast", True, False)):
        model = copy.deepcopy(base)
        if fuse:
            compile_decoder_layers(model)
        else:
            _plain_compile(model)
        runs[name] = _pass(model, ids, torch.bfloat16, copies)
    (loss, grads, gemms), (fused_loss, fused_grads, fused_gemms) = runs["plain"], runs["fused"]
    assert gemms - fused_gemms == 9 * LAYERS
    assert torch.equal(runs["autocast"][0], fused_loss)
    _assert_close(runs["autocast"][1], fused_grads, 0.0)
    assert abs(float(fused_loss - loss)) <= 4 * 2.0**-8 * abs(float(loss))
    _assert_close(fused_grads, grads, 4 * 2.0**-8)


def _fused_in(fn, *args, autocast=False) -> tuple[int, torch.Tensor]:
    """How many linears :func:`fuse_linears` fuses in Dynamo's graph of ``fn`` (dynamic
    shapes but the weights' and biases', ``args[1:]``), and the rewritten graph's result for ``args`` (eager, no inductor; under
    bfloat16 autocast with ``autocast``)."""
    fused = []

    def backend(gm, example_inputs):
        fused.append(fuse_linears(gm.graph))
        gm.recompile()
        return gm.forward

    no_duck_sizing()
    for w in args[1:]:
        if w is not None:
            torch._dynamo.mark_static(w)  # as parameters are: static sizes
    with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        out = torch.compile(fn, backend=backend, dynamic=True)(*args)
    return sum(fused), out


def _inputs(dtype2=torch.float32):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    return x, torch.randn(4, 8), torch.randn(6, 8, dtype=dtype2), torch.randn(2, 8), torch.randn(6)


def test_the_pass_fuses_linears_of_one_input_and_gives_their_values():
    def fn(x, w1, w2, w3, b2):
        q = F.linear(x, w1).view(x.shape[0], x.shape[1], 2, 2)  # a view splitting the last dim
        return q.sum(-1), F.silu(F.linear(x, w2)) * 2, F.linear(x, w3) + 1, F.linear(x, w3, bias=None).sum()

    args = _inputs()
    fused, out = _fused_in(fn, *args[:4], None)
    assert fused == 4
    for got, expected in zip(out, fn(*args[:4], None)):
        torch.testing.assert_close(got, expected, rtol=FLOAT32_TOL, atol=FLOAT32_TOL)


@pytest.mark.parametrize("case,fused", [
    ("dtypes", 2),  # w2 bfloat16 under autocast: w1 and w3 fused alone
    ("bias", 2),  # w2 with a bias, the others without
    ("flat-view", 2),  # w1's output viewed flat: not a view of a slice
    ("graph-output", 2),  # w1's output returned as it is
    ("in-place", 0),  # a graph that mutates: nothing fused
    ("no-grad", 0),  # a grad-mode switch in the graph
])
def test_the_pass_leaves_what_it_cannot_fuse_safely(case, fused):
    def fn(x, w1, w2, w3, b2):
        a = F.linear(x, w1)
        b = F.linear(x, w2, b2 if case == "bias" else None)
        c = F.linear(x, w3)
        if case == "in-place":
            c.mul_(2)
        if case == "no-grad":
            with torch.no_grad():
                c = c * 2
        if case == "flat-view":
            a = a.view(-1)
        return a if case == "graph-output" else a * 1, b * 1, c * 1

    args = _inputs(torch.bfloat16 if case == "dtypes" else torch.float32)
    got, out = _fused_in(fn, *args, autocast=case == "dtypes")
    assert got == fused
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "dtypes"):
        for o, expected in zip(out, fn(*args)):
            torch.testing.assert_close(o, expected)
