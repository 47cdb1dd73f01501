"""Proof that an engine holds the weights it claims: a tensor fingerprint and a canary.

After every refit the evaluator compares (1) the fingerprint of the engine's
tensors with that of the checkpoint's tensors and (2) the engine's logits on a fixed
canary input with the logits the trainer recorded for that checkpoint when it wrote it.
"""

from __future__ import annotations

import copy

import torch
import xxhash

CANARY_LENGTH = 16
CANARY_LOGITS = 32
"""How many last-position logits are recorded (the first ``CANARY_LOGITS`` of the vocab)."""

CANARY_TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}
"""Max absolute difference allowed per canary logit, relative to ``max(1, |logit|)``."""


def weights_fingerprint(state_dict: dict[str, torch.Tensor]) -> str:
    """Hex xxh3_128 over every tensor's name, dtype, shape and bytes, in name order
    (compared within one process, never stored; a fast hash keeps refits cheap)."""
    digest = xxhash.xxh3_128()
    for name in sorted(state_dict):
        t = state_dict[name].detach().contiguous().cpu()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b"")
    return digest.hexdigest()


def canary_input_ids(vocab_size: int) -> torch.Tensor:
    """``[1, CANARY_LENGTH]`` fixed token ids, every id < ``vocab_size``."""
    return (torch.arange(CANARY_LENGTH) * 7 % vocab_size).unsqueeze(0)


@torch.no_grad()
def canary_logits(model: torch.nn.Module, vocab_size: int) -> list[float]:
    """The model's first ``CANARY_LOGITS`` last-position logits on the canary input."""
    ids = canary_input_ids(vocab_size).to(next(model.parameters()).device)
    logits = model(input_ids=ids).logits[0, -1, :CANARY_LOGITS]
    return [float(x) for x in logits.float()]


@torch.no_grad()
def canary_logits_in_dtype(model: torch.nn.Module, vocab_size: int, dtype: torch.dtype) -> list[float]:
    """:func:`canary_logits` of ``model`` with its parameters cast to ``dtype`` (a copy
    when the dtype differs; buffers such as RoPE frequencies keep theirs, as when the
    model is loaded in ``dtype``): what an HF engine holding those weights records."""
    if next(model.parameters()).dtype != dtype:
        model = copy.deepcopy(model)
        for param in model.parameters():
            param.data = param.data.to(dtype)
    return canary_logits(model, vocab_size)


def canary_mismatch(expected: list[float], got: list[float], dtype: str, up_to_constant: bool = False) -> float | None:
    """The largest relative difference when it exceeds the dtype's tolerance, else None.

    ``up_to_constant``: ``got`` are log-probabilities, ``logits - logsumexp(logits)``
    (an engine that exposes no raw logits, e.g. vLLM); both vectors are then compared
    after subtracting their own mean, which removes that one constant and nothing else.
    """
    if len(expected) != len(got):
        return float("inf")
    if up_to_constant:
        expected, got = _centered(expected), _centered(got)
    worst = max((abs(a - b) / max(1.0, abs(a)) for a, b in zip(expected, got)), default=0.0)
    return worst if worst > CANARY_TOLERANCE[dtype] else None


def _centered(values: list[float]) -> list[float]:
    mean = sum(values) / len(values) if values else 0.0
    return [v - mean for v in values]
