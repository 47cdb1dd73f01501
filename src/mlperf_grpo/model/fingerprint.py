"""Proof that an engine holds the weights it claims: a tensor fingerprint and a canary.

After every refit the evaluator compares (1) the fingerprint of the engine's
tensors (:func:`weights_fingerprint`, computed on the engine's device) with the one the
trainer recorded for the checkpoint and (2) the engine's logits on a fixed
canary input with the logits the trainer recorded for that checkpoint when it wrote it.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
import xxhash

CANARY_LENGTH = 16
CANARY_LOGITS = 32
"""How many last-position logits are recorded (the first ``CANARY_LOGITS`` of the vocab)."""

CANARY_TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}
"""Max absolute difference allowed per canary logit, relative to ``max(1, |logit|)``."""


FINGERPRINT_V1 = "int64-word-sum-adjacent-product-v1"
"""The first algorithm (:func:`tensor_checksums_v1`): per-tensor values that need the
whole tensor (adjacent words), so they cannot be combined from slices. Checkpoints
written before v2 record it; the evaluator still verifies them at tensor-parallel size 1."""

FINGERPRINT_V2 = "uint-element-sum-global-index-weighted-sum-v2"
"""The current algorithm (:func:`tensor_checksums`): per-tensor values that are sums over
elements, so the partial sums of a tensor's slices add up to the whole tensor's."""

DEVICE_FINGERPRINT_ALGORITHM = FINGERPRINT_V2
"""Name of :func:`weights_fingerprint`'s algorithm, recorded in ``training_info.json``."""

FINGERPRINT_ALGORITHMS = (FINGERPRINT_V1, FINGERPRINT_V2)
"""Every algorithm the evaluator can verify."""

_CHUNK_WORDS = 1 << 22
"""64-bit words per step of :func:`tensor_checksums_v1` (bounds its temporary to 32 MiB)."""

_CHUNK_ELEMENTS = {"cpu": 1 << 18, "device": 1 << 24}
"""Elements per block of :func:`tensor_checksums`: on the CPU a 2 MiB int64 temporary
(cache-resident: 2x faster than 32 MiB on one core, measured on a 128 MiB bfloat16
tensor); on a GPU 128 MiB, so a model of billions of elements takes hundreds of kernel
launches, not tens of thousands."""

_BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_UNSIGNED_BITS_DTYPES = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.int64}
_UNSIGNED_MASKS = {2: 0xFFFF, 4: 0xFFFFFFFF}

Index = tuple[slice, ...]
"""An index into a full tensor: one ``slice`` per leading dimension (missing ones whole)."""


