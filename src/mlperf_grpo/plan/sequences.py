"""Per-rank bytes that grow with the sequences: training activations, the log-prob
chunks, the packed attention mask and the engine's KV cache (no torch; dense Llama /
Qwen3 decoders, from ``config.json``).

What a training pass keeps, per token and decoder layer, with ``H``, ``q = heads x
head_dim``, ``kv = kv_heads x head_dim``, ``I`` the hidden, query, key/value and MLP
widths: what autograd saves in ``transformers``' ``Qwen3DecoderLayer`` (float32 master
weights and residual stream; counted tensor by tensor with
``torch.autograd.graph.saved_tensors_hooks``, ``tests/train/test_memory_fit.py``):

- bfloat16 autocast: each RMSNorm's float32 input and normalised value (``16 H``); the
  q/k/v and gate/up projections' inputs cast to bfloat16, each cast kept (``10 H``);
  q/k norms' float32 input and bfloat16 output, SDPA's bfloat16 query, key, value and
  output (``10 q + 10 kv``); SiLU's input and output, the up projection's output, the
  down projection's input (``8 I``): ``a = 26 H + 10 q + 10 kv + 8 I``;
- float32: the norms and their outputs, shared by the projections (``24 H``), q/k norms'
  input and output, RoPE's outputs, SDPA's output (``16 q + 16 kv``), the MLP (``16 I``):
  ``a = 24 H + 16 q + 16 kv + 16 I``;
- both: SDPA's log-sum-exp and the norms' reciprocal roots, ``8 heads + 4 kv_heads + 8``.

A pass of ``S`` tokens keeps ``L a S`` without checkpointing; with it each layer keeps
only its float32 input (``4 H``) and the backward recomputes one layer at a time:
``(4 H L + a) S``. Both add the residual stream's gradients, ``12 H S`` (three float32
tensors live at once), and under autocast the bfloat16 copies of the weights (counted
with the weights: ``train/memory_fit.py``). Compiled layers (``model.compile``) may
save less: the figure is then an upper bound.

The log-probs are computed ``chunk`` positions at a time (``train/logprobs.py``): the
backward holds the chunk's ``b``-dtype logits, their float32 copy, log-softmax and its
gradient, ``(b + 12) V chunk``. A pass of packed rows gets a ``[S, S]`` boolean
block-diagonal mask, which SDPA turns into an additive ``b``-dtype one: ``(1 + b) S^2``.
The ``hf`` engine's KV cache at full length: ``2 L (rows + s) kv (length + 1)`` elements
of the rollout dtype, ``length`` rounded up to 64, ``s`` 1 with ``inference.prefill_graphs``
(a spare row for its padding rows; its prompts' columns rounded up to 16 first, so
``length`` + 15 is rounded) else 0 (``inference/slot_state.py``, ``decode.py``),
allocated at once where it fits. Where it does not, the engine is given the bytes left
(``kv_cache_bytes``), which its cache never exceeds, growths included: it grows with the
live rows' lengths and preempts rows that do not fit (recomputed later); it needs at
least one row at full length (``2 L (1 + s) kv (length + 1)``).

Beside its KV cache, the engine's largest prefill (:func:`prefill_bytes`; no autograd,
one layer's tensors alive at a time, rollout dtype ``r`` bytes): per query position the
embeddings, the layer's input, the residual stream and its normed copy (``4 H``), the
rotary cosines and sines (``2 d``, ``d`` the head dimension) and the larger of the MLP's
(SiLU's output, the up projection, their product: ``3 I``) and attention's (query, its
norm and rotary copies and temporaries, ``transformers``' ``repeat_kv``'s key and value
copies, SDPA's output: ``6 q``; key and value with their norm and rotary copies:
``4 kv``), ``t = r (4 H + 2 d + max(3 I, 6 q + 4 kv))``; its boolean mask and SDPA's
additive copy of it, ``(1 + r)`` a query-key pair; the last position's logits and sampling's
float32 copies, ``(r + 12) V`` a row (at top-p 1, training's rollouts; a top-p below 1
sorts the vocabulary, about ``16 V`` more). Prompts of at most ``c`` tokens
(``inference.slot_prefill.PREFILL_CHUNK``) are prefilled together: ``R (W^2 (1 + r) +
W t + (r + 12) V) + W^2`` for ``R`` rows of ``W`` columns (the rows' masks share one
causal pattern); a longer one (an agent turn that re-prefills its conversation) alone,
``c`` columns at a time over its ``P`` columns: ``c P (1 + r) + c t + 2 q r P + (r + 12)
V`` (its keys and values repeated over the heads). The sum is an upper bound of the live
bytes counted in a CPU prefill, within 40% (``tests/inference/test_decode_chunked_prefill.py``).

These are estimates of the allocator's live bytes; the CUDA context, the allocator's
slack and communication buffers are not counted (:data:`DEVICE_RESERVE_BYTES` is left
for them when a layout is judged).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from mlperf_grpo.plan.memory import gib_cell, size_text

DENSE_TYPES = ("llama", "qwen3")
DEVICE_RESERVE_BYTES = 3 << 30
"""Left free of a device's memory when judging a layout: the CUDA context (~0.5 GiB),
the caching allocator's fragmentation, NCCL's buffers."""
KEY_BLOCK = 64
"""The slot decoder's cache columns are the longest row rounded up to a multiple of this,
plus one (``DecodeOptions.key_block``)."""
PREFILL_WIDTH_BLOCK = 16
"""As ``inference.slot_prefill.PREFILL_WIDTH_BLOCK``: with ``inference.prefill_graphs`` a
prompt fills a multiple of this many columns (kept equal by a test)."""
PREFILL_CHUNK = 1024
"""As ``inference.slot_prefill.PREFILL_CHUNK``: a longer prompt is prefilled alone in chunks
of this many columns (kept equal by a test)."""
LOGITS_CHUNK_BYTES = 1 << 30
"""As ``train.logprobs.LOGITS_CHUNK_BYTES`` (kept equal by a test; this module has no torch)."""


@dataclass(frozen=True)
class SequenceShape:
    """What a step's sequences are: ``pass_tokens`` the tokens of the largest training
    pass (the token budget, or rows x their longest), ``packed`` whether that pass packs
    several rows (a block-diagonal mask), ``engine_rows`` the rows the engine decodes at
    once, ``engine_length`` their longest prompt + new tokens, ``compute_bytes`` 2
    (bfloat16 autocast) or 4, ``rollout_bytes`` the engine dtype's bytes, ``spare_row``
    whether its cache has a spare row (``inference.prefill_graphs``), ``engine_prompt`` the
    longest prompt it prefills (None: ``engine_length``, as an agent turn re-prefills its
    conversation)."""

    pass_tokens: int
    packed: bool
    engine_rows: int
    engine_length: int
    compute_bytes: int = 2
    rollout_bytes: int = 2
    spare_row: bool = False
    engine_prompt: int | None = None


@dataclass(frozen=True)
class SequenceMemory:
    """Bytes on one rank (see the module docstring)."""

    activation_bytes: int
    logits_bytes: int
    attention_mask_bytes: int
    kv_cache_bytes: int
    checkpointing: bool
    kv_cache_min_bytes: int = 0
    """One row at full length (and the spare row, if any): the least the engine decodes with."""
    prefill_bytes: int = 0
    """The engine's largest prefill beside its KV cache (:func:`prefill_bytes`)."""

    @property
    def generation_bytes(self) -> int:
        """What generating adds to the weights and optimizer state: the KV cache and a prefill."""
        return self.kv_cache_bytes + self.prefill_bytes

    @property
    def training_bytes(self) -> int:
        """What a training pass adds to the weights and optimizer state."""
        return self.activation_bytes + self.logits_bytes + self.attention_mask_bytes

    def to_json(self) -> dict:
        """Plain values, with ``training_bytes``."""
        return {**asdict(self), "training_bytes": self.training_bytes}


