"""GRPO math as pure tensor functions: advantages, the clipped loss and its corrections.

Sources: Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), section 4.1 (GRPO,
outcome supervision); the token-level mean and asymmetric ("clip-higher") ratio clip of
Yu et al. 2025, "DAPO" (arXiv:2503.14476); and the reference implementation of this
benchmark, NVIDIA NeMo-RL ``ClippedPGLossFn`` (``nemo_rl/algorithms/loss/loss_functions.py``)
and ``compute_and_apply_seq_logprob_error_masking`` (``nemo_rl/algorithms/grpo.py``) on
branch ``mlperf-training-qwen35-main``, read, not copied. No KL penalty (beta = 0).

Three log-probabilities of each sampled token enter the loss (all ``[B, T]``, natural log,
at the rollout temperature):

- ``curr``: the training policy's, with gradient, in the optimizer step's forward pass.
- ``generation``: the generation engine's, returned with the rollout. With
  ``max_trajectory_age_steps: 1`` the engine may hold the weights of one step earlier.
- ``prev``: the training policy's *before* the update. NeMo-RL computes it with a separate
  no-grad forward pass; with ``force_on_policy_ratio`` its loss uses ``curr.detach()``
  instead (equal in value: one update per rollout), and the separate pass only feeds the
  sequence log-prob error mask (:func:`seq_logprob_error_keep`). Our trainer takes
  ``prev = curr.detach()`` from the loss pass itself (``train.optimize.optimize_step``): the
  same weights, so the same values up to kernel numerics, without the second pass.

The PPO ratio is ``curr / prev``; the importance-sampling (IS) weight that corrects for
the engine is ``prev / generation``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

ADVANTAGE_EPS = 1e-6
MASKED_MEAN_EPS = 1e-8
"""Added to the denominator of a per-sequence masked mean, as NeMo-RL's ``masked_mean``."""

TruncatedISType = Literal["seq-mask-tis"]

FLAT_GROUP_RELATIVE_STD = 1e-6
"""A group whose reward standard deviation is at most this fraction of its largest
absolute reward counts as flat: its spread is rounding noise (float32 keeps about 7
significant digits), not signal, and every member gets advantage 0."""


