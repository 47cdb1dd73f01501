"""Token log-probabilities (and entropy) of a causal LM without its whole micro-batch's logits.

A Hugging Face causal LM ends in ``logits = lm_head(hidden)``: ``[tokens, V]``, which at
a real vocabulary (Qwen3's 151,936) and 64k tokens is 40 GB in float32 before autograd's
copies. :func:`policy_token_logprobs` swaps the policy's ``lm_head`` for a
:class:`LogprobHead` for one forward call: the head takes the last hidden states and
returns, per position, the log-probability of its target token (and the entropy),
computing ``lm_head`` and ``log_softmax`` over at most ``chunk_tokens`` positions at a
time (:func:`chunked_token_stats`). Each chunk is checkpointed
(``torch.utils.checkpoint``, non-reentrant): the forward keeps only the chunk's hidden
states and the ``[chunk]`` results, the backward recomputes the chunk's logits, so the
peak is a few ``[chunk, V]`` float32 tensors whatever the sequence length.

The swap keeps everything else of the model's forward (``logits_to_keep``, autocast, an
FSDP2 root's all-gather of ``lm_head.weight`` around the forward and the backward: the
head reads the weight of the wrapped ``nn.Linear`` when it runs). A micro-batch of at
most ``chunk_tokens`` positions is computed in one piece without a checkpoint, exactly as
``train.grpo.token_logprobs`` of ``lm_head``'s logits: the same bits as before at short
sequences, and no recomputation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils.checkpoint import checkpoint

from mlperf_grpo.model.attention import planless_attention
from mlperf_grpo.model.compile import compile_dynamic

LOGITS_CHUNK_BYTES = 1 << 30
"""Float32 logits of one chunk: ``chunk_tokens = LOGITS_CHUNK_BYTES // (4 V)`` (1 GiB:
1,766 positions at V = 151,936). The backward holds about 3 such tensors at once
(the recomputed logits, their log-softmax and its gradient)."""


def chunk_tokens_for(vocab_size: int, chunk_bytes: int = LOGITS_CHUNK_BYTES) -> int:
    """Positions per chunk so that one chunk's float32 logits take at most ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * vocab_size))


def _token_stats(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                 temperature: float, with_entropy: bool | str) -> tuple[torch.Tensor, ...]:
    """``(logp, [entropy])`` of ``targets`` ``[n]`` under ``softmax(linear(hidden) / temperature)``,
    float32 ``[n]`` each; ``hidden`` ``[n, H]``. The linear runs in the ambient autocast dtype.
    ``with_entropy`` ``"detached"``: the entropy without gradient (nothing of it in the backward)."""
    logits = torch.nn.functional.linear(hidden, weight, bias)  # [n, V]
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # [n, V]
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [n]
    if not with_entropy:
        return (logp,)
    if with_entropy == "detached":
        with torch.no_grad():
            return logp, -(logp_all.exp() * logp_all).sum(dim=-1)
    return logp, -(logp_all.exp() * logp_all).sum(dim=-1)  # H = -sum_v p_v log p_v


_COMPILED: list = []


def _stats_function(compiled: bool):
    """:func:`_token_stats`, or it under ``torch.compile`` (dynamic shapes; compiled once a
    process): the log-softmax, the gather and the entropy fused into a few kernels."""
    if not compiled:
        return _token_stats
    if not _COMPILED:
        _COMPILED.append(compile_dynamic(_token_stats))
    return _COMPILED[0]


