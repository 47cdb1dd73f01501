"""The slot decoder's device state: the per-slot KV cache (:class:`SlotCache`, widened
as rows get longer), the caches a prefill hands the model (:class:`PrefillWriter`,
:class:`ChunkWriter`) and each slot's sampling state with its host mirrors
(:class:`SlotState`), reused by every call and every captured CUDA graph until the cache
grows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlperf_grpo.inference.sampling import draw_uniforms, row_streams


class SlotCache:
    """A KV cache of ``slots`` rows and ``length`` columns per layer, written at one
    column per row (the rows' own write columns), read as the first ``rows`` rows
    (attention reads the columns its mask covers: :func:`~mlperf_grpo.inference.decode.slot_attention`).
    Handed to the model as its cache: attention layers call :meth:`update`. :meth:`grow`
    widens it (fewer rows: the live ones) as the rows get longer.

    Memory: ``2 x layers x (slots + spare) x kv_heads x (length + 1) x head_dim`` elements
    of the model's dtype (:func:`cache_bytes`): one column more than any key length (the
    column the steps after a row ended at its limit write to) and, with ``spare``, one
    spare row (row ``slots``, :attr:`spare_row`: a bucketed prefill's padding rows write
    there; no other prefill writes it).
    """

    def __init__(self, shapes: list[tuple[int, int]], slots: int, length: int, dtype: torch.dtype,
                 device: torch.device, spare: bool = False) -> None:
        """``shapes``: per layer ``(kv_heads, head_dim)``."""
        rows = slots + spare
        self.keys = [torch.zeros(rows, h, length + 1, d, dtype=dtype, device=device) for h, d in shapes]
        self.values = [torch.zeros(rows, h, length + 1, d, dtype=dtype, device=device) for h, d in shapes]
        self.slots, self.length, self.spare = slots, length, spare
        self.spare_row = slots
        self.write_columns = torch.zeros(slots + 1, dtype=torch.long, device=device)  # [slots + 1]

    def fits(self, shapes: list[tuple[int, int]], slots: int, length: int, dtype: torch.dtype) -> bool:
        """Whether this cache can serve a call of ``slots`` rows and ``length`` columns."""
        have = [(k.shape[1], k.shape[3]) for k in self.keys]
        return have == shapes and self.slots >= slots and self.length >= length and self.keys[0].dtype == dtype

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write ``[b, kv_heads, 1, head_dim]`` keys and values of the first ``b`` rows at
        their write columns; return the rows' ``[b, kv_heads, length + 1, head_dim]``
        keys and values (views)."""
        b = key_states.shape[0]
        keys, values = self.keys[layer_idx][:b], self.values[layer_idx][:b]
        index = self.write_columns[:b].view(b, 1, 1, 1).expand(b, keys.shape[1], 1, keys.shape[3])
        keys.scatter_(2, index, key_states)
        values.scatter_(2, index, value_states)
        return keys, values

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def grow(self, rows: int, length: int, staged: bool = False) -> int:
        """Keep the first ``rows`` rows (their columns and write columns) in ``length``
        >= :attr:`length` columns, one tensor at a time: each old one is freed once
        copied, so at most the new tensors and the old ones not yet copied are allocated
        together (the most: all new and one old, or all old and one new); ``staged``:
        the kept rows copied to host memory first and every old tensor freed, so at most
        the larger of the old and the new. Returns that peak's bytes. The new columns are
        zeros (attention gives masked columns weight 0, which times a stale NaN would
        still be NaN)."""
        peak = self.nbytes
        kept = [t[:rows].to("cpu", copy=True) for t in (*self.keys, *self.values)] if staged else None
        if staged:  # every old tensor freed (an empty one keeps its heads and head_dim)
            for tensors in (self.keys, self.values):
                tensors[:] = [t.new_empty(0, t.shape[1], 0, t.shape[3]) for t in tensors]
        for tensors in (self.keys, self.values):
            for i in range(len(tensors)):
                old = tensors[i]
                new = old.new_zeros(rows + self.spare, old.shape[1], length + 1, old.shape[3])
                source = kept.pop(0) if staged else old[:rows]
                new[:rows, :, : source.shape[2]] = source.to(new.device)
                tensors[i] = new
                peak = max(peak, self.nbytes + old.numel() * old.element_size())
                del old, new, source
        columns = self.write_columns.new_zeros(rows + 1)
        columns[:rows] = self.write_columns[:rows]
        self.write_columns, self.slots, self.spare_row, self.length = columns, rows, rows, length
        return peak

    def permute_rows(self, order: torch.Tensor) -> None:
        """Reorder the first ``len(order)`` rows of every layer: row ``i`` takes row
        ``order[i]`` (one tensor at a time: a copy of its first rows beside the cache)."""
        n = order.shape[0]
        for tensor in (*self.keys, *self.values, self.write_columns):
            tensor[:n] = tensor[:n].index_select(0, order)


