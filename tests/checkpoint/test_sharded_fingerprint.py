"""Fingerprint v2 (issue 28, item 3): per-tensor sums over elements with their GLOBAL
flat index, so the partial sums of a tensor's slices add up to the whole tensor's; the
combination over a process group (gloo) equals the whole-tensor fingerprint."""

from __future__ import annotations

import struct

import pytest
import torch

from mlperf_grpo.model import fingerprint
from mlperf_grpo.model.fingerprint import (
    FINGERPRINT_V1,
    FINGERPRINT_V2,
    tensor_checksums,
    weights_fingerprint,
)

MOD = 1 << 64


def _signed(v: int) -> int:
    v %= MOD
    return v - MOD if v >= 1 << 63 else v


def _reference(full: torch.Tensor, index: tuple = ()) -> list[int]:
    """v2 of ``full[index]`` from Python ints: element bits as unsigned little-endian
    integers from the bytes, global flat indices from an index tensor sliced alike."""
    size = full.element_size()
    data = bytes(full.contiguous().view(torch.uint8).reshape(-1).numpy())
    e = [int.from_bytes(data[i: i + size], "little") for i in range(0, len(data), size)]
    if size == 8:
        e = [struct.unpack("<q", data[i: i + 8])[0] for i in range(0, len(data), 8)]
    positions = torch.arange(full.numel()).reshape(full.shape)[index].reshape(-1).tolist()
    return [_signed(sum(e[i] for i in positions)), _signed(sum(e[i] * (i + 1) for i in positions))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.uint8])
def test_v2_of_a_whole_tensor_matches_python_ints(dtype):
    torch.manual_seed(0)
    full = (torch.randn(37, 29) * 1e3).to(dtype)
    assert tensor_checksums(full).tolist() == _reference(full)
    scalar = torch.tensor(-3.5, dtype=torch.float32)
    assert tensor_checksums(scalar).tolist() == _reference(scalar.reshape(1))


