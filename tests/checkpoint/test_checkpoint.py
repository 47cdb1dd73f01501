"""Deferred checkpoints: HF-format, atomic and ordered publish, back-pressure, failures,
verification while reading."""

import errno
import io
import json
import threading
import time

import pytest
import torch
import xxhash
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from mlperf_grpo.checkpoint import (
    AsyncCheckpointer,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointWriteError,
    TrainingInfo,
    check_same_tensors,
    discover_checkpoints,
    read_training_end,
    read_weights,
    tensor_specs,
    write_checkpoint,
)
from mlperf_grpo.checkpoint import writer as writer_module
from mlperf_grpo.model.files import BUILTIN_MODEL_DIR
from mlperf_grpo.model.load import load_model


def _info(step):
    return TrainingInfo(step, step * 16, 1_000 + step, step * 256, 256, 16, "float32", [0.5] * 4)


def _slow_writes(monkeypatch, delays_s: dict[int, float], fail_step: int | None = None):
    """Make the shard writes of some steps slow (and one fail with ENOSPC)."""
    real = writer_module.AsyncCheckpointer._write_shard

    def write_shard(path, shard, slot):
        step = int(path.parent.name.removeprefix("tmp_step_"))
        time.sleep(delays_s.get(step, 0.0))
        if step == fail_step:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, shard, slot)

    monkeypatch.setattr(writer_module.AsyncCheckpointer, "_write_shard", staticmethod(write_shard))


def test_published_checkpoint_is_a_hugging_face_model_with_the_policys_logits(tmp_path):
    policy = load_model("builtin:arithmetic-tiny", "float32")
    with torch.no_grad():
        policy.model.embed_tokens.weight.add_(0.01)  # "trained": differs from the shipped weights
    path = write_checkpoint(tmp_path, policy.state_dict(), _info(18), BUILTIN_MODEL_DIR, max_shard_size=100_000)
    assert path.name == "step_18" and not (tmp_path / "tmp_step_18").exists()
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).read_bytes() == (BUILTIN_MODEL_DIR / name).read_bytes()
    loaded = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 3, 4, 2]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, policy(input_ids=ids).logits)
    info = json.loads((path / "training_info.json").read_text())
    assert info["training_step_end_time_ms"] == 1018 and info["samples_count"] == 18 * 256
    assert info["weights"]["hash_algorithm"] == "xxh3_128"
    for shard, meta in info["weights"]["shards"].items():
        data = (path / shard).read_bytes()
        assert meta == {"hash": xxhash.xxh3_128_hexdigest(data), "bytes": len(data)}
    assert info["files"]["tokenizer.json"]["hash"] == xxhash.xxh3_128_hexdigest((BUILTIN_MODEL_DIR / "tokenizer.json").read_bytes())
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once, as save_pretrained does
    found, _ = discover_checkpoints(tmp_path)
    weights = read_weights(found[0])
    assert torch.equal(weights["model.embed_tokens.weight"], policy.model.embed_tokens.weight)


class _WithEmptyTensors(LlamaForCausalLM):
    """The built-in model's class plus three zero-size parameters (a layer with no
    experts, a disabled bias, ...): every empty storage has address 0."""

    def __init__(self, config):
        super().__init__(config)
        self.empty_a = torch.nn.Parameter(torch.empty(0, 4))
        self.empty_b = torch.nn.Parameter(torch.empty(0))
        self.empty_c = torch.nn.Parameter(torch.empty(3, 0))


