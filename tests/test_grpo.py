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


# --------------------------------------------------------------------------- flat groups (issue 8, part 4)

@pytest.mark.parametrize("value", [0.35, 1000.1, -7.3, 1e-9, 0.1 + 0.2])
@pytest.mark.parametrize("generations", [2, 3, 16])
def test_equal_rewards_give_exactly_zero_advantage(value, generations):
    """Old code: 16 x 0.35 gave +0.029 to every member and 16 x 1000.1 gave -0.953."""
    adv = group_advantages(torch.full((2, generations), value))
    assert adv.tolist() == [[0.0] * generations] * 2
    adv64 = group_advantages(torch.full((1, generations), value, dtype=torch.float64))
    assert adv64.tolist() == [[0.0] * generations]


def test_rounding_noise_spread_is_flat():
    # 15 x 1000.1 and one 1000.1 + 1e-10 (float64): relative spread 1e-13, rounding noise.
    rewards = torch.tensor([[1000.1] * 15 + [1000.1 + 1e-10]], dtype=torch.float64)
    assert group_advantages(rewards).tolist() == [[0.0] * 16]
    # 0.1 + 0.2 and 0.3 differ in the last bit only.
    assert group_advantages(torch.tensor([[0.1 + 0.2, 0.3, 0.3, 0.3]], dtype=torch.float64)).tolist() == [[0.0] * 4]


def test_graded_rewards_by_hand():
    # [0.35, 0.35, 0.85, 0.85]: mean 0.6, deviations +-0.25, unbiased std sqrt(4 * 0.0625 / 3) = sqrt(1/12).
    # [1000, 1000, 1001, 1001] (float32): mean 1000.5, deviations +-0.5, std sqrt(1/3).
    # [0, 0, 0, 1e-3]: mean 2.5e-4, std sqrt((3 * 2.5e-4^2 + 7.5e-4^2) / 3) = 5e-4 (a real spread).
    rewards = torch.tensor([[0.35, 0.35, 0.85, 0.85], [1000.0, 1000.0, 1001.0, 1001.0], [0.0, 0.0, 0.0, 1e-3]])
    adv = group_advantages(rewards)
    a, b = 0.25 / (math.sqrt(1 / 12) + 1e-6), 0.5 / (math.sqrt(1 / 3) + 1e-6)
    c = 2.5e-4 / (5e-4 + 1e-6)
    assert adv[0].tolist() == pytest.approx([-a, -a, a, a], rel=1e-6)
    assert adv[1].tolist() == pytest.approx([-b, -b, b, b], rel=1e-6)
    assert adv[2].tolist() == pytest.approx([-c, -c, -c, 3 * c], rel=1e-5)
    assert adv.dtype == torch.float32
