"""Gradients summed by GradSum (train/grad_accumulation.py) are the bits autograd accumulates."""

import copy

import pytest
import torch

from mlperf_grpo.model.load import load_model
from mlperf_grpo.train.grad_accumulation import GradSum, usable


@pytest.mark.parametrize("flush_bytes", [1, 1 << 30], ids=["flush-every-gradient", "flush-after-backward"])
def test_foreach_sums_are_the_accumulated_gradients_bit_for_bit(flush_bytes):
    # the same float32 additions in the same order (sum += new, pass after pass), so equal bits,
    # whenever the queue is flushed; the tied embedding and a parameter no pass reaches (its
    # .grad stays None) included
    torch.manual_seed(0)
    base = load_model("builtin:arithmetic-tiny", "float32")
    unused = torch.nn.Parameter(torch.ones(3))
    base.register_parameter("unused", unused)
    batches = [torch.randint(0, base.config.vocab_size, (4, 7)) for _ in range(3)]
    policies = [copy.deepcopy(base) for _ in range(2)]
    for ids in batches:  # autograd's accumulation into .grad
        policies[0](input_ids=ids).logits.float().logsumexp(-1).mean().backward()
    params = list(policies[1].parameters())
    assert usable(params)
    with GradSum(params, flush_bytes) as grad_sum:
        for ids in batches:
            policies[1](input_ids=ids).logits.float().logsumexp(-1).mean().backward()
            assert all(p.grad is None for p in params)
            grad_sum.take()
    for (name, a), b in zip(policies[0].named_parameters(), params):
        assert (a.grad is None) == (b.grad is None) == (name == "unused"), name
        assert a.grad is None or torch.equal(a.grad, b.grad), name


def test_an_error_in_a_pass_leaves_no_hook_behind():
    policy = load_model("builtin:arithmetic-tiny", "float32")
    params = list(policy.parameters())
    ids = torch.randint(0, policy.config.vocab_size, (2, 5))
    with pytest.raises(RuntimeError, match="a pass failed"):
        with GradSum(params):
            policy(input_ids=ids).logits.sum().backward()
            raise RuntimeError("a pass failed")
    assert all(p.grad is not None for p in params)  # the first pass's gradients are back
    policy.zero_grad(set_to_none=True)
    policy(input_ids=ids).logits.sum().backward()  # plain autograd again: .grad set, nothing taken
    assert all(p.grad is not None for p in params)
