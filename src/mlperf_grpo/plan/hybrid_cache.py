"""The engine's cache of a hybrid model (``qwen3_5_moe``: full-attention layers between
gated delta-net layers) per row and rank, from ``config.json`` (no torch).

A full-attention layer keeps keys and values of every token: ``2 kv_r d r`` bytes a token,
``kv_r`` its KV heads on one rank of ``T`` (``kv / T``, or one where vLLM replicates them
over ``T > kv``), ``d`` the head dimension, ``r`` the rollout dtype's bytes. A linear-attention
layer keeps, whatever the length, its convolution's last ``kernel`` inputs
(``(2 k_h k_d + v_h v_d) / T x kernel x r``) and its recurrent state in float32
(``v_h / T x k_d x v_d x 4``): transformers' cache layout (``DynamicCache``'s
``LinearAttentionLayer``; vLLM keeps ``kernel - 1`` columns, and its state in the dtype of
``mamba_ssm_cache_dtype``). Checked against transformers' own cache in
``tests/plan/test_hybrid_cache.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mlperf_grpo.plan.memory import MOE_TYPES, gib_cell, is_full_attention, size_text

RECURRENT_STATE_BYTES = 4
"""The linear-attention layers' recurrent state is float32 (transformers' fallback and fla's kernels)."""


@dataclass(frozen=True)
class HybridCache:
    """One row's cache on one rank: ``per_token`` bytes of the full-attention layers' keys
    and values, ``state`` bytes of the linear-attention layers' whatever the length."""

    full_layers: int
    linear_layers: int
    per_token: int
    state: int

    def row_bytes(self, tokens: int) -> int:
        """One row of ``tokens`` tokens."""
        return self.per_token * tokens + self.state


def plans_hybrid_cache(config: dict) -> bool:
    """Whether :func:`hybrid_cache` knows the model type."""
    return config.get("model_type") in MOE_TYPES


def hybrid_cache(config: dict, tensor_parallel_size: int = 1, rollout_bytes: int = 2) -> HybridCache:
    """The cache of ``config`` (a :func:`plans_hybrid_cache` type) on one rank of
    ``tensor_parallel_size`` (which divides the heads: ``memory.check_tensor_parallel``)."""
    t, layers = tensor_parallel_size, config["num_hidden_layers"]
    full = sum(is_full_attention(config, i) for i in range(layers))
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv = config.get("num_key_value_heads") or heads
    kv_rank = kv // t if t <= kv else 1
    per_token = full * 2 * kv_rank * head_dim * rollout_bytes
    if full == layers:  # no linear-attention layer: its keys may be left out
        return HybridCache(full, 0, per_token, 0)
    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    k_dim, v_dim = config["linear_key_head_dim"], config["linear_value_head_dim"]
    conv = (2 * k_heads * k_dim + v_heads * v_dim) // t * config["linear_conv_kernel_dim"] * rollout_bytes
    recurrent = v_heads // t * k_dim * v_dim * RECURRENT_STATE_BYTES
    return HybridCache(full, layers - full, per_token, (layers - full) * (conv + recurrent))


def _layers(count: int, kind: str) -> str:
    return f"{count} {kind} layer{'' if count == 1 else 's'}"


def format_hybrid_cache(config: dict, cache: HybridCache, tokens: int, rows: int) -> tuple[dict, str]:
    """``plan --memory --trajectory-tokens`` for a hybrid model: JSON and text lines."""
    figures = {**asdict(cache), "tokens": tokens, "rows": rows, "row_bytes": cache.row_bytes(tokens),
               "all_rows_bytes": rows * cache.row_bytes(tokens)}
    lines = [f"sequences: the engine's cache of {config.get('model_type')} (activations of a pass not counted: "
             "MoE and linear-attention layers); GiB per rank",
             f"  {'one row of ' + format(tokens, ',') + ' tokens':46} {gib_cell(cache.row_bytes(tokens)):>10}",
             f"  {'  K/V of ' + _layers(cache.full_layers, 'full-attention'):46} {gib_cell(cache.per_token * tokens):>10}"
             f"  ({size_text(cache.per_token)} a token)",
             f"  {'  state of ' + _layers(cache.linear_layers, 'linear-attention'):46} {gib_cell(cache.state):>10}"
             "  (any length)",
             f"  {f'all {rows} rows':46} {gib_cell(figures['all_rows_bytes']):>10}"]
    return figures, "\n".join(lines)