def test_zero_size_tensors_are_all_published_and_from_pretrained_loads_them(tmp_path):
    """safetensors/safetensors#280: a dedup by storage address kept one of three."""
    policy = _WithEmptyTensors.from_pretrained(BUILTIN_MODEL_DIR, local_files_only=True)
    state = policy.state_dict()
    assert {n: tuple(state[n].shape) for n in ("empty_a", "empty_b", "empty_c")} == {
        "empty_a": (0, 4), "empty_b": (0,), "empty_c": (3, 0)}
    path = write_checkpoint(tmp_path, state, _info(18), BUILTIN_MODEL_DIR)
    found = discover_checkpoints(tmp_path)[0][0]
    specs = tensor_specs(found)
    assert all(torch.equal(t, state[n]) for n, t in read_weights(found).items())  # the verified read
    assert {n: specs[n][1] for n in ("empty_a", "empty_b", "empty_c")} == {"empty_a": [0, 4], "empty_b": [0], "empty_c": [3, 0]}
    assert "lm_head.weight" not in specs  # still tied: stored once
    loaded, info = _WithEmptyTensors.from_pretrained(path, local_files_only=True, output_loading_info=True)
    assert info["missing_keys"] == set() and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert loaded.empty_c.shape == (3, 0) and loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_staging_copies_the_weights_before_save_returns(tmp_path, monkeypatch):
    _slow_writes(monkeypatch, {18: 0.3})
    state = {"w": torch.zeros(1000)}
    writer = AsyncCheckpointer(tmp_path, BUILTIN_MODEL_DIR)
    writer.save(state, _info(18))
    state["w"].fill_(7.0)  # training changes the weights while step_18 is being written
    writer.finish()
    assert torch.equal(read_weights(discover_checkpoints(tmp_path)[0][0])["w"], torch.zeros(1000))


def test_step_n_plus_1_is_never_published_before_step_n(tmp_path, monkeypatch):
    _slow_writes(monkeypatch, {18: 1.0})  # step_19's write finishes first
    renamed = []
    real_rename = writer_module.os.rename

    def rename(src, dst):
        renamed.append((dst.name, sorted(p.name for p in tmp_path.glob("step_*"))))
        real_rename(src, dst)

    monkeypatch.setattr(writer_module.os, "rename", rename)
    writer = AsyncCheckpointer(tmp_path, BUILTIN_MODEL_DIR, max_in_flight=2)
    writer.save({"w": torch.ones(10)}, _info(18))
    writer.save({"w": torch.ones(10)}, _info(19))
    time.sleep(0.5)
    assert not (tmp_path / "step_19").exists() and (tmp_path / "tmp_step_19" / "training_info.json").exists()
    writer.finish()
    assert renamed == [("step_18", []), ("step_19", ["step_18"])]
    assert read_training_end(tmp_path).last_published_step == 19


def test_back_pressure_bounds_checkpoints_in_flight(tmp_path, monkeypatch):
    _slow_writes(monkeypatch, {18: 1.5, 19: 1.5, 20: 0.0})
    writer = AsyncCheckpointer(tmp_path, BUILTIN_MODEL_DIR, max_in_flight=2)
    t18 = writer.save({"w": torch.ones(10)}, _info(18))
    t19 = writer.save({"w": torch.ones(10)}, _info(19))
    t20 = writer.save({"w": torch.ones(10)}, _info(20))  # both slots busy: waits for one
    writer.finish()
    assert t18.wait_s < 0.5 and t19.wait_s < 0.5
    assert t20.wait_s > 0.8  # held until step_18's shards were written (1.5 s after it was queued)
    assert [c.step for c in discover_checkpoints(tmp_path)[0]] == [18, 19, 20]


def test_failed_write_publishes_nothing_after_it_and_is_raised_at_the_next_step(tmp_path, monkeypatch):
    _slow_writes(monkeypatch, {}, fail_step=19)
    writer = AsyncCheckpointer(tmp_path, BUILTIN_MODEL_DIR, max_in_flight=2)
    writer.save({"w": torch.ones(10)}, _info(18))
    writer.save({"w": torch.ones(10)}, _info(19))
    writer.save({"w": torch.ones(10)}, _info(20))  # queued before the failure is known
    with pytest.raises(CheckpointWriteError, match=r"cannot write checkpoint .*tmp_step_19: No space left on device; it needs about \d+ bytes"):
        writer.finish("finished")
    with pytest.raises(CheckpointWriteError):
        writer.save({"w": torch.ones(10)}, _info(21))  # training stops at the next step boundary
    assert [c.step for c in discover_checkpoints(tmp_path)[0]] == [18]
    assert not list(tmp_path.glob("tmp_step_*"))
    end = read_training_end(tmp_path)
    assert end.last_published_step == 18 and end.reason == "write_failed"


def test_corrupt_shard_is_found_while_reading(tmp_path):
    write_checkpoint(tmp_path, {"a": torch.arange(100.0), "b": torch.ones(3)}, _info(18), BUILTIN_MODEL_DIR)
    checkpoint = discover_checkpoints(tmp_path)[0][0]
    shard = checkpoint.shard_paths()[0]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01  # a weight byte: the header still parses
    shard.write_bytes(bytes(data))
    assert set(tensor_specs(checkpoint)) == {"a", "b"}  # headers alone cannot see it
    with pytest.raises(CheckpointCorruptError, match="step_18/model-00001-of-00001.safetensors: xxh3_128 differs"):
        read_weights(checkpoint)


