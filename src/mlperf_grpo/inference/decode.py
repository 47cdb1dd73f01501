"""A decode loop over a per-slot KV cache, with refilled slots and (on CUDA) each
decode step captured as a CUDA graph.

``SlotDecoder.generate`` keeps ``slots`` rows in flight. Each slot holds one prompt's
keys and values in a ``[slots, kv_heads, length, head_dim]`` cache per layer
(:class:`SlotCache`: allocated at the call's full length where that fits its budget,
else grown with the live rows' lengths, fewer rows as they end) and has its own write
column, position and token count, so a slot
whose row has finished (EOS or the token limit) takes the next waiting prompt at once
(its prefill: the prompts admitted together, left-padded to their longest; one longer
than ``prefill_chunk`` alone, in chunks).
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
:func:`~mlperf_grpo.inference.slot_attention.slot_attention` (two batched products over the cache view). With CUDA graphs
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
path (:func:`~mlperf_grpo.inference.slot_attention.supports_slot_decoding`): hybrid linear-attention models (Qwen3.5's gated
delta-net) and sliding-window layers keep ``generate``.

The prefills are in :mod:`~mlperf_grpo.inference.slot_prefill`, the decode step in
:mod:`~mlperf_grpo.inference.slot_step`, the attention in
:mod:`~mlperf_grpo.inference.slot_attention`; this module holds the loop.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from mlperf_grpo.inference import fused_decode
from mlperf_grpo.inference.slot_prefill import PREFILL_CHUNK, PrefillInputs, PrefillSteps, bucket_rows, round_up
from mlperf_grpo.inference.slot_schedule import KVCacheBudgetError, Resumed, Schedule, rows_fitting
from mlperf_grpo.inference.slot_state import DecodeCall, SlotCache, SlotState, row_column_bytes
from mlperf_grpo.inference.slot_step import DecodeSteps


FREE_FRACTION = 0.8
"""Without ``kv_cache_bytes``, the share of the device's free memory a CUDA call's KV
cache may take (the rest: the steps' and prefills' activations, the graphs' pool)."""


@dataclass(frozen=True)
class DecodeOptions:
    """How :class:`SlotDecoder` runs (each field described in its docstring)."""

    cuda_graphs: bool = False
    key_block: int = 64
    check_every: int | None = None
    top_p_candidates: int = 0
    fused_kernels: bool | None = None
    prefill_graphs: bool = False
    kv_cache_bytes: int | None = None
    prefill_chunk: int = PREFILL_CHUNK


class SlotDecoder(PrefillSteps, DecodeSteps):
    """Generates completions for many prompts through at most ``slots`` refilled slots.

    Args:
        model: a causal LM for which :func:`supports_slot_decoding` holds (eval mode).
        slots: the most rows decoded at once.
        pad_token_id: the id left padding uses in a prefill.
        options: :class:`DecodeOptions`:
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
        kv_cache_bytes: the most bytes the KV cache takes, growths included (a
            compaction's reorder copies one tensor's rows at a time beside it). A call
            whose rows all fit it at full length (the longest prompt +
            ``max_new_tokens``) allocates them at once (a static cache); else the cache
            starts at the first steps' columns and grows as the rows get longer
            (:meth:`_make_room`), and where the budget does not hold the live rows at the
            new width, rows are preempted and resumed later (``preempted``). None: on
            CUDA :data:`FREE_FRACTION` of the device's free memory at the call's start and
            at each growth (with what the cache and the caching allocator already hold);
            on the CPU no limit.
        prefill_chunk: a fresh prompt of more tokens is prefilled alone, this many
            columns at a time, as a preempted row is resumed (:meth:`_chunked_ops`: a
            ``[C, columns]`` mask and ``C`` positions' activations, not ``[W, W]`` and
            ``W``); shorter ones together (:meth:`_prefill_ops`, ``prefill_graphs``).
            Their tokens are those of one prefill up to float rounding.

    The cache, the per-slot state and the graphs are kept between calls and rebuilt
    only when a call needs more rows, columns or tokens (columns are allocated in
    multiples of ``key_block``), so repeated calls of one shape (an evaluator's
    checkpoints, a training's rollouts) capture nothing new.

    A growing cache: its columns are the first power-of-two multiple of ``key_block``
    that holds the next block of steps (at most the call's full length), and before a
    block that needs more it is widened (:meth:`SlotCache.grow`) holding only the first
    ``rows`` slots, the step's bucket (the live slots, compacted to the front once no
    prompt waits): ``rows x columns``, not ``slots x length``. The graphs captured on the
    old tensors are dropped and captured again as the steps need them. The tokens are
    those of a static cache (the same columns, read the same way). Where the budget does
    not hold the live rows at the new width, those of fewest columns are preempted, as
    vLLM's recompute preemption: they wait first, and a freed slot prefills their prompt
    and tokens again and samples on at their next uniform (their tokens are those of an
    uninterrupted row up to the float rounding of recomputed keys, as any change of
    batch gives).
    """

    def __init__(self, model: PreTrainedModel, slots: int, pad_token_id: int,
                 options: DecodeOptions = DecodeOptions()) -> None:
        cuda_graphs, check_every = options.cuda_graphs, options.check_every
        if cuda_graphs and model.device.type != "cuda":
            raise ValueError("cuda_graphs needs a model on a CUDA device")
        self.model = model
        self.slots = slots
        self.pad_token_id = pad_token_id
        self.cuda_graphs = cuda_graphs
        self.key_block = options.key_block
        self.check_every = check_every if check_every is not None else (8 if cuda_graphs else 1)
        self.top_p_candidates = options.top_p_candidates
        self._candidates = options.top_p_candidates  # this call's (doubled after each block run again; 0: none)
        self.fused_kernels = fused_decode.fuse(model) if (cuda_graphs if options.fused_kernels is None else options.fused_kernels) \
            else []  # the kinds of fused kernels the decode step runs
        self.cache: SlotCache | None = None
        self.state: SlotState | None = None
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.prefill_graphs = options.prefill_graphs
        self._prefill_graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, PrefillInputs]] = {}
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
        self.prefills = 0  # of the last call: prefills (the short prompts admitted together; each row in chunks)
        self.prefill_ms = 0.0  # of the last call: their time on the device (CUDA events; the CPU: wall time)
        self.kv_cache_bytes = options.kv_cache_bytes
        self.prefill_chunk = options.prefill_chunk
        self.cache_grows = 0  # of the last call: times the KV cache was widened
        self.preempted = 0  # of the last call: rows preempted to keep the cache within its budget (then resumed)
        self.kv_cache_peak_bytes = 0  # of the last call: the most bytes its KV cache tensors held at once
        self._prefill_times: list = []  # this call's (start, end) events, or wall seconds on the CPU
        if self.check_every < 1 or self.prefill_chunk < 1:
            raise ValueError(f"check_every is {self.check_every} and prefill_chunk {self.prefill_chunk}; both "
                             "must be >= 1")

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
        self.decode_steps = self.rerun_steps = self.graph_captures = self.prefills = self.cache_grows = 0
        self.preempted = 0
        self.prefill_ms, self._prefill_times = 0.0, []
        _check_arguments(prompts, seeds, max_new_tokens)
        if not prompts:
            return []
        call = DecodeCall(temperature, top_p, max_new_tokens, tuple(sorted(set(eos_token_ids))) or (-1,))
        slots, length = self._start(prompts, max_new_tokens)
        plan = Schedule(len(prompts), slots)
        self._candidates = self.top_p_candidates
        state = self.state
        block = None  # the last block of steps, while it may have to run again
        self._admit(plan, prompts, seeds, call)
        while True:
            # the one host sync of a block of steps: which rows ended, their lengths, and
            # whether a row sampled outside its candidates (then the block runs again exactly)
            rows = plan.rows
            status = torch.cat([state.done[:rows].long(), state.counts[:rows], state.inexact.long()]).tolist()
            if status[-1]:
                self._run_again(call, block)
                block = None
                continue
            done, counts = status[:rows], status[rows:-1]
            finished = [s for s in range(rows) if plan.owner[s] >= 0 and done[s]]
            if finished:
                plan.finish(finished, state.take(finished, [counts[s] for s in finished]))
            if plan.waiting:
                self._admit(plan, prompts, seeds, call)  # the empty slots (those, and any a preemption left)
            live = plan.live()
            if not live:
                break
            if not plan.waiting and bucket_rows(len(live), rows) < rows:  # the live slots to the front
                plan.compact(state, self.cache, bucket_rows(len(live), rows))
                live = plan.live()
            steps, key_length = self._next_block(live, length, max_new_tokens)
            if steps < 1:
                continue
            if key_length > self.cache.length:  # the live rows at their next columns (at most ``length``)
                self._make_room(plan, key_length, length)
                steps, key_length = self._next_block(plan.live(), length, max_new_tokens)
            block = self._run_block(call, plan.rows, key_length, steps, exact=False)
            self.decode_steps += steps
        # the loop's last look synchronized after every prefill, so their events are complete
        self.prefill_ms = sum(t if isinstance(t, float) else t[0].elapsed_time(t[1]) for t in self._prefill_times)
        return plan.results  # type: ignore[return-value]

    def _admit(self, plan: Schedule, prompts: list[list[int]], seeds: list[int], call: DecodeCall) -> None:
        """Waiting prompts into the empty slots: the fresh ones of at most
        ``prefill_chunk`` tokens in one prefill; each longer one, and each preempted one,
        in its own, in chunks (:meth:`_prefill_chunked`; a fresh one: no tokens yet)."""
        taken = plan.take()
        fresh = [(slot, i) for slot, i in taken if isinstance(i, int) and len(prompts[i]) <= self.prefill_chunk]
        if fresh:
            self._prefill([s for s, _ in fresh], [prompts[i] for _, i in fresh], [seeds[i] for _, i in fresh], call,
                          len(plan.owner))
        for slot, row in taken:
            if isinstance(row, int) and len(prompts[row]) > self.prefill_chunk:
                row = Resumed(row, [], [])
            if isinstance(row, Resumed):
                self._prefill_chunked(slot, prompts[row.index], row, seeds[row.index], call)

    def _next_block(self, live: list[int], length: int, max_new_tokens: int) -> tuple[int, int]:
        """Steps before the next look and the key length they read: up to
        ``check_every``, none after every live row has reached its limit (a live row has
        not ended: its count is the host mirror's; rows admitted at their limit,
        max_new_tokens 1, are done: look again, no step); the columns its longest live
        row reaches, in ``key_block``s."""
        state = self.state
        steps = min(self.check_every, max_new_tokens - min(state.count_cpu[s] for s in live))
        return steps, min(length, round_up(max(state.column_cpu[s] for s in live) + steps, self.key_block))

    def release(self) -> None:
        """Free the KV cache, the per-slot state and the CUDA graphs with their memory pool
        (back to the device: ``torch.cuda.empty_cache``); the next call allocates them
        again and captures its graphs anew. For a policy that trains on the same device
        between rollouts (``train/memory_fit.py``)."""
        self._drop_graphs()
        self.cache = self.state = None
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    def _start(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[int, int]:
        """A call's slots (fewer where the budget does not hold them all at the first
        columns) and ``length``, the most columns a row takes (its longest prompt +
        ``max_new_tokens``); the cache and state it starts with (:meth:`_ensure`).

        Raises:
            KVCacheBudgetError: the budget does not hold one row at the first columns.
        """
        slots = min(self.slots, len(prompts))
        first = self._prefill_width(max(len(p) for p in prompts))
        length = round_up(first + max_new_tokens, self.key_block)
        budget = self._budget()
        spare = self.prefill_graphs  # a spare row for the padding rows of bucketed prefills
        static = budget is None or rows_fitting(budget, self._row_column_bytes(), length, spare=spare) >= slots
        width = length if static else self._width(first + self.check_every, length)
        shapes, dtype = self._layout()
        if self.cache is None or not self.cache.fits(shapes, slots, width, dtype):  # a new cache: as many rows as fit
            slots = min(slots, self._fitting(budget, width, spare))
        self._ensure(slots, length, width, max_new_tokens)
        self.kv_cache_peak_bytes = self.cache.nbytes
        return slots, length

    def _ensure(self, slots: int, length: int, width: int, max_new_tokens: int) -> None:
        """A state for ``slots`` rows of ``max_new_tokens`` tokens and ``length`` columns,
        and a cache of at least ``slots`` rows and ``width`` columns; a new cache drops the
        graphs (which read the old one's memory). The cache never has more rows than the
        state (its spare row is a state row no call's slot uses)."""
        shapes, dtype = self._layout()
        if self.state is None or not self.state.fits(slots, max_new_tokens, length):
            self.release()
            self.state = SlotState(slots, max_new_tokens, length, self.model.device)
        if self.cache is None or not self.cache.fits(shapes, slots, width, dtype):
            self._drop_graphs()
            self.cache = None
            if self.model.device.type == "cuda":
                torch.cuda.empty_cache()
            self.cache = SlotCache(shapes, slots, width, dtype, self.model.device, spare=self.prefill_graphs)

    def _width(self, need: int, length: int) -> int:
        """The cache's columns for ``need``: the first power-of-two multiple of
        ``key_block`` that holds it, at most ``length``."""
        width = self.key_block
        while width < need:
            width *= 2
        return min(width, length)

    def _budget(self) -> int | None:
        """``kv_cache_bytes``, or its default (the class docstring)."""
        if self.kv_cache_bytes is not None or self.model.device.type != "cuda":
            return self.kv_cache_bytes
        device = self.model.device
        free = torch.cuda.mem_get_info(device)[0]
        held = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(FREE_FRACTION * (free + held + (self.cache.nbytes if self.cache is not None else 0)))

    def _row_column_bytes(self) -> int:
        """Bytes of one row's column of the cache (keys and values of every layer)."""
        return row_column_bytes(*self._layout())

    def _fitting(self, budget: int | None, width: int, spare: bool) -> int:
        """The most rows the budget holds at ``width`` columns (and a ``spare`` row; no
        limit: a large number).

        Raises:
            KVCacheBudgetError: not one.
        """
        if budget is None:
            return 1 << 62
        rows = rows_fitting(budget, self._row_column_bytes(), width, spare=spare)
        if rows < 1:
            raise KVCacheBudgetError(
                f"the KV cache's budget of {budget:,} bytes holds no row of {width:,} columns "
                f"({(1 + spare) * (width + 1) * self._row_column_bytes():,} bytes{' with the spare row' * spare}): "
                "give the engine more memory (kv_cache_bytes) or generate fewer tokens")
        return rows

    def _make_room(self, plan: Schedule, key_length: int, length: int) -> None:
        """Widen the cache for ``key_length`` columns. Where the budget does not hold the
        step's rows at the new width (with what a growth holds at once: :meth:`_growth_rows`),
        the live rows of fewest columns are preempted (their prompts and tokens wait
        first, recomputed when a slot frees) and the rest moved to the front: the rows the
        budget holds, or fewer (their bucket) when nothing waits."""
        width = self._width(key_length, length)
        fitting, staged = self._growth_rows(self._budget(), width, len(plan.live()))
        if plan.rows > fitting:
            live = plan.live()
            if len(live) > fitting:
                out = sorted(live, key=lambda s: self.state.column_cpu[s])[: len(live) - fitting]
                plan.preempt(out, self.state.take(out, [self.state.count_cpu[s] for s in out]))
                self.preempted += len(out)
            plan.compact(self.state, self.cache, fitting if plan.waiting else bucket_rows(len(plan.live()), fitting))
        self._grow(plan.rows, width, staged)

    def _growth_rows(self, budget: int | None, width: int, live: int) -> tuple[int, bool]:
        """The most rows a growth to ``width`` columns keeps within ``budget``, and
        whether it stages them through host memory: copied on the device (the new
        tensors beside the old ones not yet copied: all new and one old, or all old and
        one new, :meth:`SlotCache.grow`) unless that holds fewer than the ``live`` rows
        and fewer than staging holds (then nothing is allocated beside the new cache).

        Raises:
            KVCacheBudgetError: not one row, even staged.
        """
        cache, itemsize = self.cache, self.cache.keys[0].element_size()
        staged = self._fitting(budget, width, cache.spare)
        if budget is None:
            return staged, False
        largest = max(t.numel() * t.element_size() for t in (*cache.keys, *cache.values))
        per_tensor = max(k.shape[1] * k.shape[3] for k in cache.keys) * itemsize  # a row's column of one tensor
        on_device = min(rows_fitting(budget, self._row_column_bytes(), width, largest, cache.spare),
                        rows_fitting(budget - cache.nbytes, per_tensor, width, spare=cache.spare))
        return (on_device, False) if on_device >= min(live, staged) else (staged, True)

    def _grow(self, rows: int, width: int, staged: bool = False) -> None:
        """Widen the cache to ``width`` columns, keeping its first ``rows`` rows (every
        live slot: the loop grows after it compacts them); drops the graphs, which read
        the old tensors (called after the loop's host sync, so no replay is in flight)."""
        self._drop_graphs()
        self.kv_cache_peak_bytes = max(self.kv_cache_peak_bytes, self.cache.grow(rows, width, staged))
        self.cache_grows += 1
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()  # the old tensors' blocks, which fit no later allocation of a wider cache

    def _drop_graphs(self) -> None:
        """Drop the decode-step and prefill graphs and their memory pool (the next
        captures take a new one)."""
        self._graphs.clear()
        self._prefill_graphs.clear()
        self._pool = None  # a pool outlives its graphs only while one holds it (CUDACachingAllocator)


def _check_arguments(prompts: list[list[int]], seeds: list[int], max_new_tokens: int) -> None:
    """Raises: ValueError: as :meth:`SlotDecoder.generate`."""
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens is {max_new_tokens}; it must be >= 1")
