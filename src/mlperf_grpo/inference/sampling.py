"""Per-row seeded sampling: one token per row by the inverse CDF of its truncated
distribution at the row's own uniform, with the token's log-probability.

:func:`sample_tokens` is the definition (the CPU calibration's arithmetic, and
``generate``'s through :class:`RowSeededSampler`). :func:`sample_tokens_from_candidates`
gives the same token without sorting the vocabulary when top-p < 1: the nucleus is
read from the ``k`` largest logits when they provably contain it, and the row is
flagged otherwise (the caller then samples it with :func:`sample_tokens`).
:func:`sample_tokens_by_blocks` gives the same token at top-p 1 (training rollouts)
without a vocabulary-wide cumulative sum or ``log_softmax``.
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LogitsProcessor
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper


def sample_tokens(
    scores: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sampling of one token per row, with its log-probability.

    Args:
        scores: ``[B, V]`` logits of the next token (any float dtype; computed in float32).
        uniforms: ``[B, 1]`` float32 in [0, 1], one per row (Python's ``random()`` in
            float32 can round to 1.0: the last id of positive probability).
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


SAMPLER_BLOCK = 128
"""Vocabulary ids per block of :func:`sample_tokens_by_blocks` (151,936 = 1,187 x 128)."""


def block_masses(scores: torch.Tensor, temperature: float, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's largest tempered logit and the unnormalised probability mass of each
    block of ``block`` consecutive ids.

    Args:
        scores: ``[B, V]`` logits (any float dtype; computed in float32).
        temperature: > 0, applied as ``TemperatureLogitsWarper`` does (``scores / temperature``).
        block: ids per block (the last block is padded with zero mass).
    Returns:
        ``(top, masses)``: ``[B, 1]`` float32 ``max(scores / temperature)`` and
        ``[B, ceil(V / block)]`` float32 sums of ``exp(scores / temperature - top)``.
    """
    tempered = scores.float() / temperature  # [B, V]
    top = tempered.amax(dim=-1, keepdim=True)  # [B, 1]
    p = torch.exp(tempered - top)  # [B, V], in (0, 1]
    pad = -p.shape[-1] % block
    if pad:
        p = F.pad(p, (0, pad))
    return top, p.view(p.shape[0], -1, block).sum(dim=-1)


