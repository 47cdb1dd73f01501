"""GRPO advantages and loss against values worked out by hand."""

import math
import statistics

import pytest
import torch

from mlperf_grpo.train.grpo import (
    PGLossOptions,
    clipped_pg_loss_sum,
    group_advantages,
    importance_weights,
    ppo_ratios,
    seq_logprob_error_keep,
    seq_mask_tis_keep,
    token_logprobs,
)

SYMMETRIC = PGLossOptions(ratio_clip_min=0.2, ratio_clip_max=0.2)
REFERENCE = PGLossOptions(  # the closed recipe's loss_fn values
    ratio_clip_min=0.2,
    ratio_clip_max=0.28,
    force_on_policy_ratio=True,
    use_importance_sampling_correction=True,
    truncated_importance_sampling_type="seq-mask-tis",
    truncated_importance_sampling_ratio=1.002,
    truncated_importance_sampling_ratio_min=0.999,
)


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
    got = clipped_pg_loss_sum(current, rollout, rollout, adv, mask, SYMMETRIC).loss
    # token 1: A=1, rho=1.6 -> min(1.6, 1.2) = 1.2 -> loss -1.2
    # token 3: A=-2, rho=0.6 -> min(-1.2, 0.8*-2=-1.6) = -1.6 -> loss 1.6
    # token 4: A=-2, rho=1.2 -> min(-2.4, -2.4) -> loss 2.4
    assert got.item() == pytest.approx(-1.2 + 1.6 + 2.4, rel=1e-6)


def test_loss_gradient_is_policy_gradient_at_ratio_one():
    logits = torch.zeros(1, 1, 3, requires_grad=True)
    target = torch.tensor([[2]])
    logp = token_logprobs(logits, target, temperature=1.0)
    loss = clipped_pg_loss_sum(logp, logp.detach(), logp.detach(), torch.tensor([1.0]), torch.ones(1, 1), SYMMETRIC).loss
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
def test_clip_higher_is_asymmetric_by_hand():
    # ratios 1.3, 0.7, 0.7, 1.3 against advantages +1, -1, +1, -1; band [0.8, 1.28].
    prev = torch.zeros(1, 4)
    curr = torch.log(torch.tensor([[1.3, 0.7, 0.7, 1.3]]))
    options = PGLossOptions(ratio_clip_min=0.2, ratio_clip_max=0.28)
    ratios, clamped = ppo_ratios(curr, prev, options)
    assert clamped[0].tolist() == pytest.approx([1.28, 0.8, 0.8, 1.28], rel=1e-6)
    per_token = []
    for t, a in enumerate([1.0, -1.0, 1.0, -1.0]):
        mask = torch.zeros(1, 4)
        mask[0, t] = 1
        per_token.append(clipped_pg_loss_sum(curr, prev, prev, torch.tensor([a]), mask, options).loss.item())
    # A=+1, r=1.3: max(-1.3, -1.28) = -1.28 (clipped above at 1 + 0.28, not 1.2)
    # A=-1, r=0.7: max(0.7, 0.8) = 0.8 (clipped below at 1 - 0.2)
    # A=+1, r=0.7: max(-0.7, -0.8) = -0.7; A=-1, r=1.3: max(1.3, 1.28) = 1.3 (unclipped)
    assert per_token == pytest.approx([-1.28, 0.8, -0.7, 1.3], rel=1e-6)


def test_forced_ratio_is_one_and_ignores_prev():
    curr = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_()
    options = PGLossOptions(ratio_clip_min=0.2, ratio_clip_max=0.28, force_on_policy_ratio=True)
    ratios, clamped = ppo_ratios(curr, torch.full((1, 2), -9.0), options)
    assert ratios.tolist() == [[1.0, 1.0]] and clamped is ratios
    gen = curr.detach().clone()
    out = clipped_pg_loss_sum(curr, torch.full((1, 2), -9.0), gen, torch.tensor([3.0]), torch.ones(1, 2), options)
    # r = 1 in value: loss = 2 tokens * -A = -6; gradient of each curr_t is -A (REINFORCE).
    assert out.loss.item() == pytest.approx(-6.0)
    out.loss.backward()
    assert curr.grad.tolist() == [[-3.0, -3.0]]


def test_importance_weights_by_hand():
    prev = torch.tensor([[0.0, -1.0, float("nan")]])
    gen = torch.tensor([[-0.5, -1.0, 0.0]])
    w = importance_weights(prev, gen)
    assert w[0, :2].tolist() == pytest.approx([math.exp(0.5), 1.0])
    assert w[0, 2].item() == 0.0  # NaN -> 0, as the reference's nan_to_num