def test_tensor_specs_differing_between_checkpoints_are_named(tmp_path):
    write_checkpoint(tmp_path, {"a": torch.ones(4), "b": torch.ones(3)}, _info(18), BUILTIN_MODEL_DIR)
    write_checkpoint(tmp_path, {"a": torch.ones(4), "c": torch.ones(3)}, _info(19), BUILTIN_MODEL_DIR)
    with pytest.raises(CheckpointError, match=r"step_19: tensor names, shapes or dtypes differ from step_18 \(first difference: 'b'\)"):
        check_same_tensors(discover_checkpoints(tmp_path)[0])


def test_before_publish_runs_in_the_writer_before_the_rename_and_its_failure_publishes_nothing(tmp_path):
    seen = []

    def before_publish():  # the trainer passes MLLogWriter.sync here
        seen.append((threading.current_thread().name, sorted(p.name for p in tmp_path.glob("*step_*"))))

    writer = AsyncCheckpointer(tmp_path, BUILTIN_MODEL_DIR, before_publish=before_publish)
    writer.save({"w": torch.ones(10)}, _info(18))
    writer.finish()
    assert len(seen) == 1 and seen[0][0].startswith("checkpoint-writer") and seen[0][1] == ["tmp_step_18"]

    failing = tmp_path / "failing"

    def fail():
        raise OSError(errno.EIO, "Input/output error")

    writer = AsyncCheckpointer(failing, BUILTIN_MODEL_DIR, before_publish=fail)
    writer.save({"w": torch.ones(10)}, _info(18))
    with pytest.raises(CheckpointWriteError, match="Input/output error"):
        writer.finish()
    assert discover_checkpoints(failing)[0] == []

    # torchrun's launcher SIGKILLed, its store gone: not an OSError (it was lost, finish() raised nothing and
    # training_end.json said "finished"), not the disk's (no free bytes named)
    def lost_store():
        raise torch.distributed.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")

    writer = AsyncCheckpointer(tmp_path / "lost", BUILTIN_MODEL_DIR, before_publish=lost_store)
    writer.save({"w": torch.ones(10)}, _info(18))
    with pytest.raises(CheckpointWriteError) as err:
        writer.finish()
    assert str(err.value).endswith("tmp_step_18: DistNetworkError: Failed to recv, got 0 bytes. Connection was "
                                   "likely closed."), err.value
    assert discover_checkpoints(tmp_path / "lost")[0] == []
    assert read_training_end(tmp_path / "lost").reason == "write_failed"


# --------------------------------------------------------------------------- device fingerprint, verified reads

def _words_reference(t: torch.Tensor) -> list[int]:
    """tensor_checksums_v1 computed independently: Python ints over 8-byte little-endian
    words of the tensor's bytes (zero-padded), reduced modulo 2**64 as signed int64."""
    import struct

    data = bytes(t.contiguous().view(torch.uint8).reshape(-1).numpy())
    data += b"\0" * (-len(data) % 8)
    words = [struct.unpack_from("<q", data, i)[0] for i in range(0, len(data), 8)]

    def wrap(v):
        v %= 1 << 64
        return v - (1 << 64) if v >= 1 << 63 else v

    return [wrap(sum(words)), wrap(sum(a * b for a, b in zip(words, words[1:])))]


@pytest.mark.parametrize("shape, dtype", [((37, 29), torch.bfloat16), ((1001,), torch.float32), ((3,), torch.bfloat16), ((1,), torch.float32)])
def test_tensor_checksums_v1_match_an_independent_computation(shape, dtype):
    from mlperf_grpo.model.fingerprint import tensor_checksums_v1

    torch.manual_seed(0)
    t = (torch.randn(shape) * 1e3).to(dtype)
    assert tensor_checksums_v1(t).tolist() == _words_reference(t)
    unaligned = torch.cat([torch.zeros(1, dtype=dtype), t.reshape(-1)])[1:]  # storage offset of one element
    assert tensor_checksums_v1(unaligned).tolist() == _words_reference(t)


