"""The loss of one micro-batch pass and the figures it adds to the step's, in one function a
compiled policy runs compiled.

Eager, the loss of the reference algorithm (forced ratio, IS weights with ``seq-mask-tis``,
the log-prob error filter) and its counts are some 70 elementwise operations and as many
again in the backward, each a kernel launch on a GPU; ``torch.compile`` fuses them into a
few (:func:`loss_function`). The math is :func:`~mlperf_grpo.train.grpo.clipped_pg_loss_sum`
and :func:`~mlperf_grpo.train.grpo.seq_logprob_error_keep`, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mlperf_grpo.model.compile import compile_dynamic
from mlperf_grpo.train.grpo import PGLossOptions, clipped_pg_loss_sum, seq_logprob_error_keep

STATS = ("loss", "importance_weight_sum", "masked_by_is", "masked_by_error", "tokens", "sequences", "entropy_sum")
"""The entries of :func:`pass_loss`'s ``stats``, in order."""


@dataclass(frozen=True)
class PassLossSettings:
    """What :func:`pass_loss` needs of :class:`~mlperf_grpo.train.optimize.OptimizeSettings`."""

    options: PGLossOptions
    seq_logprob_error_threshold: float | None
    needs_prev_logprobs: bool


def pass_loss(curr: torch.Tensor, entropy: torch.Tensor, generation: torch.Tensor, mask: torch.Tensor,
              kept: torch.Tensor, advantages: torch.Tensor, divisor: torch.Tensor,
              settings: PassLossSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, stats)`` of one pass: ``curr`` ``[mb, T]`` log-probs with gradient,
    ``entropy`` ``[mb, T]`` (no gradient; both may hold more columns, left out), ``generation`` ``[mb, T]`` the engine's
    log-probs, ``mask`` ``[mb, T]`` the loss mask, ``kept`` ``[mb]`` the sample mask,
    ``advantages`` ``[mb]``, ``divisor`` a 0-d float32 tensor (the step's valid tokens,
    1 with the filter: the summed gradient is divided after the last pass).

    ``prev`` is ``sg(curr)`` with ``needs_prev_logprobs``, else None under
    ``force_on_policy_ratio``, else ``generation``; with ``seq_logprob_error_threshold``
    the rows the filter drops leave ``mask`` and ``kept`` first. ``loss``: the clipped
    policy-gradient sum over ``mask`` divided by ``divisor`` (with gradient). ``stats``:
    float64 ``[7]`` detached, named by :data:`STATS`: ``loss``, the IS weights' sum, the
    rows ``seq-mask-tis`` and the filter dropped, the tokens and rows left, and the sum of
    ``entropy`` over the mask left.
    """
    width = mask.shape[1]
    curr, entropy = curr[:, :width], entropy[:, :width]  # the slice's backward fused with the rest
    options = settings.options
    prev = curr.detach() if settings.needs_prev_logprobs else None if options.force_on_policy_ratio else generation
    masked_by_error = torch.zeros((), device=curr.device)
    if settings.seq_logprob_error_threshold is not None:
        keep, _ = seq_logprob_error_keep(prev, generation, mask, settings.seq_logprob_error_threshold)
        masked_by_error = ((keep == 0) & (mask.sum(dim=-1) > 0)).sum()
        mask = mask * keep.unsqueeze(1)
        kept = kept * keep
    part = clipped_pg_loss_sum(curr, prev, generation, advantages, mask, options)
    loss = part.loss / divisor
    stats = torch.stack([loss.detach().double(), part.importance_weight_sum.double(),
                         part.num_sequences_masked_by_is.double(), masked_by_error.double(), mask.sum().double(),
                         kept.sum().double(), (entropy.detach() * mask).sum().double()])
    return loss, stats


_COMPILED: list[Callable] = []


def loss_function(compiled: bool) -> Callable:
    """:func:`pass_loss`, or it under ``torch.compile`` (dynamic shapes: passes differ in
    rows and width; compiled once a process, at its first call)."""
    if not compiled:
        return pass_loss
    if not _COMPILED:
        _COMPILED.append(compile_dynamic(pass_loss))
    return _COMPILED[0]