def test_seq_mask_tis_band_by_hand():
    gen = torch.zeros(4, 3)
    prev = torch.tensor([
        [0.001, 0.001, 0.0],     # mean over 2 tokens 0.001 -> g = 1.0010005: kept
        [0.010, -0.002, 0.0],    # mean 0.004 -> g = 1.004 > 1.002: masked
        [-0.002, -0.002, -0.002],  # mean -0.002 -> g = 0.998 < 0.999: masked
        [0.5, 0.001, -0.5],      # token 0 and 2 are padding: mean 0.001 -> kept
    ])
    token_mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    keep, geomean = seq_mask_tis_keep(prev, gen, token_mask, 0.999, 1.002)
    assert keep.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert geomean.tolist() == pytest.approx([math.exp(0.001), math.exp(0.004), math.exp(-0.002), math.exp(0.001)], rel=1e-6)


def test_reference_loss_masks_a_sequence_outside_the_band_by_hand():
    # force_on_policy_ratio: prev = sg(curr); IS weight exp(curr - gen) per token.
    curr = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]], requires_grad=True)
    gen = curr.detach() - torch.tensor([[0.001, 0.001], [0.010, -0.002]])  # log-ratios as above
    adv = torch.tensor([2.0, -1.0])
    out = clipped_pg_loss_sum(curr, None, gen, adv, torch.ones(2, 2), REFERENCE)
    w = math.exp(0.001)
    # sequence 0 kept: 2 tokens x w x (-A=-2); sequence 1 (g = 1.004) masked: contributes 0
    assert out.loss.item() == pytest.approx(2 * w * -2.0, rel=1e-6)
    assert out.num_sequences_masked_by_is.item() == 1
    assert out.importance_weight_sum.item() == pytest.approx(2 * w, rel=1e-6)
    out.loss.backward()
    assert curr.grad.flatten().tolist() == pytest.approx([-2.0 * w, -2.0 * w, 0.0, 0.0], rel=1e-6)


def test_is_correction_without_forced_ratio_uses_prev_by_hand():
    # ratio curr/prev = 1.5 (A=+1: clipped to 1.28 with clip-higher); weight prev/gen = e^0.2
    prev = torch.tensor([[math.log(0.4)]])
    curr = torch.tensor([[math.log(0.6)]])
    gen = prev - 0.2
    options = PGLossOptions(ratio_clip_min=0.2, ratio_clip_max=0.28, use_importance_sampling_correction=True)
    out = clipped_pg_loss_sum(curr, prev, gen, torch.tensor([1.0]), torch.ones(1, 1), options)
    assert out.loss.item() == pytest.approx(math.exp(0.2) * -1.28, rel=1e-6)


