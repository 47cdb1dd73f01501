"""GRPO math as pure tensor functions: group-normalized advantages and the clipped loss.

Source: Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), section 4.1 (GRPO,
outcome supervision), with the token-level mean over the global batch of Yu et al.
2025, "DAPO" (arXiv:2503.14476), as NeMo-RL's ``ClippedPGLossFn`` computes it with
``token_level_loss=True``. No KL penalty (beta = 0).
"""

from __future__ import annotations

import torch

ADVANTAGE_EPS = 1e-6

FLAT_GROUP_RELATIVE_STD = 1e-6
"""A group whose reward standard deviation is at most this fraction of its largest
absolute reward counts as flat: its spread is rounding noise (float32 keeps about 7
significant digits), not signal, and every member gets advantage 0."""


def group_advantages(rewards: torch.Tensor, eps: float = ADVANTAGE_EPS) -> torch.Tensor:
    """Group-normalized advantages ``A_ij = (r_ij - mean_j r_ij) / (std_j r_ij + eps)``.

    Computed in float64. A *flat* group gets advantage 0 for every member, exactly: one
    whose rewards are all equal, or whose standard deviation is at most
    :data:`FLAT_GROUP_RELATIVE_STD` times its largest absolute reward (rounding noise:
    the mean of 16 equal float32 rewards of 0.35 is not exactly 0.35, and without this
    rule the tiny std it leaves would pass the ``eps`` guard and give every member
    +0.029; 16 x 1000.1 gave -0.953).

    Args:
        rewards: ``[P, G]`` float, one row per prompt, one column per generation.
        eps: added to the standard deviation (guards tiny but real spreads).
    Returns:
        ``[P, G]`` float32 advantages.
    Raises:
        ValueError: ``rewards`` is not 2-D or has fewer than 2 generations per prompt.
    Source: DeepSeekMath eq. for outcome supervision; std is the unbiased sample
    standard deviation (``torch.std``, as TRL's ``GRPOTrainer``).
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [prompts, generations>=2], got shape {tuple(rewards.shape)}")
    rewards = rewards.double()  # [P, G]
    mean = rewards.mean(dim=1, keepdim=True)  # [P, 1]
    std = rewards.std(dim=1, keepdim=True)  # [P, 1]
    scale = rewards.abs().amax(dim=1, keepdim=True)  # [P, 1]
    all_equal = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)  # [P, 1]
    flat = all_equal | (std <= FLAT_GROUP_RELATIVE_STD * scale)  # [P, 1]
    advantages = (rewards - mean) / (std + eps)
    return torch.where(flat, torch.zeros_like(advantages), advantages).float()


def clipped_pg_loss_sum(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
) -> torch.Tensor:
    """Sum over valid tokens of the clipped policy-gradient surrogate (to be minimized).

    For each completion token t with advantage A (its completion's) and importance
    ratio ``rho_t = exp(logprobs_t - rollout_logprobs_t)``::

        loss_t = -min(rho_t * A, clip(rho_t, 1 - clip_eps, 1 + clip_eps) * A)

    The caller divides the sum by the number of valid tokens in the whole global batch,
    so gradient accumulation over micro-batches gives the token-level mean exactly.

    Args:
        logprobs: ``[B, T]`` current policy log-probs of the sampled tokens (with grad).
        rollout_logprobs: ``[B, T]`` log-probs under the rollout policy (no grad).
        advantages: ``[B]`` one advantage per completion.
        mask: ``[B, T]`` 1 for completion tokens, 0 for padding.
        clip_eps: PPO clip range (0.2 in PPO, Schulman et al. 2017).
    Returns:
        A scalar tensor.
    """
    ratio = torch.exp(logprobs - rollout_logprobs)
    adv = advantages.unsqueeze(1)  # [B, 1]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    return (per_token * mask).sum()


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
