"""One :meth:`~mlperf_grpo.inference.decode.SlotDecoder.generate` call's bookkeeping
(:class:`Schedule`): which prompt each slot holds, the prompts waiting (fresh ones, and
rows preempted when the KV cache's budget did not hold them: :class:`Resumed`), the
completions so far; and the budget's arithmetic (:func:`rows_fitting`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from mlperf_grpo.inference.slot_state import SlotCache, SlotState


class KVCacheBudgetError(RuntimeError):
    """The KV cache's budget (``kv_cache_bytes``) does not hold one row at the columns
    it needs."""


@dataclass(frozen=True)
class Resumed:
    """A row prefilled alone, in chunks: one preempted to make room, prompt ``index`` and
    the tokens and log-probabilities it had sampled (its prefill recomputes their keys and
    values; sampling goes on at its uniform number ``len(tokens)``, so its tokens are those
    it would have sampled), or a fresh prompt too long to prefill with others (none yet)."""

    index: int
    tokens: list[int]
    logprobs: list[float]


class Schedule:
    """The slots of one call: ``owner[s]`` the prompt slot ``s`` holds (-1: empty),
    ``waiting`` the prompts not started (indices) or preempted (:class:`Resumed`, run
    first), ``rows`` the slots a step runs (the live ones among them), ``results`` the
    completions by prompt."""

    def __init__(self, prompts: int, slots: int) -> None:
        self.owner = [-1] * slots
        self.waiting: deque[int | Resumed] = deque(range(prompts))
        self.results: list[tuple[list[int], list[float]] | None] = [None] * prompts
        self.rows = slots

    def live(self) -> list[int]:
        """The slots of the first ``rows`` that hold a row."""
        return [s for s in range(self.rows) if self.owner[s] >= 0]

    def take(self) -> list[tuple[int, int | Resumed]]:
        """Waiting prompts for the empty slots of the first ``rows``, in order:
        ``(slot, prompt index or Resumed)``; their slots are taken."""
        free = [s for s in range(self.rows) if self.owner[s] < 0]
        taken = [(s, self.waiting.popleft()) for s in free[: len(self.waiting)]]
        for slot, item in taken:
            self.owner[slot] = item if isinstance(item, int) else item.index
        return taken

    def finish(self, slots: list[int], rows: list[tuple[list[int], list[float]]]) -> None:
        """Slots ``slots`` ended with completions ``rows``; they are empty again."""
        for slot, row in zip(slots, rows):
            self.results[self.owner[slot]] = row
            self.owner[slot] = -1

    def preempt(self, slots: list[int], rows: list[tuple[list[int], list[float]]]) -> None:
        """Slots ``slots`` give up their rows (``rows``: their tokens and log-probabilities
        so far), which wait first, in this order, to be resumed."""
        for slot, (tokens, logprobs) in reversed(list(zip(slots, rows))):
            self.waiting.appendleft(Resumed(self.owner[slot], tokens, logprobs))
            self.owner[slot] = -1

    def compact(self, state: SlotState, cache: SlotCache, rows: int) -> None:
        """Move the live slots to the front (state and cache rows) and run ``rows`` (>=
        the live ones) from now on."""
        live = self.live()
        order = live + [s for s in range(self.rows) if self.owner[s] < 0]
        state.permute(order, cache)
        self.owner[: self.rows] = [self.owner[s] for s in order]
        self.rows = rows


def rows_fitting(budget: int, row_column_bytes: int, columns: int, transient: int = 0, spare: bool = False) -> int:
    """The most rows a cache of ``columns`` columns may have within ``budget`` bytes, with
    ``transient`` bytes allocated beside it (what a growth holds at once): ``(rows +
    spare) (columns + 1) row_column_bytes + transient <= budget`` (the spare row and
    column, :class:`~mlperf_grpo.inference.slot_state.SlotCache`). Below 1: not even one row."""
    return (budget - transient) // (row_column_bytes * (columns + 1)) - spare
