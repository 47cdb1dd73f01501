"""A decode loop over a static per-slot KV cache, with refilled slots and (on CUDA)
each decode step captured as a CUDA graph.

``SlotDecoder.generate`` keeps ``slots`` rows in flight. Each slot holds one prompt's
keys and values in a static ``[slots, kv_heads, length, head_dim]`` cache per layer
(:class:`SlotCache`) and has its own write column, position and token count, so a slot
whose row has finished (EOS or the token limit) takes the next waiting prompt at once
(its prefill: the prompts admitted together, left-padded to their longest).
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
one launch a token instead of thousands. The host looks at which rows ended every
``check_every`` steps (8 with graphs), so it enqueues several replays while the device
runs; a row that ends between two looks keeps its count and its tokens. Attention is
:func:`slot_attention` (two batched products over the cache view). With CUDA graphs
the step runs with :mod:`~mlperf_grpo.inference.fused_decode`'s fused kernels
(RMSNorm, rotary embedding, SiLU-times-up, the attention's masked softmax, the
sampler's block masses). A prefill (the prompts admitted together, left-padded to their
longest) writes its keys and values straight into the slots' cache rows
(:class:`~mlperf_grpo.inference.slot_state.PrefillWriter`) and computes the last
position's logits only; it runs eagerly, or with ``prefill_graphs`` padded to a bucket
of rows and width and, on CUDA, captured as a graph per bucket too.

Sampling is :func:`~mlperf_grpo.inference.sampling.sample_tokens`, the same as
``RowSeededSampler``'s: row ``i``'s ``t``-th token is the inverse CDF of
``softmax(top_p(logits / temperature))`` at the ``t``-th ``random()`` of
``random.Random(seeds[i])``; its log-probability is ``log_softmax(logits /
temperature)`` at that token, before top-p. At top-p 1 (training rollouts) a decode step
finds that token in two levels, over blocks of 128 ids and inside one
(:func:`~mlperf_grpo.inference.sampling.sample_tokens_by_blocks`: no vocabulary-wide
cumulative sum; the same token up to float rounding). Optional (off by default): top-p
over each row's largest logits with a block run again exactly where they do not hold
the nucleus (``top_p_candidates``). The cache and the per-slot state live in
:mod:`~mlperf_grpo.inference.slot_state`.

Only models whose every layer is full attention over a per-layer KV cache take this
path (:func:`supports_slot_decoding`): hybrid linear-attention models (Qwen3.5's gated
delta-net) and sliding-window layers keep ``generate``.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, DynamicCache, PreTrainedModel

from mlperf_grpo.inference import fused_decode
from mlperf_grpo.inference.sampling import sample_tokens, sample_tokens_by_blocks, sample_tokens_from_candidates
from mlperf_grpo.inference.slot_state import PrefillWriter, SlotCache, SlotState

SLOT_ATTENTION = "mlperf_grpo_slot_sdpa"
"""The attention implementation a decode step runs (registered with ``transformers``'
``AttentionInterface``; the model's own is restored after each step)."""

PREFILL_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""Kernels a prefill may use: not cuDNN's, which plans every new shape (prefill widths
vary; see ``hf.GENERATION_SDPA_BACKENDS``)."""


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
def _attention(model: PreTrainedModel, implementation: str):
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
        check_every: decode steps between two host reads of which rows ended (a slot
            freed mid-block waits for the next read; default: 8 with CUDA graphs, so
            the host enqueues several replays while the device runs, else 1).
        top_p_candidates: at top-p < 1, decode steps sample from each row's this many
            largest logits (:func:`~mlperf_grpo.inference.sampling.sample_tokens_from_candidates`:
            no full-vocabulary sort); a block of steps in which some live row's nucleus
            was not among them runs again from its start with :func:`sample_tokens`
            (``rerun_steps`` counts them), and the call's later blocks take twice as
            many candidates, up to :data:`MAX_CANDIDATES`, then :func:`sample_tokens`
            (a wide nucleus costs a few blocks a call at most). 0 (the default): always
            :func:`sample_tokens`.
        fused_kernels: run the decode step with :mod:`~mlperf_grpo.inference.fused_decode`'s
            fused elementwise kernels (``torch.compile``; default: with ``cuda_graphs``).
        prefill_graphs: pad each admission to a bucket (rows: a power of two, the padding
            rows writing to the cache's spare row; width: a multiple of
            :data:`PREFILL_WIDTH_BLOCK`) and, with ``cuda_graphs``, capture each bucket's
            prefill as a CUDA graph (one launch instead of an eager forward's thousands;
            a capture that fails, or whose replay differs from the eager run it follows,
            turns them off with one warning line). On the CPU the bucketed prefill runs
            eagerly. Default off.

    The cache, the per-slot state and the graphs are kept between calls and rebuilt
    only when a call needs more rows, columns or tokens (columns are allocated in
    multiples of ``key_block``), so repeated calls of one shape (an evaluator's
    checkpoints, a training's rollouts) capture nothing new.
    """

    def __init__(self, model: PreTrainedModel, slots: int, pad_token_id: int, cuda_graphs: bool,
                 key_block: int = 64, check_every: int | None = None, top_p_candidates: int = 0,
                 fused_kernels: bool | None = None, prefill_graphs: bool = False) -> None:
        if cuda_graphs and model.device.type != "cuda":
            raise ValueError("cuda_graphs needs a model on a CUDA device")
        self.model = model
        self.slots = slots
        self.pad_token_id = pad_token_id
        self.cuda_graphs = cuda_graphs
        self.key_block = key_block
        self.check_every = check_every if check_every is not None else (8 if cuda_graphs else 1)
        self.top_p_candidates = top_p_candidates
        self._candidates = top_p_candidates  # this call's (doubled after each block run again; 0: none)
        self.fused_kernels = fused_decode.fuse(model) if (cuda_graphs if fused_kernels is None else fused_kernels) \
            else []  # the kinds of fused kernels the decode step runs
        self.cache: SlotCache | None = None
        self.state: SlotState | None = None
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.prefill_graphs = prefill_graphs
        self._prefill_graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, _PrefillInputs]] = {}
        self._kv_layout: tuple[list[tuple[int, int]], torch.dtype] | None = None  # per layer (kv_heads, head_dim); dtype
        self._eos: dict[tuple[int, ...], torch.Tensor] = {}  # device copies a graph reads
        self._pool = None
        forward_args = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        # a prefill needs the last position's logits only ([n, W, V] would be 2.5 GB at 256 x 32 x 151,936 bf16)
        self._last_logits = {"logits_to_keep": 1} if "logits_to_keep" in forward_args else {}
        self.decode_steps = 0  # decode steps run by the last call (forward passes after its prefills)
        self.rerun_steps = 0  # of the last call: steps run again with sample_tokens (a nucleus beyond the candidates)
        self.graph_captures = 0  # of the last call: decode steps and prefills captured as new CUDA graphs
        self.prefills = 0  # of the last call: admissions (each one eager forward over the prompts admitted together)
        self.prefill_ms = 0.0  # of the last call: their time on the device (CUDA events; the CPU: wall time)
        self._prefill_times: list = []  # this call's (start, end) events, or wall seconds on the CPU
        if self.check_every < 1:
            raise ValueError(f"check_every is {self.check_every}; it must be >= 1")

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
        self.decode_steps = self.rerun_steps = self.graph_captures = self.prefills = 0
        self.prefill_ms, self._prefill_times = 0.0, []
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
        length = _round_up(self._prefill_width(max(len(p) for p in prompts)) + max_new_tokens, self.key_block)
        waiting = deque(range(len(prompts)))
        owner = [-1] * slots  # prompt index per slot; -1: empty
        results: list[tuple[list[int], list[float]] | None] = [None] * len(prompts)
        rows = slots
        self._candidates = self.top_p_candidates

        def admit(free: list[int]) -> None:
            taken = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
            if taken:
                self._prefill(free[: len(taken)], [prompts[i] for i in taken], [seeds[i] for i in taken],
                              call, slots, length)
                for slot, index in zip(free, taken):
                    owner[slot] = index

        admit(list(range(slots)))
        state = self.state
        block = None  # the last block of steps, while it may have to run again
        while True:
            # the one host sync of a block of steps: which rows ended, their lengths, and
            # whether a row sampled outside its candidates (then the block runs again exactly)
            status = torch.cat([state.done[:rows].long(), state.counts[:rows], state.inexact.long()]).tolist()
            if status[-1]:
                self._run_again(call, block)
                block = None
                continue
            done, counts = status[:rows], status[rows:-1]
            finished = [s for s in range(rows) if owner[s] >= 0 and done[s]]
            for slot, row in zip(finished, state.take(finished, [counts[s] for s in finished])):
                results[owner[slot]] = row
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
            # up to check_every steps before the next look, none after every live row has
            # reached its limit (a live row has not ended: its count is the host mirror's;
            # rows admitted at their limit, max_new_tokens 1, are done: look again, no step)
            steps = min(self.check_every, max_new_tokens - min(state.count_cpu[s] for s in live))
            if steps < 1:
                continue
            key_length = min(length, _round_up(max(state.column_cpu[s] for s in live) + steps, self.key_block))
            block = self._run_block(call, rows, key_length, steps, exact=False)
            self.decode_steps += steps
        # the loop's last look synchronized after every prefill, so their events are complete
        self.prefill_ms = sum(t if isinstance(t, float) else t[0].elapsed_time(t[1]) for t in self._prefill_times)
        return results  # type: ignore[return-value]

    def _prefill(self, free: list[int], prompts: list[list[int]], seeds: list[int], call: _Call, slots: int,
                 length: int) -> None:
        """:meth:`_prefill_ops`, counted and timed (``prefills``, ``prefill_ms``)."""
        self.prefills += 1
        if self.model.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._prefill_ops(free, prompts, seeds, call, slots, length)
            end.record()
            self._prefill_times.append((start, end))
        else:
            start_s = time.perf_counter()
            self._prefill_ops(free, prompts, seeds, call, slots, length)
            self._prefill_times.append((time.perf_counter() - start_s) * 1e3)

    def _prefill_ops(self, free: list[int], prompts: list[list[int]], seeds: list[int], call: _Call, slots: int,
                     length: int) -> None:
        """Start the ``free`` slots' rows: their prompts left-padded to their longest (or,
        with ``prefill_graphs``, to a bucket of rows and width), their keys and values
        written into their cache rows, and each one's first token sampled
        (:meth:`_prefill_body`)."""
        shapes, dtype = self._layout()
        self._ensure(shapes, slots, length, call.max_new_tokens, dtype)
        n, width = len(prompts), self._prefill_width(max(len(p) for p in prompts))
        rows = _bucket(n, slots) if self.prefill_graphs else n
        pads = [width - len(p) for p in prompts]
        self.state.start(free[:n], seeds, pads, [len(p) for p in prompts], width, self.cache, call.max_new_tokens)
        # padding rows: one pad token each (a row that attends to something), written to the spare row
        ids = [[self.pad_token_id] * pad + p for pad, p in zip(pads, prompts)] + [[self.pad_token_id] * width] * (rows - n)
        pads += [width - 1] * (rows - n)
        positions = [[0] * pad + list(range(width - pad)) for pad in pads]  # as generate numbers a left-padded row
        host = [ids, positions, pads, free[:n] + [self.cache.spare_row] * (rows - n)]
        key = (rows, width, call)
        if not (self.prefill_graphs and self.cuda_graphs) or key not in self._prefill_graphs:
            inputs = _PrefillInputs(*(torch.tensor(h, device=self.model.device) for h in host))
            if not (self.prefill_graphs and self.cuda_graphs):
                self._prefill_body(call, inputs)
                return
            graph = self._capture_prefill(call, inputs)
            if graph is None:  # turned off (warned); the eager run filled the rows
                return
            self._prefill_graphs[key] = (graph, inputs)
            self.graph_captures += 1
            return
        graph, inputs = self._prefill_graphs[key]
        for buffer, values in zip(inputs, host):
            buffer.copy_(torch.tensor(values), non_blocking=False)
        graph.replay()

    def _prefill_width(self, width: int) -> int:
        """The columns a prefill of prompts of at most ``width`` tokens fills."""
        return _round_up(width, PREFILL_WIDTH_BLOCK) if self.prefill_graphs else width

    def _layout(self) -> tuple[list[tuple[int, int]], torch.dtype]:
        """Per layer ``(kv_heads, head_dim)`` of the model's cache, and its dtype (read
        once from a one-token forward into a ``DynamicCache``)."""
        if self._kv_layout is None:
            probe = DynamicCache(config=self.model.config)
            self.model(input_ids=torch.tensor([[self.pad_token_id]], device=self.model.device), use_cache=True,
                       **{self._cache_arg: probe}, **self._last_logits)
            self._kv_layout = ([(layer.keys.shape[1], layer.keys.shape[3]) for layer in probe.layers],
                               probe.layers[0].keys.dtype)
        return self._kv_layout

    def _prefill_body(self, call: _Call, inputs: _PrefillInputs) -> None:
        """Forward ``inputs``' ``[R, W]`` prompts through :class:`PrefillWriter` into
        their cache rows and record each row's first token; device tensors only (no
        host sync), so it can be captured.

        Row ``r`` attends, at position ``q``, to its columns ``[pad_r, q]``; a padding
        position (``q < pad_r``) to itself only, so every key and value stays finite
        (the rows' own positions never see them). The first token is
        :func:`sample_tokens`' (exact, no host sync), with the row's first uniform."""
        ids, positions, pads, rows = inputs
        width = ids.shape[1]
        arange = self.state.arange[:width]
        causal = arange[None, :] <= arange[:, None]  # [W(q), W(k)]
        visible = (causal[None] & (arange[None, None, :] >= pads[:, None, None])) | torch.eye(
            width, dtype=torch.bool, device=ids.device)[None]  # [R, W, W]
        with _attention(self.model, "sdpa"), sdpa_kernel(PREFILL_SDPA_BACKENDS):
            logits = self.model(input_ids=ids, attention_mask=visible[:, None], position_ids=positions, use_cache=True,
                                **{self._cache_arg: PrefillWriter(self.cache, rows)}, **self._last_logits
                                ).logits[:, -1]  # [R, V]
        chosen, logprob = sample_tokens(logits, self.state.uniforms[rows, :1], call.temperature, call.top_p)
        self.state.record_first(rows, chosen[:, 0], logprob[:, 0], self._eos_tensor(call), call.max_new_tokens)

    def _capture_prefill(self, call: _Call, inputs: _PrefillInputs) -> torch.cuda.CUDAGraph | None:
        """Run :meth:`_prefill_body` eagerly (twice: kernels pick their algorithms and
        allocate outside the capture), capture it and replay it; the replay must give the
        eager run's first tokens, log-probabilities and last layer's keys bit for bit (the
        same kernels), else (or when the capture fails) prefill graphs are turned off with
        one warning and None is returned. The body is idempotent (it only assigns), so the
        rows end as one prefill leaves them."""
        rows = inputs.rows
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._prefill_body(call, inputs)
        torch.cuda.current_stream().wait_stream(stream)
        eager = [self.state.tokens[rows, 0], self.state.logprobs[rows, 0], self.cache.keys[-1][rows]]
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._prefill_body(call, inputs)
            graph.replay()
            real = inputs.rows != self.cache.spare_row  # the spare row's writes race among its repeats
            replayed = [self.state.tokens[rows, 0], self.state.logprobs[rows, 0], self.cache.keys[-1][rows]]
            if all(torch.equal(a[real], b[real]) for a, b in zip(eager, replayed)):
                return graph
            problem = "its replay differs from the eager prefill"
        except RuntimeError as err:
            problem = f"the capture failed ({str(err).splitlines()[0] if str(err) else type(err).__name__})"
        warnings.warn(f"prefill graphs turned off: {problem}; prefills run eagerly", stacklevel=2)
        self.prefill_graphs = False
        self._prefill_body(call, inputs)  # the rows as the eager prefill leaves them
        return None

    def _ensure(self, shapes: list[tuple[int, int]], slots: int, length: int, max_new_tokens: int,
                dtype: torch.dtype) -> None:
        """A cache and state large enough for this call; new ones drop the graphs (which
        read the old ones' memory)."""
        if (self.cache is not None and self.cache.fits(shapes, slots, length, dtype)
                and self.state.fits(slots, max_new_tokens, length)):
            return
        self._graphs.clear()
        self._prefill_graphs.clear()
        self._pool = None  # a pool outlives its graphs only while one holds it (CUDACachingAllocator)
        self.cache = self.state = None
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()
        self.cache = SlotCache(shapes, slots, length, dtype, self.model.device)
        self.state = SlotState(slots, max_new_tokens, length, self.model.device)

    def _eos_tensor(self, call: _Call) -> torch.Tensor:
        """``[E]`` int64 device tensor of the call's EOS ids, kept for the graphs that read it."""
        if call.eos not in self._eos:
            self._eos[call.eos] = torch.tensor(call.eos, dtype=torch.long, device=self.model.device)
        return self._eos[call.eos]

    def _uses_candidates(self, call: _Call, exact: bool) -> bool:
        """Whether a step samples from candidates (:func:`sample_tokens_from_candidates`)."""
        return not exact and self._candidates > 0 and call.top_p < 1.0

    def _run_block(self, call: _Call, rows: int, key_length: int, steps: int, exact: bool) -> tuple | None:
        """``steps`` decode steps; returns what :meth:`_run_again` needs when they sample
        from candidates (the state before them), else None."""
        candidates = self._uses_candidates(call, exact)
        block = (rows, key_length, steps, self.state.snapshot(self.cache)) if candidates else None
        for _ in range(steps):
            self._step(call, rows, key_length, exact=not candidates)  # a graph's key: how it samples
        return block

    def _run_again(self, call: _Call, block: tuple) -> None:
        """Undo ``block`` (a row's nucleus was outside its candidates) and run its steps
        again with :func:`sample_tokens`; the keys and values the undone steps wrote are
        rewritten at the same columns."""
        rows, key_length, steps, saved = block
        self.state.restore(saved, self.cache)
        self.rerun_steps += steps
        self._candidates = 2 * self._candidates if 2 * self._candidates <= MAX_CANDIDATES else 0
        self._run_block(call, rows, key_length, steps, exact=True)

    def _step(self, call: _Call, rows: int, key_length: int, exact: bool) -> None:
        """One decode step of the first ``rows`` slots over ``key_length`` columns."""
        if not self.cuda_graphs:
            self._step_body(call, rows, key_length, exact)
        else:
            key = (rows, key_length, call, exact, self._candidates)
            graph = self._graphs.get(key)
            if graph is None:
                graph = self._graphs[key] = self._capture(call, rows, key_length, exact)
                self.graph_captures += 1
            graph.replay()
        self.state.advance_cpu(rows)

    def _capture(self, call: _Call, rows: int, key_length: int, exact: bool) -> torch.cuda.CUDAGraph:
        """Warm up and capture :meth:`_step_body`; the state it changes is restored
        (keys and values written at the write columns are rewritten by the real step)."""
        saved = self.state.snapshot(self.cache)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # kernels pick their algorithms and allocate outside the capture
                self._step_body(call, rows, key_length, exact)
                self.state.restore(saved, self.cache)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the one-step-async rollouts capture on their own thread while the
        # training thread allocates and synchronizes (global mode would fail those calls)
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._step_body(call, rows, key_length, exact)
        self.state.restore(saved, self.cache)
        return graph

    def _decode_logits(self, rows: int, key_length: int) -> torch.Tensor:
        """``[rows, V]`` next-token logits of the first ``rows`` slots (their last tokens
        at their positions and write columns), each attending to its columns ``[start,
        column]`` of the first ``key_length``; writes their keys and values."""
        state = self.state
        columns = self.cache.write_columns[:rows]  # [r]
        arange = state.arange[:key_length]
        visible = (arange >= state.starts[:rows, None]) & (arange <= columns[:, None])  # [r, K]
        bias = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill_(~visible, -torch.inf)
        return self.model(
            input_ids=state.last[:rows, None], position_ids=state.positions[:rows, None],
            attention_mask=bias[:, None, None, :], use_cache=True, **{self._cache_arg: self.cache},
        ).logits[:, -1]

    def _step_body(self, call: _Call, rows: int, key_length: int, exact: bool) -> None:
        """Forward the first ``rows`` slots' last tokens, sample, record, advance; device
        tensors only (no host sync), so it can be captured."""
        with _attention(self.model, SLOT_ATTENTION), fused_decode.fused() if self.fused_kernels else contextlib.nullcontext():
            self._step_ops(call, rows, key_length, exact)

    def _step_ops(self, call: _Call, rows: int, key_length: int, exact: bool) -> None:
        """:meth:`_step_body` inside the slot attention and, if on, the fused kernels."""
        state, cache = self.state, self.cache
        columns = cache.write_columns[:rows]  # [r]
        logits = self._decode_logits(rows, key_length)  # [r, V]
        counts, done = state.counts[:rows], state.done[:rows]
        # a row that has ended keeps its count and writes past its tokens (at its limit:
        # the spare column), so steps may run between two looks at which rows ended
        at = counts[:, None]  # [r, 1]
        uniforms = state.uniforms[:rows].gather(1, at.clamp(max=call.max_new_tokens - 1))
        if self._uses_candidates(call, exact):
            chosen, logprob, ok = sample_tokens_from_candidates(logits, uniforms, call.temperature, call.top_p,
                                                                self._candidates, fused_decode.block_masses_fn())
            state.inexact |= (~ok & ~done).any().view(1)  # ended rows' samples are thrown away
        elif call.top_p == 1.0:
            chosen, logprob = sample_tokens_by_blocks(logits, uniforms, call.temperature, fused_decode.block_masses_fn())
        else:
            chosen, logprob = sample_tokens(logits, uniforms, call.temperature, call.top_p)
        state.tokens[:rows].scatter_(1, at, chosen)
        state.logprobs[:rows].scatter_(1, at, logprob)
        state.last[:rows] = chosen[:, 0]
        columns.add_(1).clamp_(max=cache.length - 1)
        state.positions[:rows].add_(1)
        counts.add_((~done).long())
        done |= (chosen == self._eos_tensor(call)[None, :]).any(-1) | (counts >= call.max_new_tokens)


class _PrefillInputs(NamedTuple):
    """A prefill's device inputs (a captured one's static buffers): ``ids`` and
    ``positions`` ``[R, W]`` int64, ``pads`` ``[R]`` (each row's first prompt column)
    and ``rows`` ``[R]`` (its cache row)."""

    ids: torch.Tensor
    positions: torch.Tensor
    pads: torch.Tensor
    rows: torch.Tensor


PREFILL_WIDTH_BLOCK = 16
"""With ``prefill_graphs``, prefill widths are multiples of this many columns."""

MAX_CANDIDATES = 4096
"""The most logits per row :class:`SlotDecoder`'s doubling takes before it sorts the vocabulary."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _bucket(live: int, rows: int) -> int:
    """The smallest power of two >= ``live`` and >= 2 if it is below ``rows``, else
    ``rows``."""
    size = 2
    while size < live:
        size *= 2
    return min(size, rows)