@pytest.mark.parametrize("shape, spec", [((12, 10), "dim0"), ((12, 10), "dim1"), ((6, 8, 5), "dim1"), ((30,), "dim0")])
@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("block", [None, 7])
def test_v2_partials_of_slices_add_up_to_the_full_tensor(shape, spec, parts, block, monkeypatch):
    if block is not None:  # many blocks of rows (one row when a row is longer)
        monkeypatch.setattr(fingerprint, "_CHUNK_ELEMENTS", {"cpu": block, "device": block})
    torch.manual_seed(1)
    full = torch.randn(shape).to(torch.bfloat16)
    dim = 0 if spec == "dim0" else 1
    step = -(-shape[dim] // parts)
    total = [0, 0]
    for first in range(0, shape[dim], step):
        index = (slice(None),) * dim + (slice(first, first + step),)
        part = full[index]  # a strided view for dim 1
        got = tensor_checksums(part, shape, index).tolist()
        assert got == _reference(full, index)
        total = [a + b for a, b in zip(total, got)]
    assert [_signed(v) for v in total] == tensor_checksums(full).tolist() == _reference(full)
    strided = (slice(1, None, 3),) * len(shape)  # any step-slice: global indices from offsets and steps
    assert tensor_checksums(full[strided], shape, strided).tolist() == _reference(full, strided)


def test_v2_sees_a_changed_byte_swapped_elements_and_a_transpose():
    torch.manual_seed(2)
    w = torch.randn(16, 16).to(torch.bfloat16)
    base = weights_fingerprint({"w": w})
    assert weights_fingerprint({"w": w}, FINGERPRINT_V2) == base
    changed = w.clone()
    changed.view(torch.uint8).view(-1)[77] ^= 1
    swapped = w.clone().view(-1)
    swapped[[3, 200]] = swapped[[200, 3]]
    assert w.view(-1)[3] != w.view(-1)[200]
    assert tensor_checksums(swapped.view(16, 16))[0] == tensor_checksums(w)[0]  # the plain sum cannot see a swap
    for other in (changed, swapped.view(16, 16), w.t().contiguous()):
        assert weights_fingerprint({"w": other}) != base
    assert weights_fingerprint({"w": w}, FINGERPRINT_V1) != base  # the algorithms differ
    with pytest.raises(ValueError, match="unknown fingerprint algorithm"):
        weights_fingerprint({"w": w}, "md5")
    with pytest.raises(ValueError, match="is not full"):
        tensor_checksums(w[:, :5], [16, 16], (slice(None), slice(0, 6)))


def _host(t: torch.Tensor, pieces: int = 1) -> list[int]:
    """v2 of a whole tensor from :func:`fingerprint.host_checksums` over ``pieces`` runs."""
    bits = fingerprint.element_bits(t.contiguous())
    step = max(1, -(-bits.size // pieces))
    runs = [fingerprint.host_checksums(bits[k: k + step], k) for k in range(0, bits.size, step)]
    return [_signed(sum(r[i] for r in runs)) for i in (0, 1)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("shape", [(37, 29), (3, 5, 7), (1,), (), (0, 4), (200,)])
@pytest.mark.parametrize("small_rows", [False, True])
def test_host_checksums_equal_tensor_checksums_and_python_ints(dtype, shape, small_rows, monkeypatch):
    if small_rows:  # many [rows, L] blocks and a partial last row, as at real sizes
        monkeypatch.setattr(fingerprint, "_HOST_ROW", 8)
        monkeypatch.setattr(fingerprint, "_HOST_ROWS", 3)
    torch.manual_seed(4)
    full = (torch.randn(shape) * 1e3).to(dtype) if dtype != torch.bool else torch.randn(shape) > 0
    want = tensor_checksums(full).tolist()
    assert want == _reference(full.reshape(-1) if full.dim() == 0 else full)
    for pieces in (1, 2, 5):  # runs of a partition add up
        assert _host(full, pieces) == want


def test_host_checksums_of_the_largest_elements_need_no_more_than_their_accumulators():
    # 2 blocks of 1024 rows x 16 Ki of 0xFFFF and a partial row: the column sums reach
    # 1024 * 0xFFFF (< 2**32, the uint32 bound); the exact values from the closed forms
    n = 2 * fingerprint._HOST_ROWS * fingerprint._HOST_ROW + 123
    ones = torch.full((n,), -1, dtype=torch.int16)  # every bit set: e_i = 0xFFFF
    assert _host(ones) == [_signed(0xFFFF * n), _signed(0xFFFF * n * (n + 1) // 2)]
    assert fingerprint.host_checksums(fingerprint.element_bits(ones)[5:], 5) == (
        0xFFFF * (n - 5) % MOD, 0xFFFF * (n * (n + 1) // 2 - 15) % MOD)
    with pytest.raises(ValueError, match="1-D unsigned"):
        fingerprint.host_checksums(fingerprint.element_bits(ones).view("int16"))
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        fingerprint.element_bits(torch.zeros(4, 4)[:, :2])


def _sharded_rank(rank: int, world: int, port: int, tensors: dict, results) -> None:
    import torch.distributed as dist

    from mlperf_grpo.checkpoint import CheckpointCorruptError
    from mlperf_grpo.checkpoint.share_read import agree_on_read
    from mlperf_grpo.model.fingerprint import sharded_fingerprint

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        slices = {"a": (slice(rank * 6, rank * 6 + 6),), "b": (slice(None), slice(rank * 5, rank * 5 + 5))}
        specs = {n: ("bfloat16", list(t.shape)) for n, t in tensors.items()}
        local = {n: t[slices[n]] if n in slices else t for n, t in tensors.items()}  # "n" is replicated
        results.put((rank, sharded_fingerprint(local, slices, specs)))
        if rank == 1:
            local["n"] = local["n"] + 1  # a replica that differs is refused on every rank
        try:
            sharded_fingerprint(local, slices, specs)
        except ValueError as err:
            results.put((rank, str(err)))
        # the group's read outcome: a hash that failed on rank 1 fails rank 0 too
        mine = CheckpointCorruptError("step_18/model-00002-of-00003.safetensors: xxh3_128 differs") if rank == 1 else None
        got = agree_on_read(mine)
        results.put((rank, f"{type(got).__name__}: {got}"))
        assert agree_on_read(None) is None
    finally:
        dist.destroy_process_group()


def test_sharded_fingerprint_and_read_outcome_over_a_gloo_group():
    import socket

    import torch.multiprocessing as mp

    torch.manual_seed(3)
    tensors = {"a": torch.randn(12, 4).to(torch.bfloat16), "b": torch.randn(3, 10).to(torch.bfloat16),
               "n": torch.randn(7).to(torch.bfloat16)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_sharded_rank, args=(r, 2, port, tensors, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in range(6)]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    want = weights_fingerprint(tensors)
    refused = "n: the ranks holding the same slice [(0, 7, 1)] hold different values"
    failed = "CheckpointCorruptError: step_18/model-00002-of-00003.safetensors: xxh3_128 differs"
    assert sorted(m for _, m in got) == sorted([want, refused, failed] * 2)