def sample_tokens_from_candidates(
    scores: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_p: float, candidates: int,
    masses=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sample_tokens` at ``top_p < 1`` over the ``candidates`` largest logits of
    each row: no full-vocabulary sort (``torch.topk`` and sorts of ``[B, k]`` instead).

    The definition (``TopPLogitsWarper``, then the inverse CDF in vocabulary order): with
    ``p = softmax(scores / temperature)``, the warper sorts ascending (stably: among equal
    logits the lower id first) and removes each token whose ascending cumulative sum is
    ``<= 1 - top_p``. That sum is ``1 - above``, ``above`` being the mass of the tokens
    after it in that order, so in the descending order (equal logits: the higher id
    first) a token is kept iff ``above < top_p``: a prefix. The ``k`` largest logits
    hold every token of a value above the ``k``-th largest, so their descending order is
    a prefix of the vocabulary's up to the ties at that ``k``-th value; when the first
    removed candidate's value is above it, the kept prefix is the vocabulary's nucleus
    and the row is ``exact`` (every row is when ``k >= V``). The kept tokens' ``p`` (unnormalised: the CDF is scaled,
    as the definition's ``u x cdf[-1]`` is) cumulated in id order give the same inverse
    CDF as the vocabulary's, whose removed tokens add exact zeros. The same arithmetic in
    exact numbers; in float32 the mass before the nucleus boundary is summed over ``k``
    terms instead of the vocabulary's ascending scan, so a row whose boundary mass lies
    within float rounding (about 1e-6) of ``top_p`` may keep one token more or less, as
    batched kernels' rounding may change any sampled token. The tie order is that of a
    stable sort, which ``torch.sort`` on CUDA gives at vocabulary widths (a radix sort;
    on one H200 all 256 bfloat16 rows of ``benchmarks/sampler.py`` agreed); the CPU's
    sort promises no order among equals, so the CPU keeps :func:`sample_tokens`.

    The candidates are the ``k`` largest logits as given (``torch.topk`` of ``scores``,
    not of a float32 copy divided by the temperature: dividing by ``temperature > 0``
    keeps their order, so every token of a tempered value above the ``k``-th's is among
    them), and the log-normaliser is ``top + log(sum(block masses))``
    (:func:`block_masses`), so the only vocabulary-wide passes are the top-k and one
    reduction.

    Args:
        scores: ``[B, V]`` logits (any float dtype; computed in float32).
        uniforms: ``[B, 1]`` float32 in [0, 1] (1.0: the last id of positive probability).
        temperature: > 0; top_p: in (0, 1).
        candidates: k, the logits per row considered (clamped to V).
        masses: :func:`block_masses` (the default) or a function of the same arithmetic.
    Returns:
        ``(chosen, logprob, exact)``: ``[B, 1]`` int64 ids, ``[B, 1]`` float32
        ``log_softmax(scores / temperature)`` at them, ``[B]`` bool: the row's nucleus
        lies within its candidates (where False, ``chosen`` is meaningless: sample that
        row with :func:`sample_tokens`).
    """
    top, sums = (block_masses if masses is None else masses)(scores, temperature, SAMPLER_BLOCK)
    # logsumexp(scores / temperature) = top + log_total, kept apart: at a small temperature
    # top is large and one sum would round the normaliser at its size
    log_total = torch.log(sums.sum(dim=-1, keepdim=True))  # [B, 1]
    _, ids = scores.topk(min(candidates, scores.shape[-1]), dim=-1)  # [B, k], descending
    values = scores.gather(1, ids).float() / temperature  # [B, k], as TemperatureLogitsWarper
    by_id = ids.argsort(dim=-1, descending=True)  # equal logits: the higher id first, as the warper's stable sort
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    order = values.argsort(dim=-1, descending=True, stable=True)
    values, ids = values.gather(1, order), ids.gather(1, order)
    p = torch.exp(values - top - log_total)  # [B, k]
    above = torch.cat([torch.zeros_like(p[:, :1]), p[:, :-1].cumsum(dim=-1)], dim=-1)  # mass before each
    keep = above < top_p  # [B, k], a prefix (the first is always kept)
    # k = V: the candidates are the vocabulary, whatever the nucleus
    exact = (~keep & (values > values[:, -1:])).any(dim=-1) | (ids.shape[-1] == scores.shape[-1])  # [B]
    ids, in_id_order = ids.sort(dim=-1)
    cdf = torch.where(keep, p, 0.0).gather(1, in_id_order).cumsum_(dim=-1)  # [B, k], in id order
    u = uniforms.to(cdf.dtype) * cdf[:, -1:]  # [B, 1]
    chosen = ids.gather(1, torch.searchsorted(cdf, u).clamp_(max=cdf.shape[-1] - 1))  # [B, 1]
    chosen = torch.where(u > 0, chosen, 0)  # u = 0: the definition's first id, 0
    return chosen, scores.gather(1, chosen).float() / temperature - top - log_total, exact


def sample_tokens_by_blocks(scores: torch.Tensor, uniforms: torch.Tensor, temperature: float,
                            masses=block_masses, block: int = SAMPLER_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_tokens` at top-p 1 in two levels: the inverse CDF first over the
    cumulative masses of blocks of ``block`` ids, then inside the block it falls in.

    The definition takes the first id whose cumulative probability (in id order)
    reaches ``u x cdf[-1]``. With ``p = exp(scores / temperature - top)`` (the
    probabilities times ``sum(p)``, so the same inverse CDF), the block that holds that
    id is the first whose cumulative block mass reaches ``u x sum(p)``, and the id is the
    first in it whose mass before the block plus the cumulative mass inside reaches the
    same value. The same arithmetic in exact numbers; in float32 the sums run in another
    order, so a uniform within rounding (about 1e-6 relative) of a token's CDF boundary
    may take its neighbour, as batched kernels' rounding may change any sampled token.
    Where rounding leaves the block's own cumulative mass below the target, the block's
    last id of positive mass is taken (never one of zero probability). The
    log-probability is ``scores / temperature - top - log(sum(p))`` at the token, which
    is ``log_softmax(scores / temperature)`` there. Reads the ``[B, V]`` logits about
    four times (``masses``), where :func:`sample_tokens` makes about a dozen passes.

    Args:
        scores: ``[B, V]`` logits (any float dtype; computed in float32).
        uniforms: ``[B, 1]`` float32 in [0, 1] (1.0: the last id of positive probability).
        temperature: > 0.
        masses: :func:`block_masses` or a function of the same arithmetic (a fused twin).
        block: ids per block.
    Returns:
        ``(chosen, logprob)``: ``[B, 1]`` int64 ids and ``[B, 1]`` float32
        ``log_softmax(scores / temperature)`` at them.
    """
    vocab = scores.shape[-1]
    top, sums = masses(scores, temperature, block)  # [B, 1], [B, N]
    cumulative = sums.cumsum(dim=-1)  # [B, N]
    total = cumulative[:, -1:]  # [B, 1]
    target = uniforms.to(total.dtype) * total  # [B, 1]
    at = torch.searchsorted(cumulative, target).clamp_(max=cumulative.shape[-1] - 1)  # [B, 1]: the block
    before = torch.where(at > 0, cumulative.gather(1, (at - 1).clamp(min=0)), 0.0)  # [B, 1]
    ids = at * block + torch.arange(block, device=scores.device)  # [B, block]
    in_vocab = ids.clamp(max=vocab - 1)  # the last block's padding (zero mass: never taken from finite logits)
    tempered = scores.gather(1, in_vocab).float() / temperature  # [B, block]
    inside = torch.where(ids < vocab, torch.exp(tempered - top), 0.0).cumsum_(dim=-1) + before  # [B, block]
    # < block for finite logits; clamped for a row of NaN or infinite ones (some id, a NaN
    # log-probability, as sample_tokens gives), so one bad row cannot index out of range
    offset = torch.searchsorted(inside, torch.minimum(target, inside[:, -1:])).clamp_(max=block - 1)  # [B, 1]
    return in_vocab.gather(1, offset), tempered.gather(1, offset) - top - torch.log(total)


PYTHON_DRAWS_MAX = 1024
"""Rows that draw at most this many uniforms draw them from ``random.Random`` itself:
setting up a NumPy MT19937 costs about 0.1 ms a row, what about 1,000 Python draws cost
(256 rows, 2-core CPU: 64 draws 2.5 ms vs 29 ms; 4,096 draws 101 ms vs 46 ms)."""


def row_streams(seeds: list[int], draws: int) -> list[random.Random] | list[np.random.RandomState]:
    """One stream per seed of ``random.Random(seed)``'s ``random()`` draws, for rows that
    draw at most ``draws`` each: that generator itself up to :data:`PYTHON_DRAWS_MAX`,
    else a NumPy MT19937 set to its state, whose ``random_sample`` draws are the same
    bit for bit (both are ``(a * 2**26 + b) / 2**53`` of two 32-bit outputs), drawn in C."""
    if draws <= PYTHON_DRAWS_MAX:
        return [random.Random(seed) for seed in seeds]
    streams = []
    for seed in seeds:
        _, state, _ = random.Random(seed).getstate()  # 624 words and the position
        stream = np.random.RandomState()
        stream.set_state(("MT19937", np.array(state[:624], dtype=np.uint32), state[624]))
        streams.append(stream)
    return streams


def draw_uniforms(streams: list[random.Random] | list[np.random.RandomState], count: int) -> torch.Tensor:
    """``[len(streams), count]`` float32 on the host: each stream's next ``count`` draws."""
    if not streams:
        return torch.empty(0, count, dtype=torch.float32)
    if isinstance(streams[0], random.Random):
        draws = [[stream.random() for _ in range(count)] for stream in streams]
        return torch.tensor(draws, dtype=torch.float64).to(torch.float32)
    return torch.from_numpy(np.stack([stream.random_sample(count) for stream in streams])).to(torch.float32)


class RowSeededSampler(LogitsProcessor):
    """Samples each row from ``softmax(logits / temperature)`` truncated to ``top_p``
    with that row's own RNG, records the sampled token's log-probability, and returns
    logits that keep only the sampled token (so greedy ``generate`` picks it).

    Row ``i``'s ``t``-th token is the inverse CDF of its truncated distribution at the
    ``t``-th ``random()`` of ``random.Random(seeds[i])``. Uniforms are drawn
    ``draw_chunk`` steps at a time and moved to the device once per chunk; the stream,
    and so every completion, is the same as with one draw per step.

    Memory: ``[B, max_new_tokens]`` float32 for the log-probabilities (allocated once,
    written in place) and ``[B, draw_chunk]`` uniforms; full-vocabulary ``[B, V]``
    tensors live for one step only.

    Args:
        seeds: one integer seed per batch row.
        temperature, top_p: as in :class:`~mlperf_grpo.inference.base.SamplingParams`.
        max_new_tokens: the most steps ``generate`` will take.
        draw_chunk: uniforms drawn per row at a time (>= 1).
    """

    def __init__(
        self, seeds: list[int], temperature: float, top_p: float, max_new_tokens: int, draw_chunk: int = 64
    ) -> None:
        self._streams = row_streams(seeds, max_new_tokens + 1)
        self._temperature, self._top_p = temperature, top_p
        self._max_new_tokens = max_new_tokens
        self._draw_chunk = max(1, draw_chunk)
        self._uniforms: torch.Tensor | None = None  # [B, chunk], the current chunk of draws
        self._column = 0  # next unused column of _uniforms
        self._logprobs: torch.Tensor | None = None  # [B, max_new_tokens + 1]
        self.steps = 0

    def token_logprobs(self) -> torch.Tensor:
        """``[B, steps]`` float32 on the logits' device: ``log_softmax(logits / temperature)``
        at each sampled token, before top-p (the rollout policy's log-probability).

        Raises:
            RuntimeError: the sampler has not been called yet.
        """
        if self._logprobs is None:
            raise RuntimeError("the sampler has not been called")
        return self._logprobs[:, : self.steps]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        u = self._next_uniforms(torch.float32, scores.device)  # [B, 1]
        chosen, logprob = sample_tokens(scores, u, self._temperature, self._top_p)  # [B, 1] each
        if self._logprobs is None:
            # Written in place: per-step small tensors kept alive would fragment the CPU
            # heap between the [B, V] temporaries and grow RSS by about B x V per step.
            # One spare column: a generate that checks for the end one step late calls once more.
            self._logprobs = logprob.new_zeros((logprob.shape[0], self._max_new_tokens + 1))
        self._logprobs[:, self.steps : self.steps + 1] = logprob
        self.steps += 1
        return torch.full_like(scores, float("-inf"), dtype=torch.float32).scatter_(1, chosen, 0.0)

    def _next_uniforms(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``[B, 1]``: each row's next uniform in [0, 1)."""
        if self._uniforms is None or self._column == self._uniforms.shape[1]:
            chunk = max(1, min(self._draw_chunk, self._max_new_tokens - self.steps))  # no draws generation cannot use
            self._uniforms = draw_uniforms(self._streams, chunk).to(device, dtype, non_blocking=True)
            self._column = 0
        u = self._uniforms[:, self._column : self._column + 1]
        self._column += 1
        return u