def test_fingerprint_catches_swapped_words_a_transpose_and_a_changed_value():
    from mlperf_grpo.model.fingerprint import tensor_checksums, weights_fingerprint

    w = torch.randn(64, 64).to(torch.bfloat16)
    swapped = w.clone().view(-1, 4)  # 4 bfloat16 = one 64-bit word per row
    swapped[[0, 9]] = swapped[[9, 0]]
    swapped = swapped.view(64, 64)
    assert tensor_checksums(w)[0] == tensor_checksums(swapped)[0]  # the plain sum cannot see it
    assert weights_fingerprint({"w": w}) != weights_fingerprint({"w": swapped})
    assert weights_fingerprint({"w": w}) != weights_fingerprint({"w": w.t().contiguous()})
    changed = w.clone()
    changed[3, 5] = changed[3, 5] * 2 + 1
    assert weights_fingerprint({"w": w}) != weights_fingerprint({"w": changed})
    assert weights_fingerprint({"w": w}) != weights_fingerprint({"v": w})  # names count
    assert weights_fingerprint({"w": w}) == weights_fingerprint({"w": w.clone()})


def test_writer_records_the_fingerprint_that_a_verified_read_reproduces(tmp_path):
    from mlperf_grpo.checkpoint.reader import ReadBuffers, read_verified
    from mlperf_grpo.model.fingerprint import DEVICE_FINGERPRINT_ALGORITHM, weights_fingerprint

    policy = load_model("builtin:arithmetic-tiny", "float32")
    state = policy.state_dict()
    writer = AsyncCheckpointer(tmp_path, BUILTIN_MODEL_DIR, max_shard_size=100_000)
    writer.save(state, _info(18))
    with torch.no_grad():
        policy.model.embed_tokens.weight.add_(0.5)
    writer.save(policy.state_dict(), _info(19))
    writer.finish()
    found, _ = discover_checkpoints(tmp_path)
    buffers = ReadBuffers()
    digests = []
    for checkpoint in found:
        recorded = checkpoint.info.weights["fingerprint"]
        assert recorded["algorithm"] == DEVICE_FINGERPRINT_ALGORITHM
        weights = read_verified(checkpoint, buffers)  # both reads into the same buffers
        assert weights_fingerprint(weights) == recorded["digest"]
        expected = {n: t for n, t in policy.state_dict().items() if n != "lm_head.weight"} if checkpoint.step == 19 else None
        if expected is not None:
            assert weights_fingerprint(expected) == recorded["digest"]
        digests.append(recorded["digest"])
    assert digests[0] != digests[1]


def test_read_verified_refuses_a_shard_of_the_right_size_with_other_bytes(tmp_path):
    from mlperf_grpo.checkpoint.reader import ReadBuffers, read_verified

    write_checkpoint(tmp_path, {"w": torch.arange(4096, dtype=torch.float32)}, _info(18), BUILTIN_MODEL_DIR)
    checkpoint = discover_checkpoints(tmp_path)[0][0]
    shard = checkpoint.shard_paths()[0]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="step_18/model-00001-of-00001.safetensors: xxh3_128 differs"):
        read_verified(checkpoint, ReadBuffers())


def _count_host_allocations(monkeypatch) -> list[int]:
    """The sizes of the host buffers the checkpoint reader allocates from now on."""
    from mlperf_grpo.checkpoint import reader

    allocations = []
    real_empty = torch.empty

    def counting_empty(*args, **kwargs):
        allocations.append(args[0])
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(reader.torch, "empty", counting_empty)
    return allocations