def chunked_token_stats(hidden: torch.Tensor, linear: torch.nn.Linear, targets: torch.Tensor, temperature: float,
                        chunk_tokens: int, with_entropy: bool | str = False,
                        compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of ``targets`` under ``softmax(linear(hidden) / temperature)``.

    Args:
        hidden: ``[..., H]`` last hidden states.
        linear: the output projection (``lm_head``), ``V x H``.
        targets: ``[...]`` token ids, one per position of ``hidden``.
        chunk_tokens: positions per chunk; more than this many are computed a chunk at a
            time, each checkpointed (recomputed in the backward).
        with_entropy: also the entropy ``-sum_v p_v log p_v`` of each position's distribution
            (``"detached"``: without gradient).
        compiled: each chunk's head, log-softmax, gather and entropy under ``torch.compile``.
    Returns:
        ``(logp, entropy)``: float32 ``[...]``; ``entropy`` None without ``with_entropy``.
    """
    shape = targets.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    flat_targets = targets.reshape(-1)  # [N]
    n = flat_targets.shape[0]
    args = (linear.weight, linear.bias)
    stats = _stats_function(compiled)
    if n <= chunk_tokens:
        parts = [stats(flat_hidden, *args, flat_targets, temperature, with_entropy)]
    else:
        parts = [checkpoint(stats, flat_hidden[i:i + chunk_tokens], *args, flat_targets[i:i + chunk_tokens],
                            temperature, with_entropy, use_reentrant=False)
                 for i in range(0, n, chunk_tokens)]
    if len(parts) == 1:  # no copy
        logp, entropy = parts[0][0].view(shape), parts[0][1].view(shape) if with_entropy else None
        return logp, entropy
    logp = torch.cat([p[0] for p in parts]).view(shape)
    entropy = torch.cat([p[1] for p in parts]).view(shape) if with_entropy else None
    return logp, entropy


class LogprobHead(torch.nn.Module):
    """Stands in for a causal LM's ``lm_head`` during one forward call
    (:func:`policy_token_logprobs`): returns ``[..., 1]`` log-probs of :attr:`targets`
    instead of ``[..., V]`` logits, and keeps the entropy of each position in
    :attr:`entropy` (with ``with_entropy``; None otherwise)."""

    def __init__(self, linear: torch.nn.Linear, targets: torch.Tensor, temperature: float, chunk_tokens: int,
                 with_entropy: bool | str, compiled: bool = False) -> None:
        super().__init__()
        self.linear = linear
        self.targets, self.temperature, self.chunk_tokens, self.with_entropy, self.compiled = (
            targets, temperature, chunk_tokens, with_entropy, compiled)
        self.entropy: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:-1] != self.targets.shape:
            raise ValueError(f"the head got hidden states {tuple(hidden.shape)} for targets {tuple(self.targets.shape)}")
        logp, self.entropy = chunked_token_stats(hidden, self.linear, self.targets, self.temperature,
                                                 self.chunk_tokens, self.with_entropy, self.compiled)
        return logp.unsqueeze(-1)  # its backward a view: no kernel


@contextlib.contextmanager
def _head_swapped(policy: torch.nn.Module, head: LogprobHead) -> Iterator[None]:
    """``policy.lm_head`` is ``head`` inside the block (a plain attribute swap: the
    parameters stay registered on the wrapped ``nn.Linear``)."""
    original = policy.lm_head
    policy.lm_head = head
    try:
        yield
    finally:
        policy.lm_head = original


def policy_token_logprobs(
    policy: torch.nn.Module, targets: torch.Tensor, temperature: float, chunk_tokens: int,
    with_entropy: bool | str = False, compiled: bool = False, **inputs: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``policy(**inputs)``'s log-probs of ``targets`` (and entropy), never its full logits.

    Args:
        policy: a Hugging Face causal LM with an ``lm_head`` ``nn.Linear`` (FSDP2-wrapped or not).
        targets: token ids shaped as the positions ``lm_head`` sees: ``[B, k]`` for
            ``logits_to_keep=k`` (``[B, T]`` for 0) or a 1-D tensor of ``k`` positions.
        temperature: the log-probs are of ``softmax(logits / temperature)``.
        chunk_tokens: see :func:`chunked_token_stats` (:func:`chunk_tokens_for`).
        with_entropy, compiled: see :func:`chunked_token_stats`.
        inputs: the forward's keyword arguments (``input_ids``, ``attention_mask``,
            ``position_ids``, ``logits_to_keep``).
    Returns:
        ``(logp, entropy)`` float32 shaped as ``targets``; ``entropy`` None without ``with_entropy``.
    Raises:
        ValueError: the policy has no ``lm_head`` linear layer, or ``targets`` does not
            match the positions it scores.
    """
    linear = getattr(policy, "lm_head", None)
    if not isinstance(linear, torch.nn.Linear):
        raise ValueError(f"{type(policy).__name__} has no lm_head linear layer to score tokens with")
    head = LogprobHead(linear, targets, temperature, chunk_tokens, with_entropy, compiled)
    with _head_swapped(policy, head), planless_attention():  # widths vary: no cuDNN plans
        out = policy(**inputs).logits  # [..., 1]
    return out.squeeze(-1), head.entropy