def tensor_checksums_v1(tensor: torch.Tensor) -> torch.Tensor:
    """Algorithm :data:`FINGERPRINT_V1`: two checksums of a tensor's bit pattern, computed
    on the tensor's own device.

    The tensor's bytes (C order, little-endian as stored in memory and in safetensors
    files) are read as 64-bit words ``w_0 .. w_{n-1}`` (a last partial word zero-padded);
    returns ``[sum_i w_i, sum_i w_i * w_{i+1}]`` as an int64 tensor of shape ``[2]`` on
    the tensor's device, all arithmetic modulo 2**64 (two's-complement wrap-around). Sums
    modulo 2**64 do not depend on the order of additions, so CPU and CUDA give the same
    values. The first catches any change of a single word, the second swapped or
    transposed words. Cost: one pass over the bytes plus a reused 32 MiB temporary.
    """
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if data.numel() % 8 or data.data_ptr() % 8:  # int64 views need whole, aligned words
        padded = torch.zeros(-(-data.numel() // 8) * 8, dtype=torch.uint8, device=data.device)
        padded[: data.numel()] = data
        data = padded
    words = data.view(torch.int64)  # [n]
    out = torch.zeros(2, dtype=torch.int64, device=data.device)
    out[0] = words.sum()
    pairs = words.numel() - 1
    if pairs > 0:
        product = torch.empty(min(_CHUNK_WORDS, pairs), dtype=torch.int64, device=data.device)
        for start in range(0, pairs, _CHUNK_WORDS):
            count = min(_CHUNK_WORDS, pairs - start)
            out[1] += torch.mul(words[start: start + count], words[start + 1: start + 1 + count], out=product[:count]).sum()
    return out


def tensor_checksums(tensor: torch.Tensor, full_shape: list[int] | tuple[int, ...] | None = None,
                     index: Index = ()) -> torch.Tensor:
    """Algorithm :data:`FINGERPRINT_V2`: ``[sum_i e_i, sum_i e_i * (i + 1)]`` over the
    elements of a tensor, or of a slice of a larger one, as int64 ``[2]`` on the tensor's
    device, all arithmetic modulo 2**64 (two's-complement wrap-around).

    ``e_i`` is element ``i``'s bit pattern read as an unsigned integer (1, 2, 4 bytes;
    8-byte elements as their int64 bits) and ``i`` its flat C-order index in the FULL
    tensor. ``tensor`` is the whole tensor (``full_shape`` None) or
    ``full[index]`` for a full tensor of shape ``full_shape`` (``index``: one step-slice
    per leading dimension). The values of the slices of a partition of the full tensor
    add up (mod 2**64) to the full tensor's, in any order and on any device. The first
    value catches one changed element; the second moved or swapped elements (a swap of
    ``e_a != e_b`` changes it by ``(a - b) * (e_b - e_a)``, which is 0 mod 2**64 only if
    that product is).

    Cost: a few passes over the elements widened to int64, in blocks of whole rows (a row:
    the elements past dimension 0) of about :data:`_CHUNK_ELEMENTS` (CPU: 256 Ki, other
    devices: 16 Mi); temporaries of one block (at most that or one row, int64) and one row.

    Raises:
        ValueError: ``tensor``'s shape is not that of ``full[index]``.
    """
    tensor = tensor.detach()
    full = list(tensor.shape) if full_shape is None else [int(d) for d in full_shape]
    if not full:  # a scalar: one element at index 0
        full, tensor, index = [1], tensor.reshape(1), ()
    starts, steps = _slice_layout(full, index, list(tensor.shape))
    strides = [math.prod(full[d + 1:]) for d in range(len(full))]
    out = torch.zeros(2, dtype=torch.int64, device=tensor.device)
    if tensor.numel() == 0:
        return out
    itemsize = tensor.element_size()
    on_cpu = tensor.device.type == "cpu"
    # the CPU widens unsigned views; elsewhere (no unsigned kernels promised) signed ones, then masks
    bits = tensor.view((_UNSIGNED_BITS_DTYPES if on_cpu else _BITS_DTYPES)[itemsize])
    mask = None if on_cpu else _UNSIGNED_MASKS.get(itemsize)
    rows = bits.shape[0]
    row = math.prod(bits.shape[1:])
    per_block = max(1, _CHUNK_ELEMENTS["cpu" if on_cpu else "device"] // max(1, row))
    work = torch.empty(min(rows, per_block) * row, dtype=torch.int64, device=tensor.device)  # the block's e_i
    # flat index of element [r, j...] = (starts[0] + r*steps[0])*strides[0] + inner[j]
    inner = torch.zeros(bits.shape[1:], dtype=torch.int64, device=tensor.device)
    for d in range(1, len(full)):
        shape = [1] * (len(full) - 1)
        shape[d - 1] = bits.shape[d]
        positions = starts[d] + steps[d] * torch.arange(bits.shape[d], dtype=torch.int64, device=tensor.device)
        inner = inner + (positions * strides[d]).view(shape)
    inner_plus_one = inner.reshape(row) + 1
    for first in range(0, rows, per_block):
        count = min(per_block, rows - first)
        work[: count * row].view(count, *bits.shape[1:]).copy_(bits[first: first + count])  # widened, no other copy
        block = work[: count * row].view(count, row)
        if mask is not None:
            block.bitwise_and_(mask)
        row_sums = block.sum(dim=1)  # [count]
        row_base = (starts[0] + steps[0] * torch.arange(first, first + count, dtype=torch.int64,
                                                         device=tensor.device)) * strides[0]
        out[0] += row_sums.sum()
        # sum_rj e_rj (base_r + inner_j + 1) = sum_r base_r rowsum_r + sum_j (inner_j + 1) colsum_j
        out[1] += _dot(row_base, row_sums) + _dot(block.sum(dim=0), inner_plus_one)
    return out


_HOST_ROW = 1 << 14
"""Elements per row of :func:`host_checksums`' ``[rows, _HOST_ROW]`` views."""

_HOST_ROWS = 1 << 10
"""Rows per reduction of :func:`host_checksums` (16 Mi elements): the column sums of 1-
and 2-byte elements, at most ``_HOST_ROWS * 0xFFFF < 2**32``, fit uint32 accumulators."""

_NUMPY_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_MOD = 1 << 64


def element_bits(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's elements as a 1-D unsigned numpy array of their bit
    patterns (uint8/16/32/64 by element size; a view, no copy): what
    :func:`host_checksums` reads.

    Raises:
        ValueError: the tensor is not on the CPU or not contiguous, or its elements are
            not 1, 2, 4 or 8 bytes.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.element_size() not in _NUMPY_UNSIGNED:
        raise ValueError(f"element_bits takes a contiguous CPU tensor of 1-, 2-, 4- or 8-byte elements, got "
                         f"{tensor.dtype} on {tensor.device}")
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().view(_NUMPY_UNSIGNED[tensor.element_size()])


def host_checksums(elements: np.ndarray, first_index: int = 0) -> tuple[int, int]:
    """Algorithm :data:`FINGERPRINT_V2`'s partial sums over a run of consecutive elements
    of a tensor, on the host: ``(sum_k e_k, sum_k e_k * (first_index + k + 1))`` modulo
    2**64, as unsigned Python ints in ``[0, 2**64)``.

    ``elements``: a 1-D unsigned numpy array (uint8/16/32/64: the elements' bit patterns,
    e.g. ``tensor.view(torch.uint8).numpy().view(np.uint16)`` for bfloat16) holding the
    tensor's elements at flat C-order indices ``first_index ..``. Summed over runs that
    cover a whole tensor, then read as int64, these are :func:`tensor_checksums` of it
    (tested): same values, computed without torch's int64 temporaries or its thread
    pool, in a few numpy reductions that release the interpreter lock (so several runs
    can be summed in parallel threads). Cost: two passes over the elements in their own
    width (row sums and column sums of ``[rows, 16 Ki]`` views), about 10x less than
    :func:`tensor_checksums` on one CPU core.

    Uses ``sum_k e_k (first + k + 1) = sum_r (first + r L) R_r + sum_j (j + 1) C_j`` for
    ``e`` viewed as rows of ``L`` elements, ``R_r`` the row sums and ``C_j`` the column
    sums (then the last partial row element by element).

    Raises:
        ValueError: ``elements`` is not a 1-D unsigned integer array.
    """
    if elements.ndim != 1 or elements.dtype.kind != "u":
        raise ValueError(f"host_checksums takes a 1-D unsigned array, got {elements.dtype} of shape {elements.shape}")
    accumulator = np.uint32 if elements.itemsize <= 2 else np.uint64
    total, weighted, rows = 0, 0, elements.size // _HOST_ROW
    columns = np.arange(1, _HOST_ROW + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):  # uint64 products and sums wrap: arithmetic modulo 2**64
        for first_row in range(0, rows, _HOST_ROWS):
            block = elements[first_row * _HOST_ROW: min(rows, first_row + _HOST_ROWS) * _HOST_ROW].reshape(-1, _HOST_ROW)
            row_sums = block.sum(axis=1, dtype=accumulator).astype(np.uint64)
            column_sums = block.sum(axis=0, dtype=accumulator).astype(np.uint64)
            bases = np.arange(first_row, first_row + block.shape[0], dtype=np.uint64) * np.uint64(_HOST_ROW)
            total += int(row_sums.sum(dtype=np.uint64))
            weighted += int(np.dot(bases, row_sums)) + int(np.dot(columns, column_sums))
        tail = elements[rows * _HOST_ROW:].astype(np.uint64)  # the last partial row
        tail_sum = int(tail.sum(dtype=np.uint64))
        total += tail_sum
        weighted += int(np.dot(tail, columns[: tail.size])) + rows * _HOST_ROW * tail_sum
    return total % _MOD, (weighted + first_index * total) % _MOD


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum_i a_i b_i`` of two int64 vectors modulo 2**64 (``torch.dot`` on the CPU,
    one pass; elsewhere a product and a sum: CUDA has no integer ``dot``)."""
    return torch.dot(a, b) if a.device.type == "cpu" else torch.mul(a, b).sum()


def _slice_layout(full: list[int], index: Index, local: list[int]) -> tuple[list[int], list[int]]:
    """``(starts, steps)`` per dimension of ``full[index]``, checked against ``local``."""
    if len(index) > len(full):
        raise ValueError(f"an index of {len(index)} dimensions into a tensor of shape {full}")
    starts, steps, shape = [], [], []
    for d, size in enumerate(full):
        start, stop, step = (index[d] if d < len(index) else slice(None)).indices(size)
        if step <= 0:
            raise ValueError(f"slice {index[d]} of dimension {d}: only positive steps")
        starts.append(start)
        steps.append(step)
        shape.append(len(range(start, stop, step)))
    if shape != local:
        raise ValueError(f"a tensor of shape {local} is not full{list(index)} of a tensor of shape {full} ({shape})")
    return starts, steps


def weights_checksums(state_dict: dict[str, torch.Tensor], algorithm: str = DEVICE_FINGERPRINT_ALGORITHM) -> torch.Tensor:
    """``[T, 2]`` int64 on the tensors' device: the checksums of every tensor (of
    ``algorithm``: :func:`tensor_checksums` or :func:`tensor_checksums_v1`), in name order
    (one device-to-host copy of ``16 T`` bytes reads them all).

    Raises:
        ValueError: an unknown algorithm.
    """
    checksums = _checksum_function(algorithm)
    return torch.stack([checksums(state_dict[name]) for name in sorted(state_dict)])


def _checksum_function(algorithm: str):
    if algorithm == FINGERPRINT_V2:
        return tensor_checksums
    if algorithm == FINGERPRINT_V1:
        return tensor_checksums_v1
    raise ValueError(f"unknown fingerprint algorithm {algorithm!r}; known: {', '.join(FINGERPRINT_ALGORITHMS)}")


def fingerprint_digest(state_dict: dict[str, torch.Tensor], checksums: torch.Tensor) -> str:
    """Hex xxh3_128 over every tensor's ``name|dtype|shape|sum|product`` in name order,
    from ``checksums`` (:func:`weights_checksums` of ``state_dict``, any device; only its
    ``[T, 2]`` values are copied to the host)."""
    return digest_of(sorted((n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in state_dict.items()),
                     checksums)


def digest_of(specs: list[tuple[str, str, list[int]]], checksums: torch.Tensor) -> str:
    """Hex xxh3_128 over ``name|dtype|shape|a|b`` of each ``(name, dtype, full shape)`` of
    ``specs`` (in name order) with row ``k`` of ``checksums`` (``[T, 2]`` int64, any
    device): :func:`fingerprint_digest` from the tensors' descriptions alone (e.g. the
    full shapes of tensors a rank holds slices of)."""
    digest = xxhash.xxh3_128()
    for (name, dtype, shape), (a, b) in zip(specs, checksums.cpu().tolist()):
        digest.update(f"{name}|{dtype}|{list(shape)}|{a}|{b}\n".encode())
    return digest.hexdigest()


def weights_fingerprint(state_dict: dict[str, torch.Tensor], algorithm: str = DEVICE_FINGERPRINT_ALGORITHM) -> str:
    """The weights' fingerprint (algorithm :data:`DEVICE_FINGERPRINT_ALGORITHM`, or the
    one given), computed where the tensors live: on a GPU only ``16 x len(state_dict)``
    bytes reach the host.

    ``state_dict``: name -> tensor, any dtype and device (tied names included or not, as
    the caller's record does). Two state dicts have the same fingerprint when they hold
    the same names, dtypes, shapes and (with overwhelming likelihood) bytes. The trainer
    records it in ``training_info.json`` (``weights.fingerprint``) from the rollout-dtype
    tensors it checkpoints; engines return it for the tensors they hold after a refit.

    Raises:
        ValueError: an unknown algorithm.
    """
    _checksum_function(algorithm)
    if not state_dict:
        return xxhash.xxh3_128().hexdigest()
    return fingerprint_digest(state_dict, weights_checksums(state_dict, algorithm))


def sharded_fingerprint(local: dict[str, torch.Tensor], slices: dict[str, Index], specs: dict[str, tuple[str, list[int]]],
                        group: object = None) -> str:
    """The fingerprint (:data:`FINGERPRINT_V2`) of full tensors held in slices by the ranks
    of a process group, each rank passing its own: equal to :func:`weights_fingerprint` of
    the full tensors. A collective over ``group`` (``torch.distributed``; every rank calls
    it with the same names); only ``16 x len(local)`` bytes per rank leave the device.

    Args:
        local: name -> this rank's tensor ``full[slices[name]]``, any device.
        slices: name -> this rank's index into the full tensor (a name not in it: whole).
        specs: name -> ``(dtype name, full shape)`` (e.g. :func:`~mlperf_grpo.checkpoint.reader.tensor_specs`'s
            shapes with the dtype the engine holds).
        group: the ranks' process group (None: the default group).
    Ranks holding the same slice of a tensor (a replicated tensor) must hold the same
    values; each distinct slice counts once, and the distinct slices must cover the
    tensor's elements.

    Raises:
        ValueError: the ranks hold different names, replicas of a slice differ, or the
            slices do not add up to the full tensor's element count.
    """
    import torch.distributed as dist

    names = sorted(local)
    partials = torch.stack([tensor_checksums(local[n], specs[n][1], slices.get(n, ())) for n in names]).cpu().tolist()
    layout = [_ranges(slices.get(n, ()), specs[n][1]) for n in names]
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (names, layout, partials), group=group)
    combined = []
    for k, name in enumerate(names):
        by_slice: dict[tuple, list[int]] = {}
        for rank_names, rank_layout, rank_partials in gathered:
            if rank_names != names:
                raise ValueError("the ranks of the group hold different tensors")
            seen = by_slice.setdefault(rank_layout[k], rank_partials[k])
            if seen != rank_partials[k]:
                raise ValueError(f"{name}: the ranks holding the same slice {list(rank_layout[k])} hold different values")
        full = specs[name][1]
        counts = sum(math.prod(len(range(*r)) for r in key) for key in by_slice)
        if counts != math.prod(full):
            raise ValueError(f"{name}: the group's slices hold {counts} elements, the tensor {math.prod(full)}")
        sums = [sum(p[i] for p in by_slice.values()) % (1 << 64) for i in (0, 1)]
        combined.append([v - (1 << 64) if v >= 1 << 63 else v for v in sums])  # as int64
    return digest_of([(n, specs[n][0], list(specs[n][1])) for n in names], torch.tensor(combined, dtype=torch.int64))


def _ranges(index: Index, shape: list[int]) -> tuple[tuple[int, int, int], ...]:
    """``(start, stop, step)`` of ``index`` in every dimension of ``shape``."""
    return tuple((index[d] if d < len(index) else slice(None)).indices(size) for d, size in enumerate(shape))


def canary_input_ids(vocab_size: int) -> torch.Tensor:
    """``[1, CANARY_LENGTH]`` fixed token ids, every id < ``vocab_size``."""
    return (torch.arange(CANARY_LENGTH) * 7 % vocab_size).unsqueeze(0)


@torch.no_grad()
def canary_logits(model: torch.nn.Module, vocab_size: int) -> list[float]:
    """The model's first ``CANARY_LOGITS`` last-position logits on the canary input."""
    ids = canary_input_ids(vocab_size).to(next(model.parameters()).device)
    logits = model(input_ids=ids).logits[0, -1, :CANARY_LOGITS]
    return [float(x) for x in logits.float()]


@torch.no_grad()
def canary_logits_in_dtype(model: torch.nn.Module, vocab_size: int, dtype: torch.dtype) -> list[float]:
    """:func:`canary_logits` of ``model`` with its parameters cast to ``dtype`` (a copy
    when the dtype differs; buffers such as RoPE frequencies keep theirs, as when the
    model is loaded in ``dtype``): what an HF engine holding those weights records."""
    if next(model.parameters()).dtype != dtype:
        model = copy.deepcopy(model)
        for param in model.parameters():
            param.data = param.data.to(dtype)
    return canary_logits(model, vocab_size)


def canary_mismatch(expected: list[float], got: list[float], dtype: str, up_to_constant: bool = False) -> float | None:
    """The largest relative difference when it exceeds the dtype's tolerance, else None.

    ``up_to_constant``: ``got`` are log-probabilities, ``logits - logsumexp(logits)``
    (an engine that exposes no raw logits, e.g. vLLM); both vectors are then compared
    after subtracting their own mean, which removes that one constant and nothing else.
    """
    if len(expected) != len(got):
        return float("inf")
    if up_to_constant:
        expected, got = _centered(expected), _centered(got)
    worst = max((abs(a - b) / max(1.0, abs(a)) for a, b in zip(expected, got)), default=0.0)
    return worst if worst > CANARY_TOLERANCE[dtype] else None


def _centered(values: list[float]) -> list[float]:
    mean = sum(values) / len(values) if values else 0.0
    return [v - mean for v in values]
