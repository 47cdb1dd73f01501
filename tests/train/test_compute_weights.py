"""Compute-dtype copies of the decoder linears (train/compute_weights.py): autocast's bits, the masters back."""

import copy

import pytest
import torch

from mlperf_grpo.model.compile import decoder_layers
from mlperf_grpo.model.load import load_model
from mlperf_grpo.train import optimize
from mlperf_grpo.train.compute_weights import ComputeWeights, compute_weights, linear_slots
from mlperf_grpo.train.grpo import PGLossOptions
from mlperf_grpo.train.optimize import OptimizeSettings, optimize_step
from tests.train.test_trainer import MODEL, _batch


def _update(policy, batch, micro):
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)
    result = optimize_step(policy, opt, batch, OptimizeSettings(micro, 1.0, PGLossOptions(), 1e9,
                                                                compute_dtype=torch.bfloat16))
    return result, {n: (p.detach().clone(), p.grad) for n, p in policy.named_parameters()}


@pytest.mark.parametrize("flush_bytes", [1, 1 << 30], ids=["flush-every-gradient", "flush-after-backward"])
@pytest.mark.parametrize("micro", [16, 64], ids=["4-passes", "1-pass"])
def test_the_update_is_autocast_s_bit_for_bit(monkeypatch, flush_bytes, micro):
    # the copies hold the values autocast casts to, and their gradients are summed in float32 as
    # GradSum sums autocast's float32 gradients: the same loss, gradients and weights, exactly
    batch = _batch()
    base = load_model(MODEL, "float32")
    made = []

    def with_flush(policy, dtype):
        made.append(ComputeWeights(linear_slots(policy), dtype, flush_bytes))
        return made[-1]

    monkeypatch.setattr(optimize, "compute_weights", lambda policy, dtype: None)
    plain, plain_params = _update(copy.deepcopy(base), batch, micro)
    monkeypatch.setattr(optimize, "compute_weights", with_flush)
    policy = copy.deepcopy(base)
    masters = {n: p for n, p in policy.named_parameters()}
    copied, copied_params = _update(policy, batch, micro)
    assert len(made) == 1 and len(made[0].masters) == 7 * len(decoder_layers(policy))
    assert plain.loss == copied.loss and plain.grad_norm == copied.grad_norm
    for name, (weight, grad) in plain_params.items():
        assert torch.equal(weight, copied_params[name][0]), name
        assert torch.equal(grad, copied_params[name][1]), name
    assert {n: p for n, p in policy.named_parameters()} == masters  # the same Parameter objects, back in place
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in policy.parameters())


def test_the_copies_are_the_decoder_linears_alone():
    policy = load_model(MODEL, "float32")
    slots = linear_slots(policy)
    linears = [m for m in decoder_layers(policy).modules() if isinstance(m, torch.nn.Linear)]
    assert [m for m, _ in slots] == [m for m in linears for _ in m.named_parameters(recurse=False)]
    assert all(m is not policy.lm_head for m, _ in slots)
    assert compute_weights(policy, torch.float32) is None
    frozen = copy.deepcopy(policy)
    for p in decoder_layers(frozen)[0].parameters():
        p.requires_grad_(False)
    assert len(linear_slots(frozen)) == len(slots) - 7
    shared = copy.deepcopy(policy)  # a weight two linears share keeps autocast (its uses summed in float32)
    layer = decoder_layers(shared)[0]
    layer.mlp.up_proj.weight = layer.mlp.gate_proj.weight
    assert len(linear_slots(shared)) == len(slots) - 2


def test_a_copy_no_pass_reaches_leaves_no_gradient_and_an_error_leaves_the_masters():
    policy = load_model(MODEL, "float32")
    extra = torch.nn.Linear(4, 4)  # in a decoder layer, never called
    decoder_layers(policy)[0].add_module("extra", extra)
    masters = {n: p for n, p in policy.named_parameters()}
    ids = torch.randint(0, policy.config.vocab_size, (2, 5))
    with compute_weights(policy, torch.bfloat16) as copies:
        assert policy.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
        with torch.autocast("cpu", dtype=torch.bfloat16):
            policy(input_ids=ids).logits.float().sum().backward()
        copies.take()
    assert extra.weight.grad is None and policy.model.layers[0].mlp.down_proj.weight.grad is not None
    policy.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="a pass failed"):
        with compute_weights(policy, torch.bfloat16):
            raise RuntimeError("a pass failed")
    assert {n: p for n, p in policy.named_parameters()} == masters
    policy(input_ids=ids).logits.sum().backward()  # no hook left: plain autograd into the masters
    assert all(p.grad is not None for n, p in policy.named_parameters() if "extra" not in n)


class _Interrupted(BaseException):
    """What a signal handler raises between two bytecodes (GracefulStop's Terminated, Ctrl-C)."""


def test_a_signal_during_the_exit_leaves_every_master_in_its_module(monkeypatch):
    # a SIGTERM raises where the handler runs: while the hooks are removed, or in the middle
    # of putting the masters back; before, the copies stayed in the modules (the optimizer
    # then stepped masters no module read, and a save took the bfloat16 copies)
    policy = load_model(MODEL, "float32")
    masters = {n: p for n, p in policy.named_parameters()}
    remove = torch.utils.hooks.RemovableHandle.remove

    def interrupted_remove(handle):
        monkeypatch.setattr(torch.utils.hooks.RemovableHandle, "remove", remove)
        raise _Interrupted

    monkeypatch.setattr(torch.utils.hooks.RemovableHandle, "remove", interrupted_remove)
    with pytest.raises(_Interrupted):
        with compute_weights(policy, torch.bfloat16):
            pass
    assert {n: p for n, p in policy.named_parameters()} == masters

    class OnceInterrupted(dict):
        def __setitem__(self, key, value):
            type(self).__setitem__ = dict.__setitem__
            raise _Interrupted

    slots = linear_slots(policy)
    with pytest.raises(_Interrupted):
        with ComputeWeights(slots, torch.bfloat16):
            module = slots[len(slots) // 2][0]
            module._parameters = OnceInterrupted(module._parameters)
    assert {n: p for n, p in policy.named_parameters()} == masters
    assert all(p.dtype == torch.float32 for p in policy.parameters())
