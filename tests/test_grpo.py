"""GRPO advantages and loss against values worked out by hand."""

import math

import pytest
import torch

from mlperf_grpo.train.grpo import clipped_pg_loss_sum, group_advantages, token_logprobs


def test_group_advantages_by_hand():
    # Group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(((.5^2)*4)/3) = sqrt(1/3).
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]), eps=0.0 + 1e-12)
    s = math.sqrt(1 / 3)
    assert adv[0].tolist() == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s], rel=1e-6)
    # A group whose rewards are all equal carries no signal.
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_group_advantages_rejects_single_generation():
    with pytest.raises(ValueError, match="generations>=2"):
        group_advantages(torch.tensor([[1.0], [0.0]]))


def test_clipped_loss_by_hand():
    # Two completions, two token slots; the second slot of completion 1 is padding.
    rollout = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    current = torch.log(torch.tensor([[0.8, 0.5], [0.3, 0.6]]))  # ratios 1.6, (1.0 pad), 0.6, 1.2
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    got = clipped_pg_loss_sum(current, rollout, adv, mask, clip_eps=0.2)
    # token 1: A=1, rho=1.6 -> min(1.6, 1.2) = 1.2 -> loss -1.2
    # token 3: A=-2, rho=0.6 -> min(-1.2, 0.8*-2=-1.6) = -1.6 -> loss 1.6
    # token 4: A=-2, rho=1.2 -> min(-2.4, -2.4) -> loss 2.4
    assert got.item() == pytest.approx(-1.2 + 1.6 + 2.4, rel=1e-6)


def test_loss_gradient_is_policy_gradient_at_ratio_one():
    logits = torch.zeros(1, 1, 3, requires_grad=True)
    target = torch.tensor([[2]])
    logp = token_logprobs(logits, target, temperature=1.0)
    loss = clipped_pg_loss_sum(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 1), 0.2)
    loss.backward()
    # d(-log softmax_2)/d logits = softmax - onehot = [1/3, 1/3, -2/3]
    assert logits.grad[0, 0].tolist() == pytest.approx([1 / 3, 1 / 3, -2 / 3], rel=1e-6)


def test_token_logprobs_uses_temperature():
    logits = torch.tensor([[[2.0, 0.0]]])
    got = token_logprobs(logits, torch.tensor([[0]]), temperature=2.0)
    assert got.item() == pytest.approx(math.log(math.e / (math.e + 1)), rel=1e-6)
