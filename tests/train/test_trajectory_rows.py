"""Agent trajectories as training rows: completion_mask exactly on the sampled tokens of
every turn, invalid samples out of the advantages and the loss, overlong ones out of the
loss; the loss gives environment tokens no gradient (computed independently)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from mlperf_grpo.agent.trajectory import Trajectory
from mlperf_grpo.config.sections import GRPOConfig
from mlperf_grpo.train.grpo import PGLossOptions, group_advantages
from mlperf_grpo.train.optimize import OptimizeSettings, optimize_step, training_batch
from mlperf_grpo.train.trajectories import valid_group_advantages

PAD, END = 0, 9


def trajectory(prompt, turns, reward, end_reason="finish", invalid=False, logprob=-0.5):
    """``turns``: ``(sampled ids, environment ids)`` pairs, in order."""
    t = Trajectory("task", 0, list(prompt), end_reason=end_reason, reward=reward, invalid=invalid)
    for sampled, environment in turns:
        t.append(list(sampled), [logprob] * len(sampled))
        t.append(list(environment), None)
    return t


def grpo(**overrides) -> GRPOConfig:
    return GRPOConfig(num_prompts_per_step=1, num_generations_per_prompt=2, micro_batch_size=2, **overrides)


def test_completion_mask_is_one_exactly_on_every_turns_sampled_tokens():
    a = trajectory([1, 2, 3], [([4, 5, END], [6, 7, 8, 6]), ([5, END], [])], reward=1.0)
    b = trajectory([1, 2], [([7, END], [8, 8]), ([4, 4, 4, END], [])], reward=0.0)
    batch = training_batch([[a, b]], torch.tensor([[1.0, 0.0]]), grpo(), PAD, [END])
    # row a: ids 1 2 3 | 4 5 9 | 6 7 8 6 | 5 9 ; the token at sequence position s is predicted at column s - 1
    assert batch.input_ids[0].tolist() == [1, 2, 3, 4, 5, 9, 6, 7, 8, 6, 5, 9]
    assert batch.completion_mask[0].tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1]
    assert batch.rollout_logprobs[0].tolist() == [0, 0, -0.5, -0.5, -0.5, 0, 0, 0, 0, -0.5, -0.5]
    assert batch.input_ids[1].tolist() == [1, 2, 7, 9, 8, 8, 4, 4, 4, 9, PAD, PAD]
    assert batch.completion_mask[1].tolist() == [0, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0]
    assert batch.attention_mask[1].tolist() == [1] * 10 + [0, 0]
    assert batch.sample_mask.tolist() == [1.0, 1.0]


def test_an_invalid_sample_leaves_the_baseline_and_the_loss_and_an_overlong_one_only_the_loss():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    samples = [[trajectory([1], [([2, END], [])], float(r)) for r in rewards[0]]]
    samples[0][1].invalid = True  # timed out: its reward 0 is not a score
    samples[0][2].end_reason = "context"  # overlong
    config = GRPOConfig(num_prompts_per_step=1, num_generations_per_prompt=4, micro_batch_size=4)
    batch = training_batch(samples, rewards, config, PAD, [END])
    expected = torch.zeros(4)
    kept = torch.tensor([0, 2, 3])  # the baseline is over the valid three, the overlong one included
    expected[kept] = group_advantages(rewards[:, kept], leave_one_out_baseline=True, normalize_rewards=True)[0]
    torch.testing.assert_close(batch.advantages, expected, rtol=0, atol=0)
    assert batch.sample_mask.tolist() == [1.0, 0.0, 0.0, 1.0]
    unfiltered = training_batch(samples, rewards, GRPOConfig(num_prompts_per_step=1, num_generations_per_prompt=4,
                                                             micro_batch_size=4, overlong_filtering=False), PAD, [END])
    assert unfiltered.sample_mask.tolist() == [1.0, 0.0, 1.0, 1.0]


def test_a_group_with_one_valid_sample_has_no_advantage():
    valid = torch.tensor([[True, False], [True, True]])
    advantages = valid_group_advantages(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), valid, True, True)
    assert advantages.tolist() == [[0.0, 0.0], [1.0, -1.0]]


@pytest.fixture
def policy():
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    return Qwen3ForCausalLM(config).float()


def test_environment_tokens_carry_no_gradient_computed_independently(policy):
    """Two two-turn trajectories, rewards 1 and 0 (advantages +1 and -1: leave-one-out, G = 2).
    With the ratio forced to 1 the loss's gradient is that of
    ``-(1/N) sum_rows A_row sum_{sampled t} log p(token_t)``; the environment's tokens must add nothing."""
    a = trajectory([1, 2, 3], [([4, 5, END], [6, 7, 8, 6]), ([5, END], [])], reward=1.0)
    b = trajectory([1, 2], [([7, END], [8, 8]), ([4, 4, 4, END], [])], reward=0.0)
    batch = training_batch([[a, b]], torch.tensor([[1.0, 0.0]]), grpo(), PAD, [END])
    settings = OptimizeSettings(micro_batch_size=2, temperature=1.0, grad_clip_norm=1e9,
                                options=PGLossOptions(force_on_policy_ratio=True))
    optimize_step(policy, torch.optim.SGD(policy.parameters(), lr=0.0), batch, settings)
    ours = [p.grad.clone() for p in policy.parameters()]

    def independent(include_environment: bool) -> list[torch.Tensor]:
        policy.zero_grad()
        total, count = 0.0, 0
        for traj, advantage in ((a, 1.0), (b, -1.0)):
            ids = torch.tensor([traj.prompt_token_ids + traj.token_ids])
            logp = torch.log_softmax(policy(input_ids=ids).logits[0, :-1].float(), dim=-1)
            for k, token in enumerate(traj.token_ids):
                if traj.sampled_mask[k] or include_environment:
                    position = len(traj.prompt_token_ids) + k  # predicted from position - 1
                    total = total - advantage * logp[position - 1, token]
                    count += 1
        (total / count).backward()
        return [p.grad.clone() for p in policy.parameters()]

    # float32 sums of a few hundred terms of size ~1: agreement to 1e-5 relative
    for mine, theirs in zip(ours, independent(include_environment=False)):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)
    wrong = independent(include_environment=True)
    assert any(not torch.allclose(mine, w, rtol=1e-3, atol=1e-5) for mine, w in zip(ours, wrong))
