"""Rollouts of an agentic suite (``task.name: swe``) in the trainer: the agent's
trajectories as the step's ``[P][G]`` samples, their rewards, which are valid, which are
overlong, and advantages over the valid ones only.

Rules (and sources):

- **Invalid sample** (the trajectory or its tests timed out): no reward, so it is left out
  of its group's baseline and standard deviation, of the loss and of the valid-token and
  valid-sequence counts (``sample_mask`` 0). NeMo Gym marks such a sample
  (``mask_sample``, ``responses_api_agents/swe_agents/app.py``) for NeMo-RL to drop; a
  group with fewer than two valid samples has advantage 0 for all.
- **Overlong** (``grpo.overlong_filtering``): a trajectory that ended by reaching the
  context limit (its last turn or the next observation did not fit), NeMo-RL
  ``experience/rollouts.py:run_multi_turn_rollout``'s ``truncated`` (set when a
  trajectory reaches ``max_seq_len``); ending at ``max_turns`` is not overlong. As for
  single-turn completions, an overlong sample keeps its place in the group's baseline
  and leaves the loss.
"""

from __future__ import annotations

import torch

from mlperf_grpo.agent.trajectory import Trajectory
from mlperf_grpo.inference.base import Completion, SamplingParams, derive_seed
from mlperf_grpo.tasks import Task
from mlperf_grpo.tasks.base import is_agentic  # noqa: F401  (re-exported for the trainer)
from mlperf_grpo.train.grpo import group_advantages

Sample = Completion | Trajectory


def agent_generator(runner):
    """A ``generate_rollouts``-shaped function (``train/rollout.py``) running the agent
    (an :class:`~mlperf_grpo.agent.suite.AgentRunner`): trajectory ``j`` of the ``i``-th
    prompt of ``step`` has seed ``derive_seed("rollout", seed, step, i, j)``."""
    def generate(engine, tasks: list[Task], generations_per_prompt: int, params: SamplingParams, seed: int, step: int,
                 first_prompt_index: int = 0) -> list[list[Trajectory]]:
        g = generations_per_prompt
        jobs = [(t, derive_seed("rollout", seed, step, first_prompt_index + i, j)) for i, t in enumerate(tasks)
                for j in range(g)]
        flat = runner.trajectories(engine, jobs, params).trajectories
        return [flat[i * g:(i + 1) * g] for i in range(len(tasks))]
    return generate


def trajectory_rewards(samples: list[list[Trajectory]]) -> torch.Tensor:
    """``[P, G]`` float: each trajectory's graded reward (0 for an invalid one)."""
    return torch.tensor([[float(t.reward) for t in group] for group in samples])


def valid_samples(samples: list[list[Sample]]) -> torch.Tensor:
    """``[P, G]`` bool: False for an invalid trajectory; every completion is valid."""
    return torch.tensor([[not getattr(s, "invalid", False) for s in group] for group in samples])


def overlong_trajectories(samples: list[list[Trajectory]]) -> torch.Tensor:
    """``[P, G]`` bool: True for a trajectory that ended at the context limit."""
    return torch.tensor([[t.overlong for t in group] for group in samples])


def valid_group_advantages(rewards: torch.Tensor, valid: torch.Tensor, leave_one_out_baseline: bool,
                           normalize_rewards: bool) -> torch.Tensor:
    """``[P, G]`` advantages of :func:`~mlperf_grpo.train.grpo.group_advantages` computed
    over each group's valid members only (``valid``: ``[P, G]`` bool); 0 for an invalid
    member and for every member of a group with fewer than two valid ones."""
    if bool(valid.all()):
        return group_advantages(rewards, leave_one_out_baseline=leave_one_out_baseline,
                                normalize_rewards=normalize_rewards)
    out = torch.zeros(rewards.shape, dtype=torch.float32)
    for p in range(rewards.shape[0]):
        keep = valid[p].nonzero().flatten()
        if len(keep) >= 2:
            out[p, keep] = group_advantages(rewards[p, keep].unsqueeze(0), leave_one_out_baseline=leave_one_out_baseline,
                                            normalize_rewards=normalize_rewards)[0]
    return out
