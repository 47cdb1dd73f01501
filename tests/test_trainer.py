"""Trainer invariants on the built-in tiny model."""

import copy

import torch

from mlperf_grpo.inference.base import SamplingParams
from mlperf_grpo.inference.hf import HFEngine
from mlperf_grpo.model import load_model
from mlperf_grpo.tasks import arithmetic
from mlperf_grpo.train.grpo import PGLossOptions, group_advantages
from mlperf_grpo.train.loop import optimize_step
from mlperf_grpo.train.rollout import build_batch, generate_rollouts

MODEL = "builtin:arithmetic-tiny"


def _batch():
    engine = HFEngine(MODEL, "float32")
    tasks = arithmetic.train_tasks(8, 251, seed=3)
    comps = generate_rollouts(engine, tasks, 8, SamplingParams(1.0, 1.0, 6), seed=5, step=1)
    rewards = torch.tensor([[arithmetic.reward(c.text, t) for c in g] for t, g in zip(tasks, comps)])
    mixed = (rewards.min(dim=1).values < rewards.max(dim=1).values).sum()
    assert mixed >= 2, "the batch must hold groups with mixed rewards (non-zero advantages)"
    return build_batch(comps, rewards, group_advantages(rewards), engine.tokenizer.pad_token_id)


def _step(policy, batch, micro):
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)
    optimize_step(policy, opt, batch, micro, 1.0, PGLossOptions(), grad_clip_norm=1e9)
    return {n: p.detach().clone() for n, p in policy.named_parameters()}


def test_gradient_accumulation_equals_one_big_batch():
    batch = _batch()
    base = load_model(MODEL, "float32")
    whole = _step(copy.deepcopy(base), batch, micro=64)
    accumulated = _step(copy.deepcopy(base), batch, micro=16)
    for name in whole:
        torch.testing.assert_close(whole[name], accumulated[name], rtol=1e-5, atol=1e-6)


def test_a_step_changes_the_weights_and_rollout_logprobs_match_the_policy():
    batch = _batch()
    policy = load_model(MODEL, "float32")
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    # Rollout log-probs come from the engine's KV-cached generation; the policy's own
    # forward pass must agree before the update (importance ratio 1).
    from mlperf_grpo.train.grpo import token_logprobs

    with torch.no_grad():
        logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logp = token_logprobs(logits[:, :-1], batch.input_ids[:, 1:], 1.0)
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(logp[mask], batch.rollout_logprobs[mask], rtol=1e-4, atol=1e-4)
    after = _step(policy, batch, micro=16)
    assert any(not torch.equal(before[n], after[n]) for n in before)