def group_advantages(
    rewards: torch.Tensor,
    eps: float = ADVANTAGE_EPS,
    leave_one_out_baseline: bool = False,
    normalize_rewards: bool = True,
) -> torch.Tensor:
    """GRPO advantages ``A_ij = (r_ij - b_ij) / (s_ij + eps)`` of each prompt's group.

    ``b_ij``/``s_ij``: the group's mean and unbiased standard deviation, or with
    ``leave_one_out_baseline`` (RLOO, Ahmadian et al. 2024, arXiv:2402.14740) the mean and
    unbiased standard deviation of the *other* ``G - 1`` rewards of the group. Without
    ``normalize_rewards``, ``A_ij = r_ij - b_ij``. Where ``s_ij`` is 0 (with leave-one-out:
    the others are all equal, or ``G = 2``, one other, whose Bessel-corrected std is 0/0)
    the advantage is left unnormalised, ``r_ij - b_ij``, as the reference's "don't sharpen
    the ones with no variation".

    Computed in float64. A *flat* group gets advantage 0 for every member, exactly: one
    whose rewards are all equal, or whose standard deviation is at most
    :data:`FLAT_GROUP_RELATIVE_STD` times its largest absolute reward (rounding noise:
    the mean of 16 equal float32 rewards of 0.35 is not exactly 0.35, and without this
    rule the tiny std it leaves would pass the ``eps`` guard and give every member
    +0.029; 16 x 1000.1 gave -0.953). With leave-one-out the same rule makes ``s_ij`` 0
    for a set of others that is flat.

    Args:
        rewards: ``[P, G]`` float, one row per prompt, one column per generation.
        eps: added to the standard deviation (guards tiny but real spreads).
        leave_one_out_baseline: the recipe's ``grpo.use_leave_one_out_baseline``.
        normalize_rewards: the recipe's ``grpo.normalize_rewards``.
    Returns:
        ``[P, G]`` float32 advantages.
    Raises:
        ValueError: ``rewards`` is not 2-D or has fewer than 2 generations per prompt.
    Source: DeepSeekMath eq. for outcome supervision (std as ``torch.std``, as TRL's
    ``GRPOTrainer``); NeMo-RL ``GRPOAdvantageEstimator.compute_advantage`` and
    ``calculate_baseline_and_std_per_prompt`` (``nemo_rl/algorithms/{advantage_estimator,
    utils}.py``), which the trainer calls with every sample valid. That code takes
    ``sqrt((E[r^2] - E[r]^2) * n / (n - 1))`` over the ``n`` samples (``n = G - 1`` with
    leave-one-out); we take the two-pass form of the same estimator, equal in exact arithmetic.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [prompts, generations>=2], got shape {tuple(rewards.shape)}")
    rewards = rewards.double()  # [P, G]
    if leave_one_out_baseline:
        baseline, std = _leave_one_out_baseline_and_std(rewards)  # [P, G] each
    else:
        baseline = rewards.mean(dim=1, keepdim=True)  # [P, 1]
        std = rewards.std(dim=1, keepdim=True)  # [P, 1]
    flat = _is_flat(rewards, rewards.std(dim=1, keepdim=True), dim=1)  # [P, 1]
    advantages = rewards - baseline  # [P, G]
    if normalize_rewards:
        advantages = torch.where(std > 0, advantages / (std + eps), advantages)
    return torch.where(flat, torch.zeros_like(advantages), advantages).float()


def _is_flat(values: torch.Tensor, std: torch.Tensor, dim: int) -> torch.Tensor:
    """Whether the values along ``dim`` are all equal or their ``std`` is rounding noise
    (at most :data:`FLAT_GROUP_RELATIVE_STD` of their largest magnitude); keeps ``dim``."""
    first = values.narrow(dim, 0, 1)
    all_equal = (values == first).all(dim=dim, keepdim=True)
    scale = values.abs().amax(dim=dim, keepdim=True)
    return all_equal | (std <= FLAT_GROUP_RELATIVE_STD * scale)


def _leave_one_out_baseline_and_std(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample: the mean and unbiased std of the other ``G - 1`` rewards of its group.

    Args:
        rewards: ``[P, G]`` float64, ``G >= 2``.
    Returns:
        ``(baseline, std)``, ``[P, G]`` each; ``std`` is 0 where the others are flat
        (:func:`_is_flat`) or are one sample (``G = 2``).
    """
    p, g = rewards.shape
    others = ~torch.eye(g, dtype=torch.bool, device=rewards.device)  # [G, G]: row i marks j != i
    values = rewards.unsqueeze(1).expand(p, g, g)[:, others].view(p, g, g - 1)  # [P, G, G-1]
    baseline = values.mean(dim=2)  # [P, G]
    if g == 2:
        return baseline, torch.zeros_like(baseline)
    std = values.std(dim=2)  # [P, G], Bessel-corrected over the G - 1 others
    flat = _is_flat(values, std.unsqueeze(2), dim=2).squeeze(2)  # [P, G]
    return baseline, torch.where(flat, torch.zeros_like(std), std)


@dataclass(frozen=True)
class PGLossOptions:
    """The clipped policy-gradient loss's options, named as NeMo-RL's ``loss_fn`` keys.

    ``ratio_clip_min``/``ratio_clip_max``: the PPO ratio is clipped to
    ``[1 - ratio_clip_min, 1 + ratio_clip_max]``. ``force_on_policy_ratio``: the ratio
    is 1 in value (gradient of ``curr`` kept). ``use_importance_sampling_correction``:
    weight each token by ``prev / generation``. ``truncated_importance_sampling_type``
    ``"seq-mask-tis"``: zero the weights of a sequence whose geometric-mean IS ratio lies
    outside ``[truncated_importance_sampling_ratio_min, truncated_importance_sampling_ratio]``.
    """

    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    force_on_policy_ratio: bool = False
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: TruncatedISType | None = None
    truncated_importance_sampling_ratio: float | None = None
    truncated_importance_sampling_ratio_min: float | None = None

    @classmethod
    def of(cls, grpo_config: object) -> "PGLossOptions":
        """The options read from an object with attributes of the same names (``GRPOConfig``)."""
        return cls(**{name: getattr(grpo_config, name) for name in cls.__dataclass_fields__})


def importance_weights(prev_logprobs: torch.Tensor, generation_logprobs: torch.Tensor) -> torch.Tensor:
    """Token-level IS weights ``w_t = exp(prev_t - generation_t)``, NaN/inf -> 0, no grad.

    Args:
        prev_logprobs, generation_logprobs: ``[B, T]`` float.
    Returns:
        ``[B, T]`` float, detached.
    Source: NeMo-RL ``ClippedPGLossFn``, "Off-policy (actor) importance-sampling correction",
    token-level branch (``sequence_level_importance_ratios: false``).
    """
    w = torch.exp(prev_logprobs.detach() - generation_logprobs)
    return torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)


