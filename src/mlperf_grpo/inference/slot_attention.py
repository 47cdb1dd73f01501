"""The slot decoder's attention: :func:`slot_attention` (registered with transformers as
:data:`SLOT_ATTENTION`) reads each row's own columns of the slot cache; a prefill uses
SDPA without cuDNN's kernel (``model/attention.planless_attention``);
:func:`supports_slot_decoding` says which models the slot decoder takes."""

from __future__ import annotations

import contextlib
import inspect

import torch
from transformers import AttentionInterface, PreTrainedModel

from mlperf_grpo.inference import fused_decode

SLOT_ATTENTION = "mlperf_grpo_slot_sdpa"
"""The attention implementation a decode step runs (registered with ``transformers``'
``AttentionInterface``; the model's own is restored after each step)."""


def slot_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of one new token per row over its slot's cache row, as two batched
    matrix products: the ``[b, Hq, 1, D]`` queries grouped per KV head as
    ``[b x Hkv, Hq / Hkv, D]`` read the ``[b, Hkv, K, D]`` cache as it is (a view: no
    copy to ``Hq`` heads, ``transformers``' ``repeat_kv``). Scores and softmax are float32
    (``torch.bmm``'s ``out_dtype`` on CUDA), the probabilities are rounded to the value
    dtype for the second product, as flash attention rounds them.

    Why not ``scaled_dot_product_attention``: a slot's visible columns need a mask, which
    flash attention does not take, and the memory-efficient kernel with a mask took
    224 us a layer at 256 rows x 256 columns on one H200 (torch 2.11, 1.65B Qwen3-shaped
    model, ``torch.profiler``): 43% of a decode step, several times the time its keys and
    values take to read; cuDNN's took about 200 us.

    Args:
        key, value: ``[b, Hkv, L, D]``, the rows' cache (:meth:`SlotCache.update`); the
            first ``K`` columns are read.
        attention_mask: ``[b, 1, 1, K]`` float32, 0 where a row may attend, ``-inf``
            elsewhere (built once a step, shared by the layers).
    Returns:
        ``([b, 1, Hq, D] output, None)``, as ``transformers``' attention functions.
    """
    b, heads, q_len, dim = query.shape
    kv_heads, columns = key.shape[1], attention_mask.shape[-1]
    key, value = key[:, :, :columns], value[:, :, :columns]
    group = heads // kv_heads * q_len  # q_len is 1: the heads of a group are its queries
    q = query.reshape(b * kv_heads, group, dim)
    keys = key.reshape(b * kv_heads, columns, dim)  # a view of the cache rows (their rows and heads merge)
    scores = _bmm_float32(q, keys.transpose(1, 2)).view(b, kv_heads, group, columns)
    probs = fused_decode.masked_softmax_fn()(scores, dim**-0.5 if scaling is None else scaling, attention_mask,
                                             value.dtype).view(b * kv_heads, group, columns)
    out = torch.bmm(probs, value.reshape(b * kv_heads, columns, value.shape[-1]))  # [b x Hkv, group, D]
    return out.view(b, heads, q_len, value.shape[-1]).transpose(1, 2).contiguous(), None


def _bmm_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (batched) accumulated and returned in float32."""
    if a.dtype == torch.float32:
        return torch.bmm(a, b)
    if a.is_cuda:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())  # the CPU has no bmm with out_dtype


AttentionInterface.register(SLOT_ATTENTION, slot_attention)


@contextlib.contextmanager
def attention_implementation(model: PreTrainedModel, implementation: str):
    """The model runs the attention ``implementation`` (a name of ``transformers``'
    ``AttentionInterface``) inside."""
    before = model.config._attn_implementation
    model.config._attn_implementation = implementation
    try:
        yield
    finally:
        model.config._attn_implementation = before


def supports_slot_decoding(model: PreTrainedModel) -> bool:
    """Whether ``model`` can decode over a :class:`SlotCache`: a decoder whose layers
    are all full attention (``config.layer_types`` absent or all ``"full_attention"``),
    with no recurrent state (no ``linear_attention``/Mamba layers) and no sliding window."""
    config = model.config
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return (
        not config.is_encoder_decoder
        and set(layer_types) == {"full_attention"}
        and not getattr(config, "sliding_window", None)
        and "position_ids" in inspect.signature(model.forward).parameters
    )
