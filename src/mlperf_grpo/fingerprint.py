"""Proof that an engine holds the weights it claims: a tensor fingerprint and a canary.

After every refit the evaluator compares (1) the fingerprint of the engine's
tensors (:func:`weights_fingerprint`, computed on the engine's device) with the one the
trainer recorded for the checkpoint and (2) the engine's logits on a fixed
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


DEVICE_FINGERPRINT_ALGORITHM = "int64-word-sum-adjacent-product-v1"
"""Name of :func:`weights_fingerprint`'s algorithm, recorded in ``training_info.json``."""

_CHUNK_WORDS = 1 << 22
"""64-bit words per step of :func:`tensor_checksums` (bounds its temporary to 32 MiB)."""


def tensor_checksums(tensor: torch.Tensor) -> torch.Tensor:
    """Two checksums of a tensor's bit pattern, computed on the tensor's own device.

    The tensor's bytes (C order, little-endian as stored in memory and in safetensors
    files) are read as 64-bit words ``w_0 .. w_{n-1}`` (a last partial word zero-padded);
    returns ``[sum_i w_i, sum_i w_i * w_{i+1}]`` as an int64 tensor of shape ``[2]`` on
    the tensor's device, all arithmetic modulo 2**64 (two's-complement wrap-around). Sums
    modulo 2**64 do not depend on the order of additions, so CPU and CUDA give the same
    values. The first catches any change of a single word, the second swapped or
    transposed words. Cost: one pass over the bytes plus a reused 32 MiB temporary.
    """
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if data.numel() % 8 or data.data_ptr() % 8:  # int64 views need whole, aligned words
        padded = torch.zeros(-(-data.numel() // 8) * 8, dtype=torch.uint8, device=data.device)
        padded[: data.numel()] = data
        data = padded
    words = data.view(torch.int64)  # [n]
    out = torch.zeros(2, dtype=torch.int64, device=data.device)
    out[0] = words.sum()
    pairs = words.numel() - 1
    if pairs > 0:
        product = torch.empty(min(_CHUNK_WORDS, pairs), dtype=torch.int64, device=data.device)
        for start in range(0, pairs, _CHUNK_WORDS):
            count = min(_CHUNK_WORDS, pairs - start)
            out[1] += torch.mul(words[start: start + count], words[start + 1: start + 1 + count], out=product[:count]).sum()
    return out


def weights_checksums(state_dict: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[T, 2]`` int64 on the tensors' device: :func:`tensor_checksums` of every tensor,
    in name order (one device-to-host copy of ``16 T`` bytes reads them all)."""
    return torch.stack([tensor_checksums(state_dict[name]) for name in sorted(state_dict)])


def fingerprint_digest(state_dict: dict[str, torch.Tensor], checksums: torch.Tensor) -> str:
    """Hex xxh3_128 over every tensor's ``name|dtype|shape|sum|product`` in name order,
    from ``checksums`` (:func:`weights_checksums` of ``state_dict``, any device; only its
    ``[T, 2]`` values are copied to the host)."""
    values = checksums.cpu().tolist()
    digest = xxhash.xxh3_128()
    for name, (total, product) in zip(sorted(state_dict), values):
        t = state_dict[name]
        digest.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|{total}|{product}\n".encode())
    return digest.hexdigest()


def weights_fingerprint(state_dict: dict[str, torch.Tensor]) -> str:
    """The weights' fingerprint (algorithm :data:`DEVICE_FINGERPRINT_ALGORITHM`), computed
    where the tensors live: on a GPU only ``16 x len(state_dict)`` bytes reach the host.

    ``state_dict``: name -> tensor, any dtype and device (tied names included or not, as
    the caller's record does). Two state dicts have the same fingerprint when they hold
    the same names, dtypes, shapes and (with overwhelming likelihood) bytes. The trainer
    records it in ``training_info.json`` (``weights.fingerprint``) from the rollout-dtype
    tensors it checkpoints; engines return it for the tensors they hold after a refit.
    """
    if not state_dict:
        return xxhash.xxh3_128().hexdigest()
    return fingerprint_digest(state_dict, weights_checksums(state_dict))


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