def test_seq_logprob_error_filter_by_hand():
    gen = torch.zeros(3, 2)
    prev = torch.tensor([[math.log(3.0), 0.0], [-math.log(4.0), 0.0], [5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    keep, error = seq_logprob_error_keep(prev, gen, mask, threshold=2.0)
    # mean of exp|d|: (3 + 1)/2 = 2 (kept, <=), (4 + 1)/2 = 2.5 (dropped); no tokens: 0 (kept)
    assert error.tolist() == pytest.approx([2.0, 2.5, 0.0], rel=1e-6)
    assert keep.tolist() == [1.0, 0.0, 1.0]


# --------------------------------------------------------------------------- the reference's advantages (issue 30)

def _loo(rewards, i):
    """Mean and unbiased std of the rewards other than the i-th (statistics module, exact for these inputs)."""
    others = rewards[:i] + rewards[i + 1:]
    return statistics.fmean(others), statistics.stdev(others)


def test_leave_one_out_with_16_samples_by_hand():
    # Group 1: four 1s, twelve 0s. A 1's others: three 1s of 15, mean 0.2, unbiased variance
    # 15 * 0.2 * 0.8 / 14; a 0's others: four 1s of 15, mean 4/15, variance 15 * (4/15) * (11/15) / 14.
    # Group 2: one 1: its others are all 0 (std 0: advantage left unnormalised, 1 - 0);
    # a 0's others: one 1 of 15, mean 1/15, variance 1/15.
    ones_4 = [1.0] * 4 + [0.0] * 12
    ones_1 = [1.0] + [0.0] * 15
    adv = group_advantages(torch.tensor([ones_4, ones_1]), leave_one_out_baseline=True)
    a1 = 0.8 / (math.sqrt(15 * 0.2 * 0.8 / 14) + 1e-6)
    a0 = -(4 / 15) / (math.sqrt(15 * (4 / 15) * (11 / 15) / 14) + 1e-6)
    b0 = -(1 / 15) / (math.sqrt(1 / 15) + 1e-6)
    # float32 output: relative rounding 2^-24 ~ 6e-8; 1e-6 leaves room for the float64 sums
    assert adv[0].tolist() == pytest.approx([a1] * 4 + [a0] * 12, rel=1e-6)
    assert adv[1].tolist() == pytest.approx([1.0] + [b0] * 15, rel=1e-6)
    # the same numbers from the statistics module, sample by sample
    for row, rewards in enumerate((ones_4, ones_1)):
        for i, r in enumerate(rewards):
            mean, std = _loo(rewards, i)
            expected = (r - mean) / (std + 1e-6) if std > 0 else r - mean
            assert adv[row, i].item() == pytest.approx(expected, rel=1e-6)


def test_leave_one_out_with_2_samples_is_the_other_reward_unnormalised():
    # G = 2: each sample's baseline is the one other reward (the reference's num_valid = 1,
    # whose Bessel-corrected std is 0 * inf = nan -> 0), so the advantage is r_i - r_j,
    # not divided. (A group of one valid sample, the reference's baseline = reward rule,
    # would need G = 1: refused, see test_group_advantages_rejects_single_generation.)
    rewards = torch.tensor([[1.0, 0.0], [0.25, 0.75], [1.0, 1.0]], dtype=torch.float64)
    adv = group_advantages(rewards, leave_one_out_baseline=True)
    assert adv.tolist() == [[1.0, -1.0], [-0.5, 0.5], [0.0, 0.0]]


@pytest.mark.parametrize("value", [0.35, 1000.1, -7.3, 0.1 + 0.2, 1.0])
@pytest.mark.parametrize("generations", [2, 3, 16])
@pytest.mark.parametrize("normalize", [True, False])
def test_equal_rewards_give_exactly_zero_advantage_with_leave_one_out(value, generations, normalize):
    adv = group_advantages(torch.full((2, generations), value), leave_one_out_baseline=True, normalize_rewards=normalize)
    assert adv.tolist() == [[0.0] * generations] * 2


def test_leave_one_out_flat_others_are_not_sharpened():
    # 15 x 0.35 and one 1.0: the odd one's others are all equal, std 0: advantage 1.0 - 0.35,
    # unnormalised (the reference: "don't sharpen the ones with no variation"). A 0.35's
    # others hold the 1.0.
    rewards = [0.35] * 15 + [1.0]
    adv = group_advantages(torch.tensor([rewards], dtype=torch.float64), leave_one_out_baseline=True)
    assert adv[0, 15].item() == pytest.approx(0.65, rel=1e-6)
    mean, std = _loo(rewards, 0)
    assert adv[0, :15].tolist() == pytest.approx([(0.35 - mean) / (std + 1e-6)] * 15, rel=1e-6)
    # Others whose spread is rounding noise (relative 1e-13) count as flat too: the 0.0's
    # advantage is 0 - 1000.1, not -1000.1 / (2.6e-11 + 1e-6) = -1e9.
    noisy = torch.tensor([[1000.1] * 14 + [1000.1 + 1e-10, 0.0]], dtype=torch.float64)
    assert group_advantages(noisy, leave_one_out_baseline=True)[0, 15].item() == pytest.approx(-1000.1, rel=1e-6)


def test_normalize_rewards_off_is_reward_minus_baseline():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    # group mean 0.5; leave-one-out: a 1's others mean 1/3, a 0's others mean 2/3
    assert group_advantages(rewards, normalize_rewards=False).tolist() == [[0.5, -0.5, -0.5, 0.5]]
    got = group_advantages(rewards, leave_one_out_baseline=True, normalize_rewards=False)
    assert got[0].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3], rel=1e-7)  # float32 output


def test_default_advantages_are_bit_identical_to_the_group_mean_and_std():
    # The open default (no leave-one-out, normalised): (r - mean) / (std + 1e-6), torch's
    # float64 mean and unbiased std, flat groups 0, as before issue 30.
    torch.manual_seed(0)
    rewards = torch.cat([torch.randint(0, 2, (32, 16)).float(), torch.rand(32, 16)])
    r = rewards.double()
    expected = ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-6)).float()
    flat = (rewards == rewards[:, :1]).all(dim=1)
    expected[flat] = 0.0
    assert torch.equal(group_advantages(rewards), expected)
