"""Wider attention heads for an engine whose kernels lack the model's head size: an
exactly equivalent model with each head's ``d`` dimensions spread over ``d' = r * d``.

vLLM's CPU attention runs head sizes 32, 64, 80, ... only, and the built-in model has
``head_dim`` 16. The vLLM engine (and only it) then runs the model as one with
``head_dim`` ``d'`` and these weights (per layer; ``H`` query heads, ``H_kv`` key/value
heads, hidden size unchanged):

- ``q_proj``, ``k_proj``, ``v_proj`` (weights ``[H* x d, hidden]``, biases ``[H* x d]``):
  in each head, row ``j`` moves to row ``r * j`` of ``d'``; the other rows are zero;
- ``q_proj`` rows (and bias) are multiplied by ``sqrt(r)``;
- ``o_proj`` (``[hidden, H x d]``): column ``j`` of each head moves to column ``r * j``.

Why the outputs are unchanged (Llama attention, Hugging Face layout):

- The zero dimensions of ``q`` and ``k`` add nothing to ``q . k``; those of ``v`` meet
  zero columns of ``o_proj``.
- RoPE (``rotate_half`` layout, ``default`` type): index ``i < d/2`` rotates with
  ``i + d/2`` at frequency ``theta^(-2i/d)``. The new index ``r j`` (``j < d/2``) pairs
  with ``r j + d'/2 = r (j + d/2)``, the image of ``j``'s partner, at frequency
  ``theta^(-2 r j / (r d)) = theta^(-2j/d)``, ``j``'s own. The kept dimensions rotate as
  before; zero ones stay zero.
- Scores are scaled by ``1/sqrt(d')``; ``sqrt(r)`` on ``q`` restores ``1/sqrt(d)``.
  When ``r`` is a power of 4, ``sqrt(r)`` is a power of 2 and the scaling is exact in
  every float format, so those ratios are preferred (16 -> 64 rather than 16 -> 32);
  the rest of the difference is the kernels' summation order.

Only ``model_type: llama`` with ``default`` RoPE over the whole head qualifies (no
per-head norms, no partial rotary); anything else is refused rather than run wrong.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

PADDABLE_MODEL_TYPES = ("llama",)
"""Hugging Face ``model_type`` values whose attention the transform keeps exact."""

MAX_HEAD_DIM = 512
"""Largest padded head size tried (vLLM's largest supported head size)."""

_HEAD_ROWS = re.compile(r"\.self_attn\.[qkv]_proj\.(weight|bias)$")
_QUERY = re.compile(r"\.self_attn\.q_proj\.(weight|bias)$")
_HEAD_COLUMNS = re.compile(r"\.self_attn\.o_proj\.weight$")


class HeadPaddingError(ValueError):
    """The engine cannot run this model's head size, and padding cannot make it exact."""


@dataclass(frozen=True)
class HeadPadding:
    """Spread each attention head from ``head_dim`` to ``padded_head_dim`` dimensions
    (a multiple of it); see the module docstring for the transform and its proof."""

    head_dim: int
    padded_head_dim: int

    def __post_init__(self) -> None:
        if self.head_dim % 2 or self.padded_head_dim % self.head_dim or self.padded_head_dim <= self.head_dim:
            raise ValueError(
                f"head padding {self.head_dim} -> {self.padded_head_dim}: need an even head_dim and a larger multiple of it"
            )

    @property
    def ratio(self) -> int:
        """``r = padded_head_dim / head_dim``."""
        return self.padded_head_dim // self.head_dim

    def config_overrides(self) -> dict[str, int]:
        """The Hugging Face config values of the padded model (``{"head_dim": d'}``)."""
        return {"head_dim": self.padded_head_dim}

    def pad(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The padded-model tensor for one Hugging Face-named tensor (others unchanged).

        Args:
            name: e.g. ``model.layers.0.self_attn.q_proj.weight``.
            tensor: q/k/v weights ``[heads x d, hidden]`` or biases ``[heads x d]``;
                ``o_proj`` weights ``[hidden, heads x d]``; any dtype and device.
        Returns:
            ``[heads x d', hidden]``, ``[heads x d']`` or ``[hidden, heads x d']``, same
            dtype and device; any other tensor is returned as it is.
        Raises:
            ValueError: the head dimension is not a multiple of ``head_dim``.
        """
        if _HEAD_ROWS.search(name):
            padded = self._spread(tensor.movedim(0, -1), name).movedim(-1, 0).contiguous()
            return padded * math.sqrt(self.ratio) if _QUERY.search(name) else padded
        if _HEAD_COLUMNS.search(name):
            return self._spread(tensor, name)
        return tensor

    def pad_all(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`pad` over ``(name, tensor)`` pairs, lazily, in order."""
        return ((name, self.pad(name, tensor)) for name, tensor in weights)

    def _spread(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Last dimension ``[heads x d]`` -> ``[heads x d']``, dimension ``j`` of each head at ``r j``."""
        *lead, width = tensor.shape
        if width % self.head_dim:
            raise ValueError(f"{name}: head dimension {width} is not a multiple of head_dim {self.head_dim}")
        heads = tensor.reshape(*lead, width // self.head_dim, self.head_dim)
        out = heads.new_zeros(*lead, width // self.head_dim, self.padded_head_dim)
        out[..., :: self.ratio] = heads
        return out.reshape(*lead, width // self.head_dim * self.padded_head_dim)


def choose_padded_head_dim(head_dim: int, supported: Callable[[int], bool], max_head_dim: int = MAX_HEAD_DIM) -> int | None:
    """The head size to run a model of ``head_dim`` at: None when ``head_dim`` itself is
    supported, else the smallest supported ``r x head_dim`` with ``r`` a power of 4
    (exact scaling), else the smallest supported multiple.

    Raises:
        HeadPaddingError: ``head_dim`` is odd, or no multiple up to ``max_head_dim`` is supported.
    """
    if supported(head_dim):
        return None
    if head_dim % 2:
        raise HeadPaddingError(f"head_dim {head_dim} is not supported by the engine's attention, and an odd one cannot be padded")
    multiples = range(2 * head_dim, max_head_dim + 1, head_dim)
    exact = [m for m in multiples if _is_power_of_4(m // head_dim)]
    for candidate in exact + [m for m in multiples if m not in exact]:
        if supported(candidate):
            return candidate
    raise HeadPaddingError(f"head_dim {head_dim}: the engine's attention supports none of its multiples up to {max_head_dim}")


def _is_power_of_4(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0 and (n.bit_length() - 1) % 2 == 0


def head_padding_for(config, supported: Callable[[int], bool]) -> HeadPadding | None:
    """The padding a Hugging Face model config needs to run on an attention that runs
    the head sizes ``supported`` accepts; None when it runs as it is.

    Args:
        config: a ``transformers`` ``PretrainedConfig`` (``head_dim`` or
            ``hidden_size / num_attention_heads``, ``model_type``, RoPE settings).
        supported: head size -> whether the engine's attention runs it.
    Raises:
        HeadPaddingError: the head size is unsupported and the model is not one the
            transform keeps exact (the message names why).
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    padded = choose_padded_head_dim(head_dim, supported)
    if padded is None:
        return None
    unsupported = f"head_dim {head_dim} is not supported by the engine's attention"
    if config.model_type not in PADDABLE_MODEL_TYPES:
        raise HeadPaddingError(f"{unsupported}, and head padding is implemented for model_type {PADDABLE_MODEL_TYPES} only, not {config.model_type!r}")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise HeadPaddingError(f"{unsupported}, and head padding keeps only default RoPE over the whole head exact, not {rope}")
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        raise HeadPaddingError(f"{unsupported}, and head padding cannot keep partial rotary embeddings exact")
    return HeadPadding(head_dim, padded)
