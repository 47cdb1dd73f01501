"""A decode loop over a static per-slot KV cache, with refilled slots and (on CUDA)
each decode step captured as a CUDA graph.

``SlotDecoder.generate`` keeps ``slots`` rows in flight. Each slot holds one prompt's
keys and values in a static ``[slots, kv_heads, length, head_dim]`` cache per layer
(:class:`SlotCache`) and has its own write column, position and token count, so a slot
whose row has finished (EOS or the token limit) takes the next waiting prompt at once
(its prefill runs eagerly, the prompts admitted together left-padded to their longest).
A decode step feeds every slot its last token at its own position and attends to the
columns ``[start, column]`` of its own cache row: a completion depends on its prompt,
its seed and the weights, not on its slot or its neighbours (up to float rounding of
batched kernels, as with ``generate``'s left padding).

The step works on the first ``rows`` slots and the first ``key_length`` cache columns,
both taken from a few buckets (powers of two of rows; multiples of ``key_block``
columns), so attention reads the columns in use, not the whole cache; once no prompt
waits, the live slots are moved to the front and the step shrinks to a smaller bucket.
On CUDA each ``(rows, key_length)`` step is captured once as a ``torch.cuda.CUDAGraph``
(forward, sampling and the bookkeeping; one memory pool shared by all) and replayed:
one launch a token instead of thousands. Prefill stays eager.

Sampling is :func:`sample_tokens`, the same as ``RowSeededSampler``'s: row ``i``'s
``t``-th token is the inverse CDF of ``softmax(top_p(logits / temperature))`` at the
``t``-th ``random()`` of ``random.Random(seeds[i])``; its log-probability is
``log_softmax(logits / temperature)`` at that token, before top-p.

Only models whose every layer is full attention over a per-layer KV cache take this
path (:func:`supports_slot_decoding`): hybrid linear-attention models (Qwen3.5's gated
delta-net) and sliding-window layers keep ``generate``.
"""

from __future__ import annotations

import contextlib
import inspect
import random
from collections import deque
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

SLOT_ATTENTION = "mlperf_grpo_slot_sdpa"
"""The attention implementation a decode step runs (registered with ``transformers``'
``AttentionInterface``; the model's own is restored after each step)."""