ENGINE_BATCH_SIZE = 256
"""Rows the ``hf`` engine decodes at once (``build_engine``'s ``batch_size``)."""


def step_shape(longest: int, rows: int, budget: int | None, max_rows: int | None = None, compute_bytes: int = 2,
               rollout_bytes: int = 2, spare_row: bool = False, prompt: int | None = None) -> SequenceShape:
    """A rank's step: ``rows`` rows of at most ``longest`` tokens, training passes of
    ``budget`` tokens (``grpo.micro_batch_tokens``; a longer row alone) and at most
    ``max_rows`` rows (``grpo.micro_batch_size``), or without a budget ``max_rows``
    right-padded rows; ``spare_row``: ``inference.prefill_graphs``; ``prompt``: the
    longest prompt the engine prefills (None: ``longest``)."""
    engine = (min(ENGINE_BATCH_SIZE, rows), longest)
    rest = (compute_bytes, rollout_bytes, spare_row, prompt)
    if budget is None:
        return SequenceShape(min(max_rows, rows) * longest, False, *engine, *rest)
    per_pass = rows if max_rows is None else min(rows, max_rows)
    tokens = max(longest, min(budget, per_pass * longest))
    return SequenceShape(tokens, tokens > longest, *engine, *rest)


def autocast_copy_bytes(parameters: int, world_size: int, compute_bytes: int) -> int:
    """The compute-dtype copies of the weights in one process: the decoder linears' made
    once a step (``train/compute_weights.py``), the others' made by autocast and kept by a
    pass for its backward (``2 P`` under bfloat16; none in float32; under FSDP2 the
    all-gathered layers come and go, not counted)."""
    return parameters * compute_bytes if world_size == 1 and compute_bytes < 4 else 0