def seq_mask_tis_keep(
    prev_logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    token_mask: torch.Tensor,
    ratio_min: float,
    ratio_max: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which sequences ``seq-mask-tis`` keeps, by their geometric-mean IS ratio.

    ``g_i = exp( sum_t m_it * d_it / (sum_t m_it + 1e-8) )`` with
    ``d_it = nan_to_num(prev_it - generation_it, 0)``; sequence ``i`` is kept when
    ``ratio_min <= g_i <= ratio_max`` (bounds included). A kept sequence keeps its raw,
    untruncated token weights; a dropped one gets weight 0 on every token.

    Args:
        prev_logprobs, generation_logprobs: ``[B, T]`` float.
        token_mask: ``[B, T]`` 1 on completion tokens (the sequence's own tokens; NeMo-RL
            uses ``token_mask`` here, not ``token_mask * sample_mask``).
        ratio_min, ratio_max: the band, 0.999 and 1.002 in the reference recipe.
    Returns:
        ``(keep, geomean)``: ``[B]`` float 0/1 and ``[B]`` float ``g_i``, detached.
    Source: NeMo-RL ``ClippedPGLossFn``, ``truncated_importance_sampling_type == "seq-mask-tis"``.
    """
    diff = torch.nan_to_num(prev_logprobs.detach() - generation_logprobs, nan=0.0, posinf=0.0, neginf=0.0)
    mean_log_ratio = (diff * token_mask).sum(dim=-1) / (token_mask.sum(dim=-1) + MASKED_MEAN_EPS)  # [B]
    geomean = torch.exp(mean_log_ratio)
    keep = ((geomean >= ratio_min) & (geomean <= ratio_max)).float()
    return keep, geomean


def seq_logprob_error_keep(
    prev_logprobs: torch.Tensor, generation_logprobs: torch.Tensor, mask: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which sequences the sequence log-prob error filter keeps (``grpo.seq_logprob_error_threshold``).

    ``e_i = sum_t m_it * exp(m_it * |generation_it - prev_it|) / max(sum_t m_it, 1)``, the
    per-sequence multiplicative probability error; sequence ``i`` is kept when
    ``e_i <= threshold``. A sequence without valid tokens has ``e_i = 0`` (kept).

    Args:
        prev_logprobs: ``[B, T]`` the training policy's before the update (``sg(curr)``).
        generation_logprobs: ``[B, T]`` the engine's.
        mask: ``[B, T]`` ``token_mask * sample_mask``.
        threshold: 2 in the reference recipe.
    Returns:
        ``(keep, error)``: ``[B]`` float 0/1 and ``[B]`` float ``e_i``.
    Source: NeMo-RL ``compute_and_apply_seq_logprob_error_masking`` (``algorithms/grpo.py``);
    its ``keep`` multiplies ``sample_mask`` before the loss.
    """
    lp_error = torch.abs(generation_logprobs - prev_logprobs.detach())
    num_tokens = mask.sum(dim=-1)
    error = (torch.exp(lp_error * mask) * mask).sum(dim=-1) / num_tokens.clamp(min=1)
    error = torch.where(num_tokens > 0, error, torch.zeros_like(error))
    return (error <= threshold).float(), error


def ppo_ratios(
    curr_logprobs: torch.Tensor, prev_logprobs: torch.Tensor | None, options: PGLossOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PPO ratio and its clipped value, ``[B, T]`` each, with gradient through ``curr``.

    ``force_on_policy_ratio``: ``r_t = exp(curr_t - sg(curr_t))`` (value 1, gradient of
    ``curr_t``), not clipped, ``prev_logprobs`` unused. Otherwise ``r_t = exp(curr_t - prev_t)``
    and the clipped ratio is ``clip(r_t, 1 - ratio_clip_min, 1 + ratio_clip_max)``.
    Raises:
        ValueError: ``prev_logprobs`` is None without ``force_on_policy_ratio``.
    Source: NeMo-RL ``ClippedPGLossFn`` ("Calculate clipped loss function"); DAPO for the
    asymmetric clip.
    """
    if options.force_on_policy_ratio:
        ratios = torch.exp(curr_logprobs - curr_logprobs.detach())
        return ratios, ratios
    if prev_logprobs is None:
        raise ValueError("prev_logprobs is required unless force_on_policy_ratio is set")
    ratios = torch.exp(curr_logprobs - prev_logprobs.detach())
    return ratios, ratios.clamp(1.0 - options.ratio_clip_min, 1.0 + options.ratio_clip_max)


@dataclass
class PGLossSum:
    """What :func:`clipped_pg_loss_sum` returns for one micro-batch.

    ``loss``: scalar sum over valid tokens (with grad). ``importance_weight_sum``: the sum
    of the IS weights used, over valid tokens. ``num_sequences_masked_by_is``: sequences
    ``seq-mask-tis`` dropped (0 without it). The last two are detached 0-d tensors on the
    loss's device (float32 and int64): reading them is left to the caller, once per step,
    so a micro-batch loop does not wait for the device.
    """

    loss: torch.Tensor
    importance_weight_sum: torch.Tensor
    num_sequences_masked_by_is: torch.Tensor


def clipped_pg_loss_sum(
    curr_logprobs: torch.Tensor,
    prev_logprobs: torch.Tensor | None,
    generation_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    options: PGLossOptions,
) -> PGLossSum:
    """Sum over valid tokens of the IS-weighted clipped policy-gradient surrogate (minimized).

    For token t of completion i, with advantage ``A_i`` and ratios from :func:`ppo_ratios`::

        loss_t = w_t * max(-A_i * r_t, -A_i * clip(r_t))        (= -w_t * min(r_t A_i, clip(r_t) A_i))

    ``w_t = 1`` without ``use_importance_sampling_correction``; with it
    ``w_t = exp(p_t - generation_t)``, where ``p = sg(curr)`` under
    ``force_on_policy_ratio`` and ``prev`` otherwise, times the ``seq-mask-tis`` keep
    flag of its sequence when that truncation is set. The caller divides the sum by the
    valid-token count of the whole global batch (token-level loss), so gradient
    accumulation over micro-batches gives NeMo-RL's token-level mean exactly.

    Args:
        curr_logprobs: ``[B, T]`` current policy log-probs of the sampled tokens (with grad).
        prev_logprobs: ``[B, T]`` training policy before the update, or None with
            ``force_on_policy_ratio``.
        generation_logprobs: ``[B, T]`` the engine's log-probs from the rollout.
        advantages: ``[B]`` one advantage per completion.
        mask: ``[B, T]`` 1 on completion tokens of kept sequences, 0 elsewhere.
        options: see :class:`PGLossOptions`.
    Returns:
        A :class:`PGLossSum`.
    Source: NeMo-RL ``ClippedPGLossFn.__call__`` with ``token_level_loss: true``,
    ``reference_policy_kl_penalty: 0``, ``ratio_clip_c: null``,
    ``sequence_level_importance_ratios: false``, ``disable_ppo_ratio: false``.
    """
    if options.force_on_policy_ratio:
        prev_logprobs = curr_logprobs.detach()
    ratios, ratios_clamped = ppo_ratios(curr_logprobs, prev_logprobs, options)
    adv = advantages.unsqueeze(1)  # [B, 1]
    per_token = torch.maximum(-adv * ratios, -adv * ratios_clamped)  # [B, T]
    masked = torch.zeros((), dtype=torch.long, device=per_token.device)
    if options.use_importance_sampling_correction:
        weights = importance_weights(prev_logprobs, generation_logprobs)  # [B, T]
        if options.truncated_importance_sampling_type == "seq-mask-tis":
            keep, _ = seq_mask_tis_keep(
                prev_logprobs,
                generation_logprobs,
                (mask > 0).float(),
                options.truncated_importance_sampling_ratio_min,
                options.truncated_importance_sampling_ratio,
            )
            weights = weights * keep.unsqueeze(1)
            masked = ((keep == 0) & (mask.sum(dim=-1) > 0)).sum()
        per_token = weights * per_token
    else:
        weights = torch.ones_like(per_token)
    return PGLossSum(
        loss=(per_token * mask).sum(),
        importance_weight_sum=(weights.detach() * mask).sum(),
        num_sequences_masked_by_is=masked,
    )


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs of ``targets`` under ``softmax(logits / temperature)``.

    Args:
        logits: ``[B, T, V]`` (any float dtype; computed in float32).
        targets: ``[B, T]`` token ids.
    Returns:
        ``[B, T]`` float32.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