DECODE_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""Kernels a decode step may use: a slot's visible columns need a mask, which flash
attention does not take; cuDNN's took about 200 us a layer at 256 rows x 256 keys on one
H200 (torch 2.11, profiled), several times the time its keys and values take to read."""

PREFILL_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, *DECODE_SDPA_BACKENDS]
"""Kernels a prefill may use: not cuDNN's, which plans every new shape (prefill widths
vary; see ``hf.GENERATION_SDPA_BACKENDS``)."""


def slot_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """Scaled dot-product attention of one new token per row: ``[b, Hq, 1, D]`` queries
    grouped per KV head as ``[b, Hkv, Hq / Hkv, D]``, so grouped-query attention reads
    the ``[b, Hkv, K, D]`` cache as it is (``transformers`` 5.17 copies it to ``Hq`` heads
    every layer and step, ``repeat_kv``; 5.24's ``pack_gqa`` groups as here).
    ``attention_mask``: ``[b, 1, 1, K]`` bool, True where a row may attend.

    Returns:
        ``([b, 1, Hq, D] output, None)``, as ``transformers``' attention functions.
    """
    b, heads, q_len, dim = query.shape
    grouped = query.reshape(b, key.shape[1], heads // key.shape[1] * q_len, dim)  # q_len is 1: heads in a group are queries
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(b, heads, q_len, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(SLOT_ATTENTION, slot_attention)


@contextlib.contextmanager
def _decode_attention(model: PreTrainedModel):
    """The model runs :func:`slot_attention` (and only the listed SDPA kernels) inside."""
    before = model.config._attn_implementation
    model.config._attn_implementation = SLOT_ATTENTION
    try:
        with sdpa_kernel(DECODE_SDPA_BACKENDS):
            yield
    finally:
        model.config._attn_implementation = before


def sample_tokens(
    scores: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sampling of one token per row, with its log-probability.

    Args:
        scores: ``[B, V]`` logits of the next token (any float dtype; computed in float32).
        uniforms: ``[B, 1]`` float32 in [0, 1), one per row.
        temperature, top_p: as in :class:`~mlperf_grpo.inference.base.SamplingParams`
            (top-p as ``transformers``' ``TopPLogitsWarper``; off at 1.0).
    Returns:
        ``(chosen, logprob)``: ``[B, 1]`` int64 token ids and ``[B, 1]`` float32
        ``log_softmax(scores / temperature)`` at them (the rollout policy, before top-p).
    """
    scores = TemperatureLogitsWarper(temperature)(None, scores.float())  # [B, V]
    logprobs = torch.log_softmax(scores, dim=-1)  # [B, V]
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    cdf = torch.softmax(scores, dim=-1).cumsum_(dim=-1)  # [B, V]
    u = uniforms.to(cdf.dtype) * cdf[:, -1:]  # [B, 1]; the CDF may end a hair below 1
    chosen = torch.searchsorted(cdf, u).clamp_(max=scores.shape[-1] - 1)  # [B, 1]
    return chosen, logprobs.gather(1, chosen)


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


class SlotCache:
    """A static KV cache of ``slots`` rows and ``length`` columns per layer, written at
    one column per row (the rows' own write columns), read as the first ``rows`` rows
    and ``key_length`` columns. Handed to the model as its cache: attention layers call
    :meth:`update`.

    Memory: ``2 x layers x slots x kv_heads x length x head_dim`` elements of the
    model's dtype, allocated once.
    """

    def __init__(self, shapes: list[tuple[int, int]], slots: int, length: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        """``shapes``: per layer ``(kv_heads, head_dim)``."""
        self.keys = [torch.zeros(slots, h, length, d, dtype=dtype, device=device) for h, d in shapes]
        self.values = [torch.zeros(slots, h, length, d, dtype=dtype, device=device) for h, d in shapes]
        self.slots, self.length = slots, length
        self.write_columns = torch.zeros(slots, dtype=torch.long, device=device)  # [slots]
        self.key_length = length

    def fits(self, shapes: list[tuple[int, int]], slots: int, length: int, dtype: torch.dtype) -> bool:
        """Whether this cache can serve a call of ``slots`` rows and ``length`` columns."""
        have = [(k.shape[1], k.shape[3]) for k in self.keys]
        return have == shapes and self.slots >= slots and self.length >= length and self.keys[0].dtype == dtype

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write ``[b, kv_heads, 1, head_dim]`` keys and values of the first ``b`` rows at
        their write columns; return the rows' ``[b, kv_heads, key_length, head_dim]``
        keys and values (views)."""
        b = key_states.shape[0]
        keys, values = self.keys[layer_idx][:b], self.values[layer_idx][:b]
        index = self.write_columns[:b].view(b, 1, 1, 1).expand(b, keys.shape[1], 1, keys.shape[3])
        keys.scatter_(2, index, key_states)
        values.scatter_(2, index, value_states)
        return keys[:, :, : self.key_length], values[:, :, : self.key_length]

    def permute_rows(self, order: torch.Tensor) -> None:
        """Reorder the first ``len(order)`` rows of every layer: row ``i`` takes row ``order[i]``."""
        n = order.shape[0]
        for tensor in (*self.keys, *self.values, self.write_columns):
            tensor[:n] = tensor[:n].index_select(0, order)


@dataclass(frozen=True)
class _Call:
    """One :meth:`SlotDecoder.generate` call's sampling constants (a captured graph bakes them in)."""

    temperature: float
    top_p: float
    max_new_tokens: int
    eos: tuple[int, ...]  # sorted; (-1,) when there is no EOS


class SlotDecoder:
    """Generates completions for many prompts through at most ``slots`` refilled slots.

    Args:
        model: a causal LM for which :func:`supports_slot_decoding` holds (eval mode).
        slots: the most rows decoded at once.
        pad_token_id: the id left padding uses in a prefill.
        cuda_graphs: capture each decode step as a CUDA graph (needs a CUDA model).
        key_block: key-length buckets are multiples of this many columns.

    The cache, the per-slot state and the graphs are kept between calls and rebuilt
    only when a call needs more rows, columns or tokens (columns are allocated in
    multiples of ``key_block``), so repeated calls of one shape (an evaluator's
    checkpoints, a training's rollouts) capture nothing new.
    """

    def __init__(self, model: PreTrainedModel, slots: int, pad_token_id: int, cuda_graphs: bool,
                 key_block: int = 256) -> None:
        if cuda_graphs and model.device.type != "cuda":
            raise ValueError("cuda_graphs needs a model on a CUDA device")
        self.model = model
        self.slots = slots
        self.pad_token_id = pad_token_id
        self.cuda_graphs = cuda_graphs
        self.key_block = key_block
        self.cache: SlotCache | None = None
        self.state: _SlotState | None = None
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._eos: dict[tuple[int, ...], torch.Tensor] = {}  # device copies a graph reads
        self._pool = None
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.decode_steps = 0  # decode steps run by the last call (forward passes after its prefills)

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], seeds: list[int], temperature: float, top_p: float, max_new_tokens: int,
        eos_token_ids: list[int] | set[int],
    ) -> list[tuple[list[int], list[float]]]:
        """One completion per prompt: ``(token_ids, logprobs)``, cut after the first id
        of ``eos_token_ids`` (kept) or at ``max_new_tokens``.

        Args:
            prompts: unpadded token ids, at least one token each.
            seeds: one per prompt (``random.Random(seed)`` draws the row's uniforms).
            temperature, top_p, max_new_tokens: as in ``SamplingParams`` (max_new_tokens >= 1).
            eos_token_ids: stop on any of these (empty: run to ``max_new_tokens``).
        Raises:
            ValueError: prompts and seeds differ in number, a prompt is empty, or
                ``max_new_tokens`` < 1.
        """
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens is {max_new_tokens}; it must be >= 1")
        if not prompts:
            return []
        call = _Call(temperature, top_p, max_new_tokens, tuple(sorted(set(eos_token_ids))) or (-1,))
        slots = min(self.slots, len(prompts))
        length = _round_up(max(len(p) for p in prompts) + max_new_tokens, self.key_block)
        waiting = deque(range(len(prompts)))
        owner = [-1] * slots  # prompt index per slot; -1: empty
        results: list[tuple[list[int], list[float]] | None] = [None] * len(prompts)
        rows = slots
        self.decode_steps = 0

        def admit(free: list[int]) -> None:
            taken = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
            if taken:
                self._prefill(free[: len(taken)], [prompts[i] for i in taken], [seeds[i] for i in taken],
                              call, slots, length)
                for slot, index in zip(free, taken):
                    owner[slot] = index

        admit(list(range(slots)))
        state = self.state
        while True:
            done = state.done[:rows].tolist()  # the one host sync of a step
            finished = [s for s in range(rows) if owner[s] >= 0 and done[s]]
            for slot in finished:
                results[owner[slot]] = state.take(slot)
                owner[slot] = -1
            admit(finished)
            live = [s for s in range(rows) if owner[s] >= 0]
            if not live:
                break
            smaller = _bucket(len(live), rows)
            if not waiting and smaller < rows:  # compact: the live slots to the front
                order = live + [s for s in range(rows) if owner[s] < 0]
                state.permute(order, self.cache)
                owner[:rows] = [owner[s] for s in order]
                rows, live = smaller, list(range(len(live)))
            key_length = min(length, _round_up(max(state.column_cpu[s] for s in live) + 1, self.key_block))
            self._step(call, rows, key_length)
            self.decode_steps += 1
        return results  # type: ignore[return-value]

    def _prefill(self, free: list[int], prompts: list[list[int]], seeds: list[int], call: _Call, slots: int,
                 length: int) -> None:
        """Run the prompts (left-padded to their longest) eagerly, copy their keys and
        values into the ``free`` slots' cache rows, and sample each one's first token."""
        device = self.model.device
        width = max(len(p) for p in prompts)
        pads = [width - len(p) for p in prompts]
        input_ids = torch.tensor([[self.pad_token_id] * pad + p for pad, p in zip(pads, prompts)], device=device)
        attention_mask = torch.tensor([[0] * pad + [1] * len(p) for pad, p in zip(pads, prompts)], device=device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_(min=0)  # [n, W], as generate numbers a left-padded row
        prefill_cache = DynamicCache(config=self.model.config)
        with sdpa_kernel(PREFILL_SDPA_BACKENDS):
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=True, **{self._cache_arg: prefill_cache}).logits[:, -1]  # [n, V]
        layers = [(layer.keys, layer.values) for layer in prefill_cache.layers]
        self._ensure([(k.shape[1], k.shape[3]) for k, _ in layers], slots, length, call.max_new_tokens,
                     layers[0][0].dtype)
        index = torch.tensor(free, device=device)
        for (keys, values), own_keys, own_values in zip(layers, self.cache.keys, self.cache.values):
            own_keys[index, :, :width] = keys
            own_values[index, :, :width] = values
        del prefill_cache, layers
        self.state.start(index, seeds, pads, [len(p) for p in prompts], width, self.cache, call.max_new_tokens)
        chosen, logprob = sample_tokens(logits, self.state.uniforms[index, :1], call.temperature, call.top_p)
        self.state.record_first(index, chosen[:, 0], logprob[:, 0], self._eos_tensor(call), call.max_new_tokens)

    def _ensure(self, shapes: list[tuple[int, int]], slots: int, length: int, max_new_tokens: int,
                dtype: torch.dtype) -> None:
        """A cache and state large enough for this call; new ones drop the graphs (which
        read the old ones' memory)."""
        if (self.cache is not None and self.cache.fits(shapes, slots, length, dtype)
                and self.state.fits(slots, max_new_tokens, length)):
            return
        self._graphs.clear()
        self._pool = None  # a pool outlives its graphs only while one holds it (CUDACachingAllocator)
        self.cache = self.state = None
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()
        self.cache = SlotCache(shapes, slots, length, dtype, self.model.device)
        self.state = _SlotState(slots, max_new_tokens, length, self.model.device)

    def _eos_tensor(self, call: _Call) -> torch.Tensor:
        """``[E]`` int64 device tensor of the call's EOS ids, kept for the graphs that read it."""
        if call.eos not in self._eos:
            self._eos[call.eos] = torch.tensor(call.eos, dtype=torch.long, device=self.model.device)
        return self._eos[call.eos]

    def _step(self, call: _Call, rows: int, key_length: int) -> None:
        """One decode step of the first ``rows`` slots over ``key_length`` columns."""
        if not self.cuda_graphs:
            self._step_body(call, rows, key_length)
        else:
            key = (rows, key_length, call)
            graph = self._graphs.get(key)
            if graph is None:
                graph = self._graphs[key] = self._capture(call, rows, key_length)
            graph.replay()
        self.state.advance_cpu(rows)

    def _capture(self, call: _Call, rows: int, key_length: int) -> torch.cuda.CUDAGraph:
        """Warm up and capture :meth:`_step_body`; the state it changes is restored
        (keys and values written at the write columns are rewritten by the real step)."""
        saved = self.state.snapshot(self.cache)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # kernels pick their algorithms and allocate outside the capture
                self._step_body(call, rows, key_length)
                self.state.restore(saved, self.cache)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the one-step-async rollouts capture on their own thread while the
        # training thread allocates and synchronizes (global mode would fail those calls)
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._step_body(call, rows, key_length)
        self.state.restore(saved, self.cache)
        return graph

    def _step_body(self, call: _Call, rows: int, key_length: int) -> None:
        """Forward the first ``rows`` slots' last tokens, sample, record, advance; device
        tensors only (no host sync), so it can be captured."""
        state, cache = self.state, self.cache
        cache.key_length = key_length
        columns = cache.write_columns[:rows]  # [r]
        ar = state.arange[:key_length]
        visible = (ar >= state.starts[:rows, None]) & (ar <= columns[:, None])  # [r, K]
        with _decode_attention(self.model):
            logits = self.model(
                input_ids=state.last[:rows, None], position_ids=state.positions[:rows, None],
                attention_mask=visible[:, None, None, :], use_cache=True, **{self._cache_arg: cache},
            ).logits[:, -1]  # [r, V]
        counts = state.counts[:rows]
        at = counts.clamp(max=call.max_new_tokens - 1)[:, None]  # [r, 1]
        chosen, logprob = sample_tokens(logits, state.uniforms[:rows].gather(1, at), call.temperature, call.top_p)
        state.tokens[:rows].scatter_(1, at, chosen)
        state.logprobs[:rows].scatter_(1, at, logprob)
        state.last[:rows] = chosen[:, 0]
        columns.add_(1).clamp_(max=cache.length - 1)
        state.positions[:rows].add_(1)
        counts.add_(1)
        state.done[:rows] = (chosen == self._eos_tensor(call)[None, :]).any(-1) | (counts >= call.max_new_tokens)