def test_prefetcher_allocates_every_buffer_set_around_the_first_read(tmp_path, monkeypatch):
    """Both host buffer sets exist, at the shard sizes, before the second checkpoint is
    submitted (pinning then stays out of the first refit); later reads allocate nothing
    and give the same tensors as a plain read."""
    from mlperf_grpo.checkpoint.reader import ReadBuffers, read_verified
    from mlperf_grpo.evaluate.prefetch import CheckpointPrefetcher

    for step in (18, 19, 20):
        write_checkpoint(tmp_path, {"w": torch.arange(4096, dtype=torch.float32) * step,
                                    "b": torch.ones(100, dtype=torch.float32)}, _info(step), BUILTIN_MODEL_DIR,
                         max_shard_size=10_000)
    found = discover_checkpoints(tmp_path)[0]
    sizes = {name: shard["bytes"] for name, shard in found[0].info.weights["shards"].items()}
    assert len(sizes) == 2
    plain = {c.step: {n: t.clone() for n, t in read_verified(c, ReadBuffers()).items()} for c in found}
    allocations = _count_host_allocations(monkeypatch)
    prefetcher = CheckpointPrefetcher(read_verified, pin=False)
    try:
        prefetcher.submit(0, found[0])
        first = prefetcher.take()
        deadline = time.monotonic() + 10
        while len(allocations) < 4 and time.monotonic() < deadline:  # the second set follows the first read
            time.sleep(0.01)
        assert sorted(allocations) == sorted(list(sizes.values()) * 2)
        prefetcher.submit(1, found[1])
        prefetcher.release(first)
        prefetcher.submit(2, found[2])
        for step in (19, 20):
            item = prefetcher.take()
            assert item.error is None and item.checkpoint.step == step
            assert item.weights.keys() == plain[step].keys()
            assert all(torch.equal(item.weights[n], plain[step][n]) for n in plain[step])
            prefetcher.release(item)
        assert len(allocations) == 4
    finally:
        prefetcher.close()


@pytest.mark.parametrize("recorded_bytes", [10**15, -5, "4096"])
def test_prefetcher_reserves_nothing_for_an_absurd_recorded_shard_size(tmp_path, monkeypatch, recorded_bytes):
    """A ``training_info.json`` whose shard size is absurd (a petabyte, negative, not a
    number) is reported as corrupt by the read, as without the reservation: the
    reservation allocates nothing for it (it used to try the recorded size: a
    ``DefaultCPUAllocator`` error and exit 1, or on a GPU host a page-locked fill of that
    many bytes)."""
    from mlperf_grpo.checkpoint.reader import read_verified
    from mlperf_grpo.evaluate.prefetch import CheckpointPrefetcher

    for step in (18, 19):
        write_checkpoint(tmp_path, {"w": torch.arange(4096, dtype=torch.float32) * step}, _info(step), BUILTIN_MODEL_DIR)
    info_path = tmp_path / "step_18" / "training_info.json"
    info = json.loads(info_path.read_text())
    [shard] = info["weights"]["shards"].values()
    true_bytes, shard["bytes"] = shard["bytes"], recorded_bytes
    info_path.write_text(json.dumps(info))
    found = discover_checkpoints(tmp_path)[0]
    allocations = _count_host_allocations(monkeypatch)
    prefetcher = CheckpointPrefetcher(read_verified, pin=False)
    try:
        prefetcher.submit(0, found[0])
        item = prefetcher.take()
        assert isinstance(item.error, CheckpointCorruptError)
        assert f"{true_bytes} bytes, training_info.json recorded {recorded_bytes!r}" in str(item.error)
        prefetcher.release(item)
        prefetcher.submit(1, found[1])  # the next checkpoint reads normally
        item = prefetcher.take()
        assert item.error is None and torch.equal(item.weights["w"], torch.arange(4096, dtype=torch.float32) * 19)
        assert allocations == [true_bytes]  # only the read of step_19 allocated, at its true size
    finally:
        prefetcher.close()


