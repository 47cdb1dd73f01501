"""Gradients summed by GradSum (train/grad_accumulation.py) are the bits autograd accumulates."""

import copy

import torch

from mlperf_grpo.model.load import load_model
from mlperf_grpo.train.grad_accumulation import GradSum, usable


def test_foreach_sums_are_the_accumulated_gradients_bit_for_bit():
    # the same float32 additions in the same order (sum += new, pass after pass), so equal bits;
    # the tied embedding and a parameter no pass reaches (its .grad stays None) included
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
    grad_sum = GradSum(params)
    for ids in batches:
        policies[1](input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        grad_sum.take()
        assert all(p.grad is None for p in params)
    grad_sum.restore()
    for (name, a), b in zip(policies[0].named_parameters(), params):
        assert (a.grad is None) == (b.grad is None) == (name == "unused"), name
        assert a.grad is None or torch.equal(a.grad, b.grad), name
