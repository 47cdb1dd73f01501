"""Token-budget micro-batches: which rows of a global batch go through one forward pass,
and the packed (padding-free) inputs of such a pass.

:func:`token_budget_micro_batches` takes the rows in order and starts a new micro-batch
when the next row would take it past ``grpo.micro_batch_tokens`` tokens (or past
``grpo.micro_batch_size`` rows, when set); a row longer than the budget is a micro-batch
of its own. Rows the loss leaves out (``sample_mask`` 0: the overlong filter) are not
run at all. Under torchrun every rank must run as many micro-batches as the others (each
pass all-gathers the FSDP2 shards): :func:`split_to_count` splits the largest ones
until a rank has the common count (never past the budget); a rank with no row left
runs an empty one (a row scored nowhere: its gradient is 0).

:func:`packed_inputs` lays a micro-batch's rows end to end in one sequence, with
``position_ids`` restarting at 0 for each row and no ``attention_mask``: Hugging Face
models then keep attention within each row (``transformers.masking_utils``:
``find_packed_sequence_indices`` gives SDPA/eager a block-diagonal causal mask,
flash-attention its varlen form), so the micro-batch costs its tokens, not rows x its
longest row. Only the positions the loss reads are scored (``logits_to_keep`` as a
tensor of positions): a completion mask may be any 0/1 pattern in a row (a multi-turn
trajectory's model turns), not only a suffix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MicroBatch:
    """Rows of the global batch run in one forward pass; ``empty``: a pass that scores
    nothing (a rank with fewer rows to train on than the common micro-batch count), run
    on ``rows`` = the batch's first row so that every rank makes the same collectives."""

    rows: tuple[int, ...]
    empty: bool = False


def token_budget_micro_batches(lengths: list[int], kept: list[bool], budget: int,
                               max_rows: int | None = None, padded: bool = False, multiple: int = 1) -> list[MicroBatch]:
    """The micro-batches of the kept rows, in row order, each at most ``budget`` tokens
    (sum of its rows' lengths rounded up to ``multiple``, what a packed pass computes;
    ``padded``: rows x its longest rounded up to ``multiple``, what a right-padded pass
    computes) and ``max_rows`` rows; a row longer than ``budget`` alone.

    Args:
        lengths: each row's tokens (prompt + completion, no padding).
        kept: whether the loss reads the row (``sample_mask > 0``).
        budget: ``grpo.micro_batch_tokens``.
        max_rows: ``grpo.micro_batch_size`` or None (no cap).
        padded: the passes are right-padded, never packed (a model packing does not
            suit: ``train/policy_probe.py``).
        multiple: a pass's width is a multiple of this (a compiled policy's 8).
    """
    out: list[list[int]] = []
    tokens = longest = 0
    for row, (length, keep) in enumerate(zip(lengths, kept)):
        if not keep:
            continue
        after = ((len(out[-1]) + 1) * padded_width(max(longest, length), multiple) if out and padded
                 else padded_width(tokens + length, multiple))
        full = out and (after > budget or (max_rows is not None and len(out[-1]) >= max_rows))
        if not out or full:
            out.append([])
            tokens = longest = 0
        out[-1].append(row)
        tokens += length
        longest = max(longest, length)
    return [MicroBatch(tuple(rows)) for rows in out]