class ChunkWriter:
    """The cache a resumed row's prefill hands the model, one chunk of its columns at a
    time: each attention layer's ``[1, kv_heads, C, head_dim]`` keys and values are
    written to cache row ``row``, columns ``[start, start + C)``, and attention reads the
    row's columns ``[0, start + C)`` (a view). Eager only."""

    def __init__(self, cache: SlotCache, row: int, start: int) -> None:
        self.cache, self.row, self.start = cache, row, start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write the chunk's keys and values; return the row's ``[1, kv_heads, start + C,
        head_dim]`` keys and values so far."""
        end = self.start + key_states.shape[2]
        out = []
        for tensors, states in ((self.cache.keys, key_states), (self.cache.values, value_states)):
            row = tensors[layer_idx][self.row : self.row + 1]
            row[:, :, self.start : end] = states
            out.append(row[:, :, :end])
        return out[0], out[1]


def cache_bytes(shapes: list[tuple[int, int]], slots: int, length: int, dtype: torch.dtype,
                spare: bool = False) -> int:
    """Bytes of a :class:`SlotCache` of ``slots`` rows (and a spare one) and ``length``
    columns; ``shapes``: per layer ``(kv_heads, head_dim)``."""
    return (slots + spare) * (length + 1) * row_column_bytes(shapes, dtype)


def row_column_bytes(shapes: list[tuple[int, int]], dtype: torch.dtype) -> int:
    """Bytes of one row's column of a :class:`SlotCache`: keys and values of every layer."""
    return 2 * torch.empty(0, dtype=dtype).element_size() * sum(h * d for h, d in shapes)