def test_prefetcher_hands_over_a_read_failure_that_is_not_an_exception():
    """DCP's ``CheckpointException`` derives from ``BaseException``: it killed the thread
    and ``take()`` waited forever (``evaluate --format nemo-rl`` on a truncated file)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from mlperf_grpo.evaluate.prefetch import CheckpointPrefetcher

    def read(checkpoint, buffers, stop):
        raise CheckpointException("read", {0: RuntimeError("failed finding central directory")})

    prefetcher = CheckpointPrefetcher(read, pin=False, reserve=False)
    taken = []
    taker = threading.Thread(target=lambda: taken.append(prefetcher.take()), daemon=True)
    try:
        prefetcher.submit(7, "a checkpoint")
        taker.start()
        taker.join(timeout=30)  # a bound on failure, not a synchronisation: the item is handed over at once
        assert not taker.is_alive(), "take() still waits: the read's failure never reached it"
        assert taken[0].index == 7 and isinstance(taken[0].error, CheckpointException) and taken[0].weights is None
    finally:
        prefetcher.close()


def test_prefetcher_close_stops_a_read_in_progress_and_ends_its_thread(tmp_path, monkeypatch):
    """close() during a read gives it up at the next chunk and returns with the thread
    ended (before, the daemon thread was left reading: at interpreter exit a thread
    inside a reader or torch aborts the process); a read stopped so raises ReadStopped."""
    from mlperf_grpo.checkpoint import reader
    from mlperf_grpo.checkpoint.reader import ReadBuffers, ReadStopped, read_verified
    from mlperf_grpo.evaluate.prefetch import CheckpointPrefetcher

    write_checkpoint(tmp_path, {"w": torch.arange(1 << 16, dtype=torch.float32)}, _info(18), BUILTIN_MODEL_DIR)
    checkpoint = discover_checkpoints(tmp_path)[0][0]
    monkeypatch.setattr(reader, "READ_CHUNK_BYTES", 1024)  # 256+ chunks
    chunks = threading.Semaphore(0)
    real_readinto = io.FileIO.readinto

    class SlowFile(io.FileIO):
        def readinto(self, view):
            chunks.release()
            time.sleep(0.05)  # 256 chunks: a 13 s read
            return real_readinto(self, view)

    monkeypatch.setattr(reader, "open", lambda path, mode, buffering: SlowFile(path, "r"), raising=False)
    prefetcher = CheckpointPrefetcher(read_verified, pin=False)
    prefetcher.submit(0, checkpoint)
    assert chunks.acquire(timeout=10) and chunks.acquire(timeout=10)  # the read is under way
    start = time.monotonic()
    prefetcher.close()
    assert time.monotonic() - start < 2.0
    assert not prefetcher._thread.is_alive()
    stop = threading.Event()
    stop.set()
    with pytest.raises(ReadStopped):
        read_verified(checkpoint, ReadBuffers(pin=False), stop)


def test_prefetcher_close_waits_for_a_buffer_allocation_in_progress(tmp_path, monkeypatch):
    """close() returns only once the thread's page-locking (the other buffer sets, after
    the first read) is over: no thread may be inside torch when the process exits."""
    from mlperf_grpo.checkpoint.reader import ReadBuffers, read_verified
    from mlperf_grpo.evaluate.prefetch import CheckpointPrefetcher

    write_checkpoint(tmp_path, {"w": torch.arange(64, dtype=torch.float32)}, _info(18), BUILTIN_MODEL_DIR)
    checkpoint = discover_checkpoints(tmp_path)[0][0]
    reserves, started, finished = [], threading.Event(), []
    real_reserve = ReadBuffers.reserve

    def slow_reserve(self, c):
        reserves.append(self)
        if len(reserves) == 2:  # the second set, reserved after the first read
            started.set()
            time.sleep(1.0)
            finished.append(time.monotonic())
        real_reserve(self, c)

    monkeypatch.setattr(ReadBuffers, "reserve", slow_reserve)
    prefetcher = CheckpointPrefetcher(read_verified, pin=False)
    prefetcher.submit(0, checkpoint)
    assert prefetcher.take().error is None
    assert started.wait(10)
    prefetcher.close()
    closed = time.monotonic()
    assert finished and finished[0] <= closed


def test_teardown_deletes_only_the_checkpoints_and_keeps_what_else_lies_beside_them(tmp_path):
    """``remove_checkpoints`` deletes ``step_N/``, ``tmp_step_N/`` and ``training_end.json``;
    results an ``evaluate --checkpoints`` of the folder wrote (``eval/``) and a user's file
    stay (an evaluation of the run afterwards deleted them with the whole folder)."""
    from mlperf_grpo.checkpoint import remove_checkpoints

    root = tmp_path / "checkpoints"
    for name in ("step_18", "step_19", "tmp_step_20", "eval"):
        (root / name).mkdir(parents=True)
        (root / name / "x").write_text(name)
    (root / "training_end.json").write_text("{}")
    (root / "notes.txt").write_text("the user's")
    remove_checkpoints(root)
    assert sorted(p.name for p in root.iterdir()) == ["eval", "notes.txt"]
    assert (root / "eval" / "x").read_text() == "eval"
    (root / "notes.txt").unlink()
    (root / "eval" / "x").unlink()
    (root / "eval").rmdir()
    (root / "step_21").mkdir()
    remove_checkpoints(root)  # nothing but checkpoints: the folder goes too
    assert not root.exists()
