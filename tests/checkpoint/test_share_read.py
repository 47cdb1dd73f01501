"""One tensor-parallel rank's share of a checkpoint (issue 28, item 3): exactly
``full[slice]`` of every tensor, only those bytes read, the files' hashes divided among
the group's ranks, host memory of the share alone. (The group's agreement on a failed
hash, a collective, is tested with the fingerprint's in test_sharded_fingerprint.py.)"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from mlperf_grpo.checkpoint import CheckpointCorruptError, TrainingInfo, discover_checkpoints, read_weights, share_read
from mlperf_grpo.checkpoint.reader import ReadBuffers
from mlperf_grpo.checkpoint.share_read import HASH_KEYS, SHARE_KEY, hashing_ranks, read_share, reserve_share
from mlperf_grpo.checkpoint.writer import AsyncCheckpointer
from mlperf_grpo.config.sections import BUILTIN_MODEL
from mlperf_grpo.evaluate.series import EvaluationError, RefitError, verify_refit
from mlperf_grpo.inference.hf import HFEngine
from mlperf_grpo.model.files import BUILTIN_MODEL_DIR
from mlperf_grpo.model.fingerprint import FINGERPRINT_V1, FINGERPRINT_V2, weights_fingerprint


@pytest.fixture(scope="module")
def engine():
    return HFEngine(BUILTIN_MODEL, "bfloat16", batch_size=1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, engine):
    """The engine's weights as a checkpoint of several shard files, with its canary."""
    root = tmp_path_factory.mktemp("share")
    writer = AsyncCheckpointer(root, BUILTIN_MODEL_DIR, max_shard_size=40_000)
    writer.save(engine.weights(), TrainingInfo(18, 288, 1_018, 4608, 256, 16, "bfloat16", engine.canary_logits()))
    writer.finish()
    found = discover_checkpoints(root)[0][0]
    assert len(found.shard_paths()) >= 3
    return found


def spec(full: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, tuple[slice, ...]]:
    """A plain slicing spec: alternate names split on dim 0 or dim 1 (when divisible),
    the others replicated."""
    out = {}
    for k, name in enumerate(sorted(full)):
        shape = full[name].shape
        dim = k % 2 if len(shape) > 1 else 0
        if len(shape) > dim and shape[dim] % size == 0:
            part = shape[dim] // size
            out[name] = (slice(None),) * dim + (slice(rank * part, rank * part + part),)
    return out


@pytest.mark.parametrize("size", [2, 4])
def test_read_share_gives_each_rank_exactly_its_slices_reading_only_those_bytes(checkpoint, size, monkeypatch):
    monkeypatch.setattr(share_read, "READ_CHUNK_BYTES", 4096)  # hashing streams many chunks
    full = read_weights(checkpoint)
    total = sum(t.numel() * t.element_size() for t in full.values())
    largest = max(t.numel() * t.element_size() for t in full.values())
    assert any(len(s) == 2 for s in spec(full, 0, size).values()) and any(len(s) == 1 for s in spec(full, 0, size).values())
    read_bytes = []
    real_preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: read_bytes.append(real_preadv(fd, bufs, offset)) or read_bytes[-1])
    for rank in range(size):
        slices = spec(full, rank, size)
        buffers = ReadBuffers()
        reserve_share(buffers, checkpoint, slices)  # allocated ahead: the read allocates nothing
        reserved = {key: buffers.get(key, n).data_ptr() for key, n in buffers.allocated().items()}
        read_bytes.clear()
        share = read_share(checkpoint, slices, buffers, rank, size)
        assert {key: buffers.get(key, n).data_ptr() for key, n in buffers.allocated().items()} == reserved
        assert sorted(share) == sorted(full)
        for name, tensor in share.items():
            want = full[name][slices.get(name, ())]
            assert tensor.dtype == want.dtype and tensor.shape == want.shape and torch.equal(tensor, want), name
        share_bytes = sum(t.numel() * t.element_size() for t in share.values())
        assert sum(read_bytes) == share_bytes  # the slices' bytes, nothing more
        allocated = buffers.allocated()
        assert set(allocated) <= {SHARE_KEY, *HASH_KEYS}  # no whole shard in memory
        assert allocated[SHARE_KEY] <= total / size + largest
        assert sum(allocated.values()) <= total / size + largest + 2 * 4096


def test_a_flipped_byte_fails_the_hash_of_whichever_rank_hashes_the_file(checkpoint, tmp_path):
    import shutil

    copy = tmp_path / checkpoint.path.name
    shutil.copytree(checkpoint.path, copy)
    c = type(checkpoint)(checkpoint.step, copy, checkpoint.info)
    full = read_weights(c)
    owners = hashing_ranks(c, 2)
    assert set(owners.values()) == {0, 1}
    for path in c.shard_paths():
        original = path.read_bytes()
        data = bytearray(original)
        data[-3] ^= 0x10  # a tensor byte, past the header
        path.write_bytes(bytes(data))
        for rank in range(2):
            if owners[path.name] == rank:
                with pytest.raises(CheckpointCorruptError, match=f"{path.name}: xxh3_128 differs"):
                    read_share(c, spec(full, rank, 2), ReadBuffers(), rank, 2)
            else:
                read_share(c, spec(full, rank, 2), ReadBuffers(), rank, 2)  # not its file: the group decides
        path.write_bytes(original)


def _recording(checkpoint, algorithm: str, digest: str):
    info = dataclasses.replace(checkpoint.info, weights={**checkpoint.info.weights,
                                                         "fingerprint": {"algorithm": algorithm, "digest": digest}})
    return dataclasses.replace(checkpoint, info=info)


def test_verify_uses_the_recorded_algorithm_and_refuses_v1_at_tensor_parallel_size_2(checkpoint, engine):
    weights = read_weights(checkpoint)
    names = list(weights)
    assert checkpoint.info.weights["fingerprint"]["algorithm"] == FINGERPRINT_V2  # what new checkpoints record
    old = _recording(checkpoint, FINGERPRINT_V1, weights_fingerprint(weights, FINGERPRINT_V1))
    for c in (checkpoint, old):
        assert verify_refit(engine, c, names) == "fingerprint+canary"
    saved = engine.weights()["model.norm.weight"].clone()
    try:
        engine.weights()["model.norm.weight"][0] += 1  # one element changed
        for c in (checkpoint, old):
            with pytest.raises(RefitError, match="weights differ"):
                verify_refit(engine, c, names)
    finally:
        engine.weights()["model.norm.weight"].copy_(saved)

    class WithoutWeights:  # an engine that hands out no weights (vLLM) computes v2 only
        tp_size, canary_is_log_softmax = 1, False
        weights = staticmethod(lambda: None)
        canary_logits = staticmethod(engine.canary_logits)

    assert verify_refit(WithoutWeights(), old, names) == (
        f"canary (fingerprint unchecked: algorithm '{FINGERPRINT_V1}' not computed by this engine)")

    class TwoRanks:  # refused before any collective: the group is never used
        tp_size = 2

    with pytest.raises(EvaluationError, match="evaluate with inference.tensor_parallel_size 1"):
        verify_refit(TwoRanks(), old, names)