class PrefillWriter:
    """The cache a prefill hands the model: each attention layer's ``[R, kv_heads, W,
    head_dim]`` keys and values of the prompts admitted together are written to the
    cache rows ``rows`` (``[R]`` int64 on the cache's device; repeats of
    :attr:`SlotCache.spare_row` for padding rows), columns ``[0, W)``, and attention reads
    them as given (a prompt attends to itself only). Device ops only: a prefill through
    it can be captured as a CUDA graph."""

    def __init__(self, cache: SlotCache, rows: torch.Tensor) -> None:
        self.cache, self.rows = cache, rows

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write ``[R, kv_heads, W, head_dim]`` keys and values to the rows' columns
        ``[0, W)`` of layer ``layer_idx``; return them as given (what attention reads)."""
        width = key_states.shape[2]
        self.cache.keys[layer_idx][self.rows, :, :width] = key_states
        self.cache.values[layer_idx][self.rows, :, :width] = value_states
        return key_states, value_states


class SlotState:
    """Per-slot device tensors (``[slots + 1]`` or ``[slots + 1, max_new_tokens]``: row
    ``slots`` is the spare row of :class:`SlotCache`) and their host mirrors for
    bookkeeping; ``inexact`` (``[1]`` bool) is set by a decode step in
    which some row's top-p nucleus was not among its sampling candidates
    (:func:`~mlperf_grpo.inference.sampling.sample_tokens_from_candidates`)."""

    def __init__(self, slots: int, max_new_tokens: int, length: int, device: torch.device) -> None:
        self.slots, self.max_new_tokens, self.length = slots, max_new_tokens, length
        self.device = device
        rows = slots + 1  # the spare row too
        self.arange = torch.arange(length + 1, device=device)  # [length + 1], as the cache's columns
        self.starts = torch.zeros(rows, dtype=torch.long, device=device)  # first visible column
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)  # position id of the next input
        self.last = torch.zeros(rows, dtype=torch.long, device=device)  # the last sampled token
        self.counts = torch.zeros(rows, dtype=torch.long, device=device)  # tokens sampled so far
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.inexact = torch.zeros(1, dtype=torch.bool, device=device)
        self.uniforms = torch.zeros(rows, max_new_tokens, dtype=torch.float32, device=device)
        # one spare column: the steps after a row ended at its limit write there
        self.tokens = torch.zeros(rows, max_new_tokens + 1, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(rows, max_new_tokens + 1, dtype=torch.float32, device=device)
        self.count_cpu = [0] * rows
        self.column_cpu = [0] * rows

    def fits(self, slots: int, max_new_tokens: int, length: int) -> bool:
        """Whether this state can serve a call of this many slots, tokens and columns."""
        return self.slots >= slots and self.max_new_tokens >= max_new_tokens and self.length >= length

    def start(self, slots: list[int], seeds: list[int], pads: list[int], lengths: list[int], width: int,
              cache: SlotCache, max_new_tokens: int) -> None:
        """Slots ``slots`` begin rows whose prompts fill columns ``[pad, width)``; each
        row's ``max_new_tokens`` uniforms are drawn now (the first ones of its stream);
        the host mirrors count the prefill's token (:meth:`record_first` records it)."""
        index = torch.tensor(slots, device=self.device)
        uniforms = draw_uniforms(row_streams(seeds, max_new_tokens), max_new_tokens)  # [rows, max_new_tokens]
        self.uniforms[index, :max_new_tokens] = uniforms.to(self.device)
        self.starts[index] = torch.tensor(pads, device=self.device)
        self.positions[index] = torch.tensor(lengths, device=self.device)
        cache.write_columns[index] = width
        for slot in slots:
            self.column_cpu[slot] = width
            self.count_cpu[slot] = 1

    def record_first(self, index: torch.Tensor, chosen: torch.Tensor, logprob: torch.Tensor, eos: torch.Tensor,
                     max_new_tokens: int) -> None:
        """The prefill's sampled token (``[n]``) is each new row's token 0 (device ops
        only: ``index`` may repeat the spare row)."""
        self.tokens[index, 0] = chosen
        self.logprobs[index, 0] = logprob
        self.last[index] = chosen
        # not ``counts[index] = 1``: a Python scalar assigned through a tensor index is a
        # CPU tensor copied to the device (pageable memory, which a CUDA graph capture refuses)
        self.counts.index_fill_(0, index, 1)
        self.done[index] = (chosen[:, None] == eos[None, :]).any(-1) | (max_new_tokens <= 1)

    def resume(self, slot: int, tokens: list[int], logprobs: list[float], chosen: torch.Tensor,
               logprob: torch.Tensor, eos: torch.Tensor, max_new_tokens: int) -> None:
        """Slot ``slot`` holds a preempted row again (:meth:`start` done, its prompt and
        ``tokens`` prefilled): its ``c`` tokens and log-probabilities put back, and its
        prefill's token (``[1, 1]``, sampled at its ``c``-th uniform) recorded as token ``c``."""
        c = len(tokens)
        if c:
            self.tokens[slot, :c] = torch.tensor(tokens, device=self.device)
            self.logprobs[slot, :c] = torch.tensor(logprobs, dtype=torch.float32, device=self.device)
        self.tokens[slot, c] = chosen[0, 0]
        self.logprobs[slot, c] = logprob[0, 0]
        self.last[slot] = chosen[0, 0]
        self.counts[slot] = c + 1
        self.done[slot : slot + 1] = (chosen[0, 0] == eos).any().view(1) | (c + 1 >= max_new_tokens)
        self.count_cpu[slot] = c + 1

    def advance_cpu(self, rows: int) -> None:
        """Host mirrors after a decode step of the first ``rows`` slots (a row that has
        not ended: its count and write column; an ended row's are upper bounds)."""
        for s in range(rows):
            self.count_cpu[s] += 1
            self.column_cpu[s] += 1

    def take(self, slots: list[int], counts: list[int]) -> list[tuple[list[int], list[float]]]:
        """The ended rows of ``slots``, ``counts`` tokens each (their device counts): the
        tokens through the first EOS or the limit, and their log-probabilities."""
        if not slots:
            return []
        index = torch.tensor(slots, device=self.device)
        tokens, logprobs = self.tokens[index].tolist(), self.logprobs[index].tolist()
        return [(t[:n], lp[:n]) for t, lp, n in zip(tokens, logprobs, counts)]

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

    def snapshot(self, cache: SlotCache) -> tuple[list[torch.Tensor], list[list[int]]]:
        """Copies of what decode steps change besides the cache columns they write (device
        tensors and host mirrors)."""
        return [t.clone() for t in self._mutable(cache)], [list(self.count_cpu), list(self.column_cpu)]

    def restore(self, saved: tuple[list[torch.Tensor], list[list[int]]], cache: SlotCache) -> None:
        """Undo decode steps: put back :meth:`snapshot`'s copies (the keys and values they
        wrote are rewritten by the steps run again)."""
        for tensor, copy in zip(self._mutable(cache), saved[0]):
            tensor.copy_(copy)
        self.count_cpu[:], self.column_cpu[:] = (list(m) for m in saved[1])

    def _mutable(self, cache: SlotCache) -> list[torch.Tensor]:
        return [self.positions, self.last, self.counts, self.done, self.inexact, self.tokens, self.logprobs,
                cache.write_columns]


@dataclass(frozen=True)
class DecodeCall:
    """One :meth:`~mlperf_grpo.inference.decode.SlotDecoder.generate` call's sampling constants (a captured graph bakes them in)."""

    temperature: float
    top_p: float
    max_new_tokens: int
    eos: tuple[int, ...]  # sorted; (-1,) when there is no EOS


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (at most 200 characters), or its type's name
    (the one-line warnings of a capture that failed)."""
    return (str(error).splitlines() or [type(error).__name__])[0][:200]
