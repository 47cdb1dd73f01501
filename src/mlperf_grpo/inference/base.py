"""The small interface every generation engine implements."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: ``temperature`` > 0, ``top_p`` in (0, 1], ``max_new_tokens`` > 0."""

    temperature: float
    top_p: float
    max_new_tokens: int


@dataclass(frozen=True)
class Completion:
    """One sampled completion of one prompt.

    ``prompt_token_ids`` and ``token_ids`` are unpadded; ``token_ids`` ends with EOS when
    the model stopped by itself. ``logprobs[i]`` is the log-probability (natural log) of
    ``token_ids[i]`` under the sampling distribution ``softmax(logits / temperature)``
    before top-p truncation, the rollout policy's log-probability used by the GRPO
    importance ratio. ``text`` is decoded without special tokens.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str


class InferenceEngine(Protocol):
    """A generation engine kept alive across refits."""

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Refit: copy these weights (names as in the policy's ``state_dict``) in place."""

    def generate(self, prompts: list[str], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        """One completion per prompt, in prompt order (repeat a prompt for more).

        Row ``i`` is sampled with its own RNG seeded by ``seeds[i]``, so the same prompt,
        seed and weights give the same completion whatever else is in the batch.
        """


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any values (e.g. run seed, task id, generation index):
    the first 8 bytes of sha256 of their ``repr``, stable across processes."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1