class _SlotState:
    """Per-slot device tensors (``[slots]`` or ``[slots, max_new_tokens]``) and their
    host mirrors for bookkeeping."""

    def __init__(self, slots: int, max_new_tokens: int, length: int, device: torch.device) -> None:
        self.slots, self.max_new_tokens, self.length = slots, max_new_tokens, length
        self.device = device
        self.arange = torch.arange(length, device=device)
        self.starts = torch.zeros(slots, dtype=torch.long, device=device)  # first visible column
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)  # position id of the next input
        self.last = torch.zeros(slots, dtype=torch.long, device=device)  # the last sampled token
        self.counts = torch.zeros(slots, dtype=torch.long, device=device)  # tokens sampled so far
        self.done = torch.zeros(slots, dtype=torch.bool, device=device)
        self.uniforms = torch.zeros(slots, max_new_tokens, dtype=torch.float32, device=device)
        self.tokens = torch.zeros(slots, max_new_tokens, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(slots, max_new_tokens, dtype=torch.float32, device=device)
        self.count_cpu = [0] * slots
        self.column_cpu = [0] * slots

    def fits(self, slots: int, max_new_tokens: int, length: int) -> bool:
        """Whether this state can serve a call of this many slots, tokens and columns."""
        return self.slots >= slots and self.max_new_tokens >= max_new_tokens and self.length >= length

    def start(self, index: torch.Tensor, seeds: list[int], pads: list[int], lengths: list[int], width: int,
              cache: SlotCache, max_new_tokens: int) -> None:
        """Slots ``index`` begin rows whose prompts fill columns ``[pad, width)``; each
        row's ``max_new_tokens`` uniforms are drawn now (the first ones of its stream)."""
        draws = [[rng.random() for _ in range(max_new_tokens)] for rng in map(random.Random, seeds)]
        self.uniforms[index, :max_new_tokens] = torch.tensor(draws, dtype=torch.float32).to(self.device)
        self.starts[index] = torch.tensor(pads, device=self.device)
        self.positions[index] = torch.tensor(lengths, device=self.device)
        cache.write_columns[index] = width
        for slot in index.tolist():
            self.column_cpu[slot] = width

    def record_first(self, index: torch.Tensor, chosen: torch.Tensor, logprob: torch.Tensor, eos: torch.Tensor,
                     max_new_tokens: int) -> None:
        """The prefill's sampled token (``[n]``) is each new row's token 0."""
        self.tokens[index, 0] = chosen
        self.logprobs[index, 0] = logprob
        self.last[index] = chosen
        self.counts[index] = 1
        self.done[index] = (chosen[:, None] == eos[None, :]).any(-1) | (max_new_tokens <= 1)
        for slot in index.tolist():
            self.count_cpu[slot] = 1

    def advance_cpu(self, rows: int) -> None:
        """Host mirrors after a decode step of the first ``rows`` slots."""
        for s in range(rows):
            self.count_cpu[s] += 1
            self.column_cpu[s] += 1

    def take(self, slot: int) -> tuple[list[int], list[float]]:
        """The ended row of ``slot`` (read right after the step that ended it): its tokens
        through its first EOS or its limit, and their log-probabilities."""
        count = self.count_cpu[slot]
        return self.tokens[slot, :count].tolist(), self.logprobs[slot, :count].tolist()

    def permute(self, order: list[int], cache: SlotCache) -> None:
        """Slot ``i`` takes slot ``order[i]``'s state and cache row."""
        index = torch.tensor(order, device=self.device)
        n = len(order)
        for tensor in (self.starts, self.positions, self.last, self.counts, self.done, self.uniforms, self.tokens,
                       self.logprobs):
            tensor[:n] = tensor[:n].index_select(0, index)
        cache.permute_rows(index)
        self.count_cpu[:n] = [self.count_cpu[s] for s in order]
        self.column_cpu[:n] = [self.column_cpu[s] for s in order]

    def snapshot(self, cache: SlotCache) -> list[torch.Tensor]:
        """Copies of what a decode step changes besides the cache columns it writes."""
        return [t.clone() for t in self._mutable(cache)]

    def restore(self, saved: list[torch.Tensor], cache: SlotCache) -> None:
        """Undo a decode step: put back :meth:`snapshot`'s copies."""
        for tensor, copy in zip(self._mutable(cache), saved):
            tensor.copy_(copy)

    def _mutable(self, cache: SlotCache) -> list[torch.Tensor]:
        return [self.positions, self.last, self.counts, self.done, self.tokens, self.logprobs, cache.write_columns]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _bucket(live: int, rows: int) -> int:
    """The smallest power of two >= ``live`` if it is below ``rows``, else ``rows``."""
    size = 1
    while size < live:
        size *= 2
    return min(size, rows)
