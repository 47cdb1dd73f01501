"""Rollouts: prompts -> completions -> rewards -> one padded training batch."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from mlperf_grpo.agent.trajectory import Trajectory
from mlperf_grpo.inference.base import Completion, InferenceEngine, SamplingParams, completion_length, derive_seed
from mlperf_grpo.tasks import Task


class PromptSampler:
    """Draws prompts for each step: shuffled passes over the pool, seeded, no repeats
    within a pass; with ``shuffle`` False, passes in row order (the benchmark's
    software-repair rows are a curriculum, not shuffled)."""

    def __init__(self, tasks: list[Task], seed: int, shuffle: bool = True) -> None:
        self._tasks = list(tasks)
        self._rng = random.Random(seed)
        self._shuffle = shuffle
        self._order: list[Task] = []

    def sample(self, num_prompts: int) -> list[Task]:
        """The next ``num_prompts`` tasks of the current shuffled pass (a new pass starts
        when one runs out)."""
        out = []
        while len(out) < num_prompts:
            if not self._order:  # popped from the end
                self._order = self._rng.sample(self._tasks, len(self._tasks)) if self._shuffle else self._tasks[::-1]
            out.append(self._order.pop())
        return out


@dataclass
class RolloutBatch:
    """A global batch ready for the loss. ``B = prompts * generations``, ``L`` = longest
    prompt + completion.

    ``input_ids``/``attention_mask``: ``[B, L]`` right-padded sequences.
    ``completion_mask``: ``[B, L-1]`` 1 where ``input_ids[:, 1:]`` is a completion token.
    ``rollout_logprobs``: ``[B, L-1]`` rollout-policy log-probs at those positions.
    ``advantages``: ``[B]``. ``rewards``: ``[P, G]``.
    ``sample_mask``: ``[B]`` float, 1 for a completion the loss trains on, 0 for one it
    leaves out (the overlong filter): NeMo-RL's ``loss_multiplier``/``sample_mask``, which
    multiplies ``completion_mask`` in the loss and in the valid-token count.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    sample_mask: torch.Tensor

    @property
    def loss_mask(self) -> torch.Tensor:
        """``[B, L-1]`` float: ``completion_mask`` of the completions ``sample_mask`` keeps."""
        return self.completion_mask * self.sample_mask.unsqueeze(1)

    @property
    def num_tokens(self) -> int:
        """Valid completion tokens in the global batch (the loss normalizer): those of
        :attr:`loss_mask`."""
        return int(self.loss_mask.sum().item())

    def micro_batch_spans(self, micro_batch_size: int, width_multiple: int = 1) -> list[tuple[slice, int]]:
        """``(rows, width)`` per micro-batch, in row order: ``rows`` is the slice of
        ``micro_batch_size`` rows, ``width`` the longest sequence among them rounded up to
        a multiple of ``width_multiple`` (at most ``L``). Rows are right-padded, so
        ``input_ids[rows, :width]`` (and ``[rows, :width - 1]`` of the shifted tensors)
        drops only padding: a micro-batch is padded to its own longest row, not the
        global batch's."""
        lengths = self.attention_mask.sum(dim=1)  # [B]
        spans = []
        for start in range(0, lengths.shape[0], micro_batch_size):
            rows = slice(start, start + micro_batch_size)
            width = -(-int(lengths[rows].max()) // width_multiple) * width_multiple
            spans.append((rows, min(width, self.input_ids.shape[1])))
        return spans

    def padded_to_multiple(self, multiple: int) -> RolloutBatch:
        """This batch with ``L`` right-padded to a multiple of ``multiple`` (padding
        columns: token 0, attention, completion mask and log-probs 0), so that every
        :meth:`micro_batch_spans` width can be a multiple of it. ``self`` when it is one."""
        extra = -self.input_ids.shape[1] % multiple
        if extra == 0:
            return self
        pad = torch.nn.functional.pad
        return RolloutBatch(
            input_ids=pad(self.input_ids, (0, extra)), attention_mask=pad(self.attention_mask, (0, extra)),
            completion_mask=pad(self.completion_mask, (0, extra)), rollout_logprobs=pad(self.rollout_logprobs, (0, extra)),
            advantages=self.advantages, rewards=self.rewards, sample_mask=self.sample_mask,
        )


    def first_completion_column(self, rows: slice | list[int]) -> int:
        """The first column of ``completion_mask[rows]`` holding a completion token in any
        of these rows (0 when none does). The loss needs logits from this position of the
        micro-batch on: the earlier ones only predict prompt tokens."""
        columns = self.completion_mask[rows].any(dim=0).nonzero()  # [n, 1]
        return int(columns[0, 0]) if len(columns) else 0


def generate_rollouts(
    engine: InferenceEngine, tasks: list[Task], generations_per_prompt: int, params: SamplingParams, seed: int, step: int,
    first_prompt_index: int = 0,
) -> list[list[Completion]]:
    """``generations_per_prompt`` completions of each task: ``[P][G]``.

    Completion ``j`` of the ``i``-th prompt of ``step`` is sampled with
    ``derive_seed("rollout", seed, step, i, j)``; ``tasks[k]`` is prompt
    ``i = first_prompt_index + k`` of the step (a rank's share starts past the others').
    """
    g = generations_per_prompt
    prompts = [t.prompt for t in tasks for _ in range(g)]
    seeds = [derive_seed("rollout", seed, step, first_prompt_index + i, j) for i in range(len(tasks)) for j in range(g)]
    flat = engine.generate(prompts, params, seeds)
    return [flat[i * g:(i + 1) * g] for i in range(len(tasks))]


def truncated_completions(completions: list[list[Completion]], eos_token_ids: list[int]) -> torch.Tensor:
    """``[P, G]`` bool: True where a completion is truncated, i.e. holds none of
    ``eos_token_ids`` (the engine's end-of-sequence ids).

    The engines keep the EOS token of a completion that stopped by itself, so one without
    any hit the length limit (``max_new_tokens``, or vLLM's ``max_model_len``): the
    reference's ``truncated`` ("hit max_tokens without a stop token", NeMo-RL
    ``experience/rollout_manager.py``). No EOS ids: every completion is truncated.
    """
    ends = set(eos_token_ids)
    return torch.tensor([[not ends.intersection(c.token_ids) for c in group] for group in completions])


def build_batch(
    completions: list[list[Completion | Trajectory]], rewards: torch.Tensor, advantages: torch.Tensor, pad_token_id: int,
    eos_token_ids: list[int], sample_mask: torch.Tensor | None = None,
) -> RolloutBatch:
    """Pack ``[P][G]`` completions with their ``[P, G]`` rewards and advantages, and the
    ``[P, G]`` ``sample_mask`` (1 = trained on; default all 1; see :class:`RolloutBatch`).

    A completion ends at the first of any of ``eos_token_ids`` (the engine's: the
    tokenizer's and the generation config's), that token included: anything an engine
    returned after it is neither trained on nor attended to. An agent trajectory
    (:class:`~mlperf_grpo.agent.trajectory.Trajectory`: many turns, each ending with an
    EOS id) is one row whole: its ``completion_mask`` is 1 exactly on the tokens the engine
    sampled (``sampled_mask``), 0 on the environment's and the chat template's.
    """
    flat = [c for group in completions for c in group]
    lengths = [len(c.token_ids) if isinstance(c, Trajectory) else completion_length(c.token_ids, eos_token_ids)
               for c in flat]  # [B]
    width = max(len(c.prompt_token_ids) + t for c, t in zip(flat, lengths))
    b = len(flat)
    input_ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((b, width), dtype=torch.long)
    completion_mask = torch.zeros((b, width - 1), dtype=torch.float32)
    rollout_logprobs = torch.zeros((b, width - 1), dtype=torch.float32)
    for i, (c, t) in enumerate(zip(flat, lengths)):
        p = len(c.prompt_token_ids)
        input_ids[i, : p + t] = torch.tensor(c.prompt_token_ids + c.token_ids[:t])
        attention_mask[i, : p + t] = 1
        # Token at sequence position p+j is predicted at position p+j-1 of the shifted view.
        completion_mask[i, p - 1: p - 1 + t] = torch.tensor(c.sampled_mask, dtype=torch.float32) if isinstance(
            c, Trajectory) else 1
        rollout_logprobs[i, p - 1: p - 1 + t] = torch.tensor(c.logprobs[:t])
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        completion_mask=completion_mask,
        rollout_logprobs=rollout_logprobs,
        advantages=advantages.reshape(-1).float(),
        rewards=rewards,
        sample_mask=torch.ones(b) if sample_mask is None else sample_mask.reshape(-1).float(),
    )
