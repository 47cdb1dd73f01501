"""The slot decoder's prefills (:class:`PrefillSteps`, methods of
:class:`~mlperf_grpo.inference.decode.SlotDecoder`): the short prompts admitted together
written straight into their slots' cache rows (:class:`~mlperf_grpo.inference.slot_state.PrefillWriter`)
and their first tokens sampled, eagerly or, with ``prefill_graphs``, padded to a bucket
and captured as a CUDA graph per bucket; a long prompt, or a preempted row resumed, alone
and in chunks of columns (:class:`~mlperf_grpo.inference.slot_state.ChunkWriter`)."""

from __future__ import annotations

import time
import warnings
from typing import NamedTuple

import torch
from transformers import DynamicCache

from mlperf_grpo.inference.sampling import sample_tokens
from mlperf_grpo.inference.slot_attention import attention_implementation
from mlperf_grpo.inference.slot_schedule import Resumed
from mlperf_grpo.inference.slot_state import ChunkWriter, DecodeCall, PrefillWriter, first_line
from mlperf_grpo.model.attention import planless_attention

PREFILL_WIDTH_BLOCK = 16
"""With ``prefill_graphs``, prefill widths are multiples of this many columns."""
PREFILL_CHUNK = 1024
"""The default ``DecodeOptions.prefill_chunk``: a fresh prompt of more tokens, and every
resumed row, is prefilled alone this many columns at a time (its mask: ``PREFILL_CHUNK x
columns`` booleans, not ``columns x columns``); shorter fresh prompts are prefilled
together (``[R, W, W]``, ``W`` at most this)."""


class PrefillInputs(NamedTuple):
    """A prefill's device inputs (a captured one's static buffers): ``ids`` and
    ``positions`` ``[R, W]`` int64, ``pads`` ``[R]`` (each row's first prompt column)
    and ``rows`` ``[R]`` (its cache row)."""

    ids: torch.Tensor
    positions: torch.Tensor
    pads: torch.Tensor
    rows: torch.Tensor


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bucket_rows(live: int, rows: int) -> int:
    """The smallest power of two >= ``live`` and >= 2 if it is below ``rows``, else
    ``rows``."""
    size = 2
    while size < live:
        size *= 2
    return min(size, rows)


