"""A step's rewards (:data:`~mlperf_grpo.train.async_rollout.Scorer`), scored on the
rollout producer's thread as soon as its samples exist: with one-step-async rollouts the
scoring of step N+1 overlaps the training of step N."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from mlperf_grpo.inference.tensor_parallel import rank_share
from mlperf_grpo.tasks import Task
from mlperf_grpo.tasks.reward_names import RewardFn
from mlperf_grpo.tasks.scoring import score_tolerating_timeouts
from mlperf_grpo.train.trajectories import trajectory_rewards


@dataclass(frozen=True)
class StepScorer:
    """Scores a step's samples (a :data:`~mlperf_grpo.train.async_rollout.Scorer`): the rows
    this tensor-parallel rank (``tp_rank`` of ``tp_size``) trains on."""

    reward: RewardFn | str
    max_timeout_share: float
    agentic: bool
    tp_rank: int
    tp_size: int
    generations_per_prompt: int

    def __call__(self, tasks: list[Task], samples: list[list], cancel: threading.Event) -> tuple[torch.Tensor, int]:
        """``(rewards [P/T, G] float, timeouts)`` of this rank's rows
        (:func:`~mlperf_grpo.inference.tensor_parallel.rank_share` of the group's ``P``
        prompts). Agent trajectories carry the reward graded in their sandboxes; completions
        are scored by ``reward`` in the reward workers, a timeout scoring 0 up to
        ``max_timeout_share`` (:func:`~mlperf_grpo.tasks.scoring.score_tolerating_timeouts`),
        stopped when ``cancel`` is set.

        Raises:
            VerifierError, RewardValueError, ScoringCancelled: as ``score_tolerating_timeouts``.
        """
        mine = rank_share(len(tasks), self.tp_rank, self.tp_size)
        tasks, samples = tasks[mine], samples[mine]
        if self.agentic:  # graded in each trajectory's sandbox, under its own time limits
            return trajectory_rewards(samples), 0
        scored, timeouts = score_tolerating_timeouts(
            self.reward, [(c.text, t) for t, group in zip(tasks, samples) for c in group], self.max_timeout_share,
            cancel=cancel)
        return torch.tensor(scored).view(len(tasks), self.generations_per_prompt), timeouts