def padded_width(longest: int, multiple: int) -> int:
    """The width of a right-padded pass whose longest row is ``longest`` tokens: rounded up
    to ``multiple`` (a compiled policy's widths, ``OptimizeSettings.width_multiple``)."""
    return -(-longest // multiple) * multiple


def split_padded(micro_batches: list[MicroBatch], lengths: list[int], budget: int, ratio: float,
                 multiple: int = 1) -> list[MicroBatch]:
    """The micro-batches that stay right-padded (``packing: auto``: padded, they take at
    most ``ratio`` x their tokens) and would pass ``budget`` tokens so, cut in row order
    into parts of at most ``budget`` tokens padding included, widths rounded up to ``multiple``
    (:func:`token_budget_micro_batches` ``padded``); the others as they are. A pass then
    holds at most the budget's tokens, packed or padded, as the planner counts."""
    out = []
    for m in micro_batches:
        rows = list(m.rows)
        padded = len(rows) * padded_width(max(lengths[r] for r in rows), multiple)
        if len(rows) > 1 and budget < padded <= ratio * sum(lengths[r] for r in rows):
            parts = token_budget_micro_batches([lengths[r] for r in rows], [True] * len(rows), budget, padded=True,
                                               multiple=multiple)
            out += [MicroBatch(tuple(rows[i] for i in part.rows)) for part in parts]
        else:
            out.append(m)
    return out


def split_to_count(micro_batches: list[MicroBatch], lengths: list[int], count: int) -> list[MicroBatch]:
    """``count`` micro-batches from ``micro_batches`` (at most ``count``): the one of most
    tokens among those of two rows or more is cut in two (its rows in order, the first
    part the shortest prefix holding half its tokens) until there are ``count``; when
    every one is a single row, empty ones (:class:`MicroBatch` ``empty``) make up the rest.
    """
    parts = [list(m.rows) for m in micro_batches]
    while len(parts) < count:
        splittable = [i for i, rows in enumerate(parts) if len(rows) > 1]
        if not splittable:
            return [MicroBatch(tuple(r)) for r in parts] + [MicroBatch((0,), empty=True)] * (count - len(parts))
        i = max(splittable, key=lambda j: sum(lengths[r] for r in parts[j]))
        rows = parts[i]
        total, running, cut = sum(lengths[r] for r in rows), 0, 1
        for cut in range(1, len(rows)):
            running += lengths[rows[cut - 1]]
            if 2 * running >= total:
                break
        parts[i:i + 1] = [rows[:cut], rows[cut:]]
    return [MicroBatch(tuple(r)) for r in parts]


@dataclass(frozen=True)
class PackedInputs:
    """One micro-batch's rows end to end (``S`` = their total tokens, rounded up).

    ``input_ids``/``position_ids``: ``[1, S]``; ``select``: ``[n]`` the indices of the
    packed positions whose next token the loss scores (a 1-D ``logits_to_keep``), in the
    order of ``padded_select``'s True entries (``[mb, W-1]``, the same positions in the
    right-padded rows); ``targets``: ``[1, n]`` the tokens they predict.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    select: torch.Tensor
    targets: torch.Tensor
    padded_select: torch.Tensor

    def to(self, device: torch.device) -> PackedInputs:
        """The same inputs on ``device``."""
        return PackedInputs(*(t.to(device) for t in (self.input_ids, self.position_ids, self.select, self.targets,
                                                      self.padded_select)))


def packed_inputs(input_ids: torch.Tensor, lengths: torch.Tensor, score: torch.Tensor,
                  width_multiple: int = 1) -> PackedInputs:
    """Pack right-padded rows into one sequence (see the module docstring).

    Args:
        input_ids: ``[mb, W]`` right-padded rows, ``W`` at least the longest.
        lengths: ``[mb]`` tokens of each row (``>= 1``).
        score: ``[mb, W-1]`` bool, the shifted positions the loss reads (position ``p``
            predicts token ``p + 1``); beyond a row's length, False.
        width_multiple: ``S`` is rounded up to a multiple of it with padding tokens that
            continue the last row's positions (nothing before them attends to them).
    Returns:
        A :class:`PackedInputs`.
    """
    mb, width = input_ids.shape
    device = input_ids.device
    columns = torch.arange(width, device=device)
    valid = columns.unsqueeze(0) < lengths.unsqueeze(1)  # [mb, W]
    total = int(lengths.sum())
    size = -(-total // width_multiple) * width_multiple
    ids = input_ids[valid]  # [total], row after row
    positions = columns.expand(mb, width)[valid]  # [total], restarting at 0 each row
    # each row's last position predicts nothing (the next row's first token is not its continuation)
    scored = torch.nn.functional.pad(score, (0, 1))[valid]  # [total]
    padded_select = score
    targets = input_ids[:, 1:][score]  # [n]
    extra = size - total
    if extra:
        last = positions[-1] + 1
        ids = torch.cat([ids, ids.new_zeros(extra)])
        positions = torch.cat([positions, last + torch.arange(extra, device=device)])
        scored = torch.cat([scored, scored.new_zeros(extra)])
    select = scored.nonzero().squeeze(1)  # [n]
    return PackedInputs(ids.unsqueeze(0), positions.unsqueeze(0), select, targets.unsqueeze(0), padded_select)