class PrefillSteps:
    """The prefill half of :class:`~mlperf_grpo.inference.decode.SlotDecoder` (its
    attributes: ``model``, ``cache``, ``state``, ``prefill_graphs``, ...)."""

    def _prefill(self, free: list[int], prompts: list[list[int]], seeds: list[int], call: DecodeCall,
                 slots: int) -> None:
        """:meth:`_prefill_ops`, counted and timed (:meth:`_timed`)."""
        self._timed(self._prefill_ops, free, prompts, seeds, call, slots)

    def _prefill_chunked(self, slot: int, prompt: list[int], row: Resumed, seed: int, call: DecodeCall) -> None:
        """:meth:`_chunked_ops`, counted and timed (:meth:`_timed`)."""
        self._timed(self._chunked_ops, slot, prompt, row, seed, call)

    def _timed(self, ops, *args) -> None:
        """``ops(*args)``, a prefill: counted (``prefills``) and timed (``prefill_ms``: CUDA
        events, the CPU's wall time)."""
        self.prefills += 1
        if self.model.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            ops(*args)
            end.record()
            self._prefill_times.append((start, end))
        else:
            start_s = time.perf_counter()
            ops(*args)
            self._prefill_times.append((time.perf_counter() - start_s) * 1e3)

    def _prefill_ops(self, free: list[int], prompts: list[list[int]], seeds: list[int], call: DecodeCall,
                     slots: int) -> None:
        """Start the ``free`` slots' rows: their prompts left-padded to their longest (or,
        with ``prefill_graphs``, to a bucket of rows and width), their keys and values
        written into their cache rows, and each one's first token sampled
        (:meth:`_prefill_body`). The cache (``_ensure``) holds the call's ``slots`` rows
        and its longest prompt's columns."""
        n, width = len(prompts), self._prefill_width(max(len(p) for p in prompts))
        rows = bucket_rows(n, slots) if self.prefill_graphs else n
        pads = [width - len(p) for p in prompts]
        self.state.start(free[:n], seeds, pads, [len(p) for p in prompts], width, self.cache, call.max_new_tokens)
        # padding rows: one pad token each (a row that attends to something), written to the spare row
        ids = [[self.pad_token_id] * pad + p for pad, p in zip(pads, prompts)] + [[self.pad_token_id] * width] * (rows - n)
        pads += [width - 1] * (rows - n)
        positions = [[0] * pad + list(range(width - pad)) for pad in pads]  # as generate numbers a left-padded row
        host = [ids, positions, pads, free[:n] + [self.cache.spare_row] * (rows - n)]
        key = (rows, width, call)
        if not (self.prefill_graphs and self.cuda_graphs) or key not in self._prefill_graphs:
            inputs = PrefillInputs(*(torch.tensor(h, device=self.model.device) for h in host))
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

    def _chunked_ops(self, slot: int, prompt: list[int], row: Resumed, seed: int, call: DecodeCall) -> None:
        """Slot ``slot`` takes a row alone: a preempted one again, or a fresh long prompt
        (a :class:`Resumed` with no tokens). Its prompt and the ``c`` tokens it had sampled
        are prefilled (columns ``[0, n)``, ``prefill_chunk`` at a time, each chunk
        attending causally to the columns before it: no padding, eager) and its next token
        is sampled at its ``c``-th uniform (:meth:`SlotState.resume`; a fresh row: its
        first, as :meth:`_prefill_body`). Keys and values computed in chunks, or
        recomputed, give the tokens of one prefill, or an uninterrupted row, up to float
        rounding, as any change of batch does."""
        ids, state = prompt + row.tokens, self.state
        n = len(ids)
        state.start([slot], [seed], [0], [n], n, self.cache, call.max_new_tokens)
        ids_t = torch.tensor([ids], device=self.model.device)
        arange = state.arange
        for start in range(0, n, self.prefill_chunk):
            end = min(n, start + self.prefill_chunk)
            visible = arange[None, :end] <= arange[start:end, None]  # [C(q), end(k)]
            with attention_implementation(self.model, "sdpa"), planless_attention():
                logits = self.model(input_ids=ids_t[:, start:end], attention_mask=visible[None, None],
                                    position_ids=arange[None, start:end], use_cache=True,
                                    **{self._cache_arg: ChunkWriter(self.cache, slot, start)}, **self._last_logits
                                    ).logits[:, -1]  # [1, V]
        c = len(row.tokens)
        chosen, logprob = sample_tokens(logits, state.uniforms[slot : slot + 1, c : c + 1], call.temperature, call.top_p)
        state.resume(slot, row.tokens, row.logprobs, chosen, logprob, self._eos_tensor(call), call.max_new_tokens)

    def _prefill_width(self, width: int) -> int:
        """The columns a prefill of prompts of at most ``width`` tokens fills."""
        return round_up(width, PREFILL_WIDTH_BLOCK) if self.prefill_graphs else width

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

    def _prefill_body(self, call: DecodeCall, inputs: PrefillInputs) -> None:
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
        with attention_implementation(self.model, "sdpa"), planless_attention():
            logits = self.model(input_ids=ids, attention_mask=visible[:, None], position_ids=positions, use_cache=True,
                                **{self._cache_arg: PrefillWriter(self.cache, rows)}, **self._last_logits
                                ).logits[:, -1]  # [R, V]
        chosen, logprob = sample_tokens(logits, self.state.uniforms[rows, :1], call.temperature, call.top_p)
        self.state.record_first(rows, chosen[:, 0], logprob[:, 0], self._eos_tensor(call), call.max_new_tokens)

    def _capture_prefill(self, call: DecodeCall, inputs: PrefillInputs) -> torch.cuda.CUDAGraph | None:
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
        except Exception as err:  # noqa: BLE001 - a failed capture turns the graphs off, it never ends a call
            problem = f"the capture failed ({first_line(err)})"
        warnings.warn(f"prefill graphs turned off: {problem}; prefills run eagerly", RuntimeWarning, stacklevel=2)
        self.prefill_graphs = False
        self._abandon_pool()
        self._prefill_body(call, inputs)  # the rows as the eager prefill leaves them
        return None

    def _abandon_pool(self) -> None:
        """Later captures take a new memory pool. A graph dropped after a capture (failed,
        or its replay differed) gives its pool back; once no graph holds a pool, the
        caching allocator may free it, and a capture into that pool's id then fails an
        internal assertion (``use_count > 0``, ``CUDACachingAllocator.cpp``) that ends
        the process. The graphs kept still hold the old pool."""
        self._pool = None