def format_sequences(config: dict, shape: SequenceShape, static_bytes: int) -> list[str]:
    """``plan --memory``'s lines for ``shape``: each figure without and with activation
    checkpointing, and the per-rank peak with every row's KV cache at full length (on a
    device that does not hold it the engine's cache is bounded to what is left, at least
    one row: :func:`fit`)."""
    off, on = (sequence_memory(config, shape, c) for c in (False, True))
    rows = [("activations of a pass", off.activation_bytes, on.activation_bytes),
            ("log-prob chunks", off.logits_bytes, on.logits_bytes),
            ("packed attention mask", off.attention_mask_bytes, on.attention_mask_bytes),
            ("engine KV cache, all rows full", off.kv_cache_bytes, on.kv_cache_bytes),
            ("  or at least (one row)", off.kv_cache_min_bytes, on.kv_cache_min_bytes),
            ("engine prefill (the largest)", off.prefill_bytes, on.prefill_bytes),
            ("= device peak (with all rows)", static_bytes + off.generation_bytes + off.training_bytes,
             static_bytes + on.generation_bytes + on.training_bytes)]
    head = (f"sequences: passes of {shape.pass_tokens:,} tokens ({'packed' if shape.packed else 'one row'}), the engine "
            f"decoding {shape.engine_rows} rows of {shape.engine_length:,} (prompts of up to "
            f"{shape.engine_prompt or shape.engine_length:,}); GiB per rank")
    lines = [head, f"  {'':36} {'no checkpointing':>16} {'checkpointing':>20}"]
    lines += [f"  {name:36} {gib_cell(a):>16} {gib_cell(b):>20}" for name, a, b in rows]
    return lines


def plans_sequences(config: dict) -> bool:
    """Whether :func:`sequence_memory` knows the model type (dense decoders)."""
    return config.get("model_type") in DENSE_TYPES


