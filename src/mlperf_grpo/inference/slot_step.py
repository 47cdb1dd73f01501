"""The slot decoder's decode step (:class:`DecodeSteps`, methods of
:class:`~mlperf_grpo.inference.decode.SlotDecoder`): one token for the first ``rows``
slots over ``key_length`` cache columns, sampled on the device, captured once per shape as
a CUDA graph and replayed; blocks of steps sampled from candidates run again exactly when
a row's nucleus was not among them."""

from __future__ import annotations

import contextlib
import warnings

import torch

from mlperf_grpo.inference import fused_decode
from mlperf_grpo.inference.sampling import sample_tokens, sample_tokens_by_blocks, sample_tokens_from_candidates
from mlperf_grpo.inference.slot_attention import SLOT_ATTENTION, attention_implementation
from mlperf_grpo.inference.slot_state import DecodeCall, first_line

MAX_CANDIDATES = 4096
"""The most logits per row :class:`~mlperf_grpo.inference.decode.SlotDecoder`'s doubling takes before it sorts the vocabulary."""


class DecodeSteps:
    """The decode-step half of :class:`~mlperf_grpo.inference.decode.SlotDecoder` (its
    attributes: ``model``, ``cache``, ``state``, ``cuda_graphs``, ``_graphs``, ...)."""

    def _eos_tensor(self, call: DecodeCall) -> torch.Tensor:
        """``[E]`` int64 device tensor of the call's EOS ids, kept for the graphs that read it."""
        if call.eos not in self._eos:
            self._eos[call.eos] = torch.tensor(call.eos, dtype=torch.long, device=self.model.device)
        return self._eos[call.eos]

    def _uses_candidates(self, call: DecodeCall, exact: bool) -> bool:
        """Whether a step samples from candidates (:func:`sample_tokens_from_candidates`)."""
        return not exact and self._candidates > 0 and call.top_p < 1.0

    def _run_block(self, call: DecodeCall, rows: int, key_length: int, steps: int, exact: bool) -> tuple | None:
        """``steps`` decode steps; returns what :meth:`_run_again` needs when they sample
        from candidates (the state before them), else None."""
        candidates = self._uses_candidates(call, exact)
        block = (rows, key_length, steps, self.state.snapshot(self.cache)) if candidates else None
        for _ in range(steps):
            self._step(call, rows, key_length, exact=not candidates)  # a graph's key: how it samples
        return block

    def _run_again(self, call: DecodeCall, block: tuple) -> None:
        """Undo ``block`` (a row's nucleus was outside its candidates) and run its steps
        again with :func:`sample_tokens`; the keys and values the undone steps wrote are
        rewritten at the same columns."""
        rows, key_length, steps, saved = block
        self.state.restore(saved, self.cache)
        self.rerun_steps += steps
        self._candidates = 2 * self._candidates if 2 * self._candidates <= MAX_CANDIDATES else 0
        self._run_block(call, rows, key_length, steps, exact=True)

    def _step(self, call: DecodeCall, rows: int, key_length: int, exact: bool) -> None:
        """One decode step of the first ``rows`` slots over ``key_length`` columns."""
        if not self.cuda_graphs:
            self._step_body(call, rows, key_length, exact)
        else:
            key = (rows, key_length, call, exact, self._candidates)
            graph = self._graphs.get(key)
            if graph is None:
                graph = self._capture(call, rows, key_length, exact)
                if graph is None:  # turned off (warned): this step and the later ones run eagerly
                    self._step_body(call, rows, key_length, exact)
                    self.state.advance_cpu(rows)
                    return
                self._graphs[key] = graph
                self.graph_captures += 1
            graph.replay()
        self.state.advance_cpu(rows)

    def _capture(self, call: DecodeCall, rows: int, key_length: int, exact: bool) -> torch.cuda.CUDAGraph | None:
        """Warm up and capture :meth:`_step_body`; the state it changes is restored
        (keys and values written at the write columns are rewritten by the real step).
        A capture that fails turns CUDA graphs off (one warning; the decoder runs
        eagerly from then on) and returns None."""
        saved = self.state.snapshot(self.cache)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # kernels pick their algorithms and allocate outside the capture
                self._step_body(call, rows, key_length, exact)
                self.state.restore(saved, self.cache)
        torch.cuda.current_stream().wait_stream(stream)
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: the one-step-async rollouts capture on their own thread while the
            # training thread allocates and synchronizes (global mode would fail those calls)
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._step_body(call, rows, key_length, exact)
        except Exception as err:  # noqa: BLE001 - a failed capture turns the graphs off, it never ends a call
            warnings.warn(f"CUDA graphs turned off: the capture of a decode step failed ({first_line(err)}); "
                          "steps and prefills run eagerly", RuntimeWarning, stacklevel=2)
            self.cuda_graphs = self.prefill_graphs = False
            self._graphs.clear()
            self._prefill_graphs.clear()
            self._abandon_pool()
            graph = None
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

    def _step_body(self, call: DecodeCall, rows: int, key_length: int, exact: bool) -> None:
        """Forward the first ``rows`` slots' last tokens, sample, record, advance; device
        tensors only (no host sync), so it can be captured."""
        with attention_implementation(self.model, SLOT_ATTENTION), fused_decode.fused() if self.fused_kernels else contextlib.nullcontext():
            self._step_ops(call, rows, key_length, exact)

    def _step_ops(self, call: DecodeCall, rows: int, key_length: int, exact: bool) -> None:
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
        columns.add_(1).clamp_(max=cache.length)  # the spare column: a live row's next column is at most key_length
        state.positions[:rows].add_(1)
        counts.add_((~done).long())
        done |= (chosen == self._eos_tensor(call)[None, :]).any(-1) | (counts >= call.max_new_tokens)
