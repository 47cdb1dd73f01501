"""The small interface every generation engine implements, and what engines share
(completion ends, seeds); :mod:`~mlperf_grpo.inference.factory` builds one."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Union

import torch
from transformers import PreTrainedTokenizerBase


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


Weights = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]
"""What a refit takes: a state dict, or ``(name, tensor)`` pairs produced one at a time
(a sharded policy's parameters, each gathered only when its turn comes:
:func:`~mlperf_grpo.train.fsdp.policy_weights`). Names as in the policy's
``state_dict``; any dtype and device."""


def weight_pairs(weights: Weights) -> Iterable[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of :data:`Weights`, in their order (a state dict's items)."""
    return weights.items() if isinstance(weights, Mapping) else weights


class InferenceEngine(Protocol):
    """A generation engine kept alive across refits.

    ``tokenizer`` is the model's Hugging Face tokenizer (``pad_token_id`` builds the
    training batch); ``dtype`` is the dtype the engine holds the weights in; ``device``
    where it computes; ``eos_token_ids`` every id that ends a completion
    (:func:`eos_token_ids`).
    """

    tokenizer: PreTrainedTokenizerBase
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: list[int]
    tp_size: int
    """T: the ranks one engine's weights are split over (tensor parallel; 1: the whole
    model here, or an engine that splits it in its own processes, vLLM)."""
    tp_rank: int
    """This process's rank in its tensor-parallel group, 0 .. T - 1."""
    tp_group: torch.distributed.ProcessGroup | None
    """The tensor-parallel group's process group; None when ``tp_size == 1``."""

    def load_weights(self, weights: Weights) -> None:
        """Refit: copy these weights in place; the one refit entry for weights in memory
        (the trainer's policy, sharded or not, and the evaluator's verified reads). Each
        tensor is the full one or, at ``tp_size > 1``, exactly this rank's slice
        (the shape of ``full[weight_slices()[name]]``).

        Raises:
            ValueError: a weight is missing, unknown to the engine, or of another shape.
        """

    def weights(self) -> dict[str, torch.Tensor] | None:
        """The engine's own weights by policy name, in its dtype on its device, without a
        copy (what a checkpoint stores after a refit), or None where the engine cannot
        hand them out (vLLM repacks them into kernel formats)."""

    def weight_slices(self) -> dict[str, tuple[slice, ...]] | None:
        """For each tensor of :meth:`weights`, the index into the full tensor of what this
        rank holds (``weights()[name] == full[weight_slices()[name]]``; whole slices for
        replicated tensors and at ``tp_size == 1``); None where :meth:`weights` is None."""

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every full tensor, one at a time in sorted name order: at ``tp_size > 1`` a
        collective over ``tp_group`` (every rank of the group iterates it to the end), at
        ``tp_size == 1`` :meth:`weights`' items, no communication.

        Raises:
            NotImplementedError: the engine cannot hand its weights out (vLLM).
        """

    def load_checkpoint(self, directory: Path) -> None:
        """Refit in place from the ``*.safetensors`` files of a ``step_N/`` directory."""

    def generate(self, prompts: list[str], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        """One completion per prompt, in prompt order (repeat a prompt for more).

        Row ``i`` is sampled with its own RNG seeded by ``seeds[i]``, so the same prompt,
        seed and weights give the same completion whatever else is in the batch.
        """

    def generate_ids(self, prompt_token_ids: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        """:meth:`generate` for prompts given as token ids (unpadded), used as they are: the
        agent's conversations (``agent/loop.py``), never re-tokenised between turns."""

    def weights_fingerprint(self, names: list[str]) -> str:
        """:func:`~mlperf_grpo.model.fingerprint.weights_fingerprint` of the engine's tensors
        with these names (policy names), in the engine's dtype."""

    def canary_logits(self) -> list[float]:
        """The engine's logits on the fixed canary input (see ``model/fingerprint.py``), or
        their log-softmax when ``canary_is_log_softmax`` (an engine without raw logits)."""

    canary_is_log_softmax: bool

    def describe(self) -> dict:
        """Engine settings stored with evaluation results (for reproducing them)."""

    def generation_stats(self) -> dict[str, int | float]:
        """Counts of the last :meth:`generate` call where the engine keeps them (the
        ``hf`` slot decoder: ``decode_steps``, ``rerun_steps``, ``graph_captures``,
        ``prefills``, ``prefill_ms``, ``cache_grows``, ``preempted``, ``kv_cache_peak_bytes``;
        ``{}`` elsewhere), for ``eval/timing.jsonl``. Informational only."""

    def release_memory(self) -> None:
        """Free the generation's device memory (KV cache, graphs) until the next
        :meth:`generate`, keeping the weights: the ``hf`` slot decoder's; vLLM keeps its
        own share (``inference.gpu_memory_utilization``)."""

    def close(self) -> None:
        """Release what garbage collection does not (vLLM: its engine core and
        process-wide distributed state); the engine is unusable afterwards."""


def eos_token_ids(tokenizer: PreTrainedTokenizerBase | None, generation_config: object | None) -> list[int]:
    """Every id that ends a completion: the tokenizer's ``eos_token_id`` first, then each
    id of the generation config's ``eos_token_id`` (an int or a list: Qwen3 lists
    ``<|im_end|>`` and ``<|endoftext|>``), without repeats. What ``transformers``'
    ``generate`` stops at (it takes the generation config's list; the tokenizer's EOS is
    added here because completions are cut at it). Empty when neither names one.

    Args:
        tokenizer: the model's tokenizer, or None.
        generation_config: a ``transformers.GenerationConfig`` (or anything with an
            ``eos_token_id`` attribute), or None.
    """
    ids: list[int] = []
    for source in (tokenizer, generation_config):
        value = getattr(source, "eos_token_id", None)
        for token_id in value if isinstance(value, (list, tuple)) else [value]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return ids


def completion_length(token_ids: list[int], eos_ids: list[int]) -> int:
    """How many of ``token_ids`` belong to the completion: up to and including the first
    id in ``eos_ids``, else all of them (cut by ``max_new_tokens``)."""
    ends = set(eos_ids)
    return next((i + 1 for i, t in enumerate(token_ids) if t in ends), len(token_ids))


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any values (e.g. run seed, task id, generation index):
    the first 8 bytes of sha256 of their ``repr``, stable across processes."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1