def _dims(config: dict) -> tuple[int, int, int, int, int, int]:
    """``(H, q, kv, I, L, V)`` of a dense decoder config."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return (hidden, heads * head_dim, kv_heads * head_dim, config["intermediate_size"], config["num_hidden_layers"],
            config["vocab_size"])


def layer_activation_bytes(config: dict, compute_bytes: int = 2) -> int:
    """``a``: bytes one decoder layer keeps per token for its backward (module docstring);
    ``compute_bytes`` 2: bfloat16 autocast, 4: float32."""
    h, q, kv, i, _, _ = _dims(config)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    small = 8 * heads + 4 * kv_heads + 8
    if compute_bytes == 4:
        return 24 * h + 16 * q + 16 * kv + 16 * i + small
    return 26 * h + 10 * q + 10 * kv + 8 * i + small


def sequence_memory(config: dict, shape: SequenceShape, checkpointing: bool) -> SequenceMemory:
    """The per-rank bytes of ``shape``'s sequences for the dense model ``config``."""
    h, _, kv, _, layers, vocab = _dims(config)
    s, b = shape.pass_tokens, shape.compute_bytes
    a = layer_activation_bytes(config, b)
    kept = (4 * h * layers + a) if checkpointing else a * layers
    activations = (kept + 12 * h) * s
    chunk = min(s, max(1, LOGITS_CHUNK_BYTES // (4 * vocab)))
    logits = (b + 12) * vocab * chunk
    mask = (1 + b) * s * s if shape.packed else 0
    # the slot cache's (inference/decode.py): the longest prompt (padded to PREFILL_WIDTH_BLOCK with
    # prefill_graphs: at most 15 more columns) + max_new_tokens, rounded up to KEY_BLOCK, + 1
    padded = shape.engine_length + (PREFILL_WIDTH_BLOCK - 1) * shape.spare_row
    columns = -(-padded // KEY_BLOCK) * KEY_BLOCK + 1
    row_bytes = 2 * layers * kv * columns * shape.rollout_bytes  # one row at full length
    prompt = shape.engine_length if shape.engine_prompt is None else shape.engine_prompt
    prefill = prefill_bytes(config, shape.engine_rows, prompt, shape.rollout_bytes, shape.spare_row)
    return SequenceMemory(activations, logits, mask, (shape.engine_rows + shape.spare_row) * row_bytes, checkpointing,
                          (1 + shape.spare_row) * row_bytes, prefill)


def prefill_bytes(config: dict, rows: int, prompt: int, rollout_bytes: int = 2, spare_row: bool = False,
                  chunk: int = PREFILL_CHUNK) -> int:
    """The most bytes one of the engine's prefills allocates beside its KV cache (module
    docstring): ``rows`` prompts of at most ``min(prompt, chunk)`` tokens together
    (``spare_row``: padded to a multiple of :data:`PREFILL_WIDTH_BLOCK` columns), or, where
    ``prompt`` > ``chunk``, one alone in chunks of ``chunk`` columns."""
    h, q, kv, i, _, vocab = _dims(config)
    r = rollout_bytes
    head_dim = q // config["num_attention_heads"]
    token = r * (4 * h + 2 * head_dim + max(3 * i, 6 * q + 4 * kv))  # tensors alive at once, a query position
    row = (r + 12) * vocab  # the last position's logits and sampling's float32 copies
    width = min(prompt, chunk)
    width = -(-width // PREFILL_WIDTH_BLOCK) * PREFILL_WIDTH_BLOCK if spare_row else width
    together = rows * (width * width * (1 + r) + width * token + row) + width * width  # + the causal pattern
    if prompt <= chunk:
        return together
    return max(together, chunk * prompt * (1 + r) + chunk * token + 2 * q * r * prompt + row)


@dataclass(frozen=True)
class Fit:
    """:func:`fit`'s verdict: the bytes (with checkpointing needed or asked; the KV cache
    as bounded), whether the engine's KV cache is freed while the policy trains, whether
    the step fits the device at all, and its shape."""

    memory: SequenceMemory
    static_bytes: int
    device_bytes: int
    fits: bool
    shape: SequenceShape | None = None
    """The step's shape, with the engine's rows at once as planned."""
    released: bool = False
    """The engine frees its KV cache and graphs once the rollouts are generated (synchronous
    rollouts): generation and training then take the memory in turn."""
    kv_budget_bytes: int | None = None
    """The bytes the engine's KV cache may take (``DecodeOptions.kv_cache_bytes``): what
    the device has left beside the rest (its largest prefill included); None where
    nothing fits."""
    bounded: bool = False
    """The device does not hold every row at full length: the engine's cache is bounded
    (its rows grow with their lengths and are preempted past the budget);
    ``memory.kv_cache_bytes`` is the budget where the step fits, else the one row at full
    length it needs at least."""

    @property
    def peak_bytes(self) -> int:
        """Planned peak: weights, optimizer state and engine, plus its KV cache and largest
        prefill and a training pass at once, or the larger of the two when the cache is
        released."""
        m = self.memory
        turns = max(m.generation_bytes, m.training_bytes) if self.released else m.generation_bytes + m.training_bytes
        return self.static_bytes + turns


def fit(config: dict, shape: SequenceShape, static_bytes: int, device_bytes: int,
        checkpointing: bool | None = None, can_release: bool = False) -> Fit:
    """Whether a step fits ``device_bytes`` (less :data:`DEVICE_RESERVE_BYTES`) on top of
    ``static_bytes`` (weights, gradients, AdamW moments, the engine's weights:
    ``plan.memory``), in this order of cost: as it is; with the engine's KV cache freed
    while the policy trains (``can_release``: synchronous rollouts; the next generation
    captures its graphs again); with activation checkpointing (``checkpointing`` None:
    tried; True/False: as asked), then both. The engine's KV cache gets the bytes left
    beside the rest (:attr:`Fit.kv_budget_bytes`); where that does not hold every row at
    full length (none of the above fits), the last of them is taken with the cache
    bounded to what is left (its rows grow with their lengths; rows that do not fit are
    preempted and recomputed): it fits when that holds one row at full length, else the
    verdict, not fitting, counts that one row."""
    usable = device_bytes - DEVICE_RESERVE_BYTES
    options = [(c, r) for c in ([checkpointing] if checkpointing is not None else [False, True])
               for r in ([False, True] if can_release else [False])]
    for ckpt, released in options:
        m = sequence_memory(config, shape, ckpt)
        room = usable - static_bytes - m.prefill_bytes - (0 if released else m.training_bytes)
        verdict = Fit(m, static_bytes, device_bytes, False, shape, released, room)
        if verdict.peak_bytes <= usable:
            return replace(verdict, fits=True)
    bounded = Fit(replace(m, kv_cache_bytes=max(room, m.kv_cache_min_bytes)), static_bytes, device_bytes, False,
                  shape, released, room, True)
    if room >= m.kv_cache_min_bytes and bounded.peak_bytes <= usable:
        return replace(bounded, fits=True)
    return replace(bounded, memory=replace(m, kv_cache_bytes=m.kv_cache_min_bytes), kv_budget_bytes=None)


def refusal(verdict: Fit, tokens_key: str = "grpo.micro_batch_tokens", length_key: str = "grpo.max_new_tokens") -> str:
    """One line: the planned bytes against the device's, and what to change first (for
    the largest of the engine's KV cache, a pass's activations, the weights and state);
    ``length_key``: the setting that bounds a row's length (``agent.max_context_tokens``
    for agent trajectories)."""
    m = verdict.memory
    parts = {"kv": m.generation_bytes, "pass": m.training_bytes, "static": verdict.static_bytes}
    largest = max(parts, key=parts.get)
    remedy = {
        "kv": f"shorter rollouts ({length_key}: the engine decodes at least one row at full length), or more "
              "ranks (each holds a smaller share of the state)",
        "pass": f"lower {tokens_key} (a longer row is a pass of its own: then lower {length_key})"
                if verdict.shape is None or verdict.shape.pass_tokens > verdict.shape.engine_length
                else f"shorter rows (lower {length_key}: the largest pass is already one row of "
                     f"{verdict.shape.pass_tokens:,} tokens, which no lower {tokens_key} splits)",
        "static": "more ranks (torchrun shards the fp32 state) or a smaller model",
    }[largest]
    kv = (f"{size_text(m.kv_cache_bytes)} engine KV cache"
          f"{' (one row at full length: the least it decodes with)' if verdict.bounded else ''} + "
          f"{size_text(m.prefill_bytes)} its largest prefill")
    pass_ = (f"{size_text(m.activation_bytes)} activations{' with activation checkpointing' if m.checkpointing else ''} + "
             f"{size_text(m.logits_bytes + m.attention_mask_bytes)} log-prob chunks and attention mask")
    # released: the cache is freed while the policy trains, so the peak holds the larger of the two
    turns = f" + the larger of ({kv}) and ({pass_}), freed in turn" if verdict.released else f" + {kv} + {pass_}"
    return (f"the step needs about {size_text(verdict.peak_bytes)} per rank ({size_text(verdict.static_bytes)} weights, "
            f"gradients, AdamW moments and engine{turns}), over the device's "
            f"{size_text(verdict.device_bytes)} less {size_text(DEVICE_RESERVE_BYTES)} reserve: {remedy}; "
            f"'mlperf-grpo plan --memory --trajectory-tokens' gives the figures")
