"""Shards written with O_DIRECT from the staged file images (and the buffered fallback)
read back bit-identical; the fingerprint computed from the staged host copy equals the
source tensors' own."""

import errno
import json
import os

import pytest
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mlperf_grpo.checkpoint import (
    AsyncCheckpointer,
    TrainingInfo,
    direct_io,
    discover_checkpoints,
    read_weights,
    staging,
    write_checkpoint,
)
from mlperf_grpo.checkpoint import writer as writer_module
from mlperf_grpo.checkpoint.staging import staged_checksums
from mlperf_grpo.checkpoint.writer import combined_fingerprint
from mlperf_grpo.model.files import BUILTIN_MODEL_DIR
from mlperf_grpo.model.fingerprint import weights_fingerprint
from mlperf_grpo.model.load import load_model


def _info(step, dtype="float32"):
    return TrainingInfo(step, step * 16, 1_000 + step, step * 256, 256, 16, dtype, [0.5] * 4)


def _direct_supported(directory) -> bool:
    """Whether ``directory``'s filesystem takes an aligned O_DIRECT write (probed)."""
    if not direct_io.O_DIRECT:
        return False
    path = directory / "probe"
    buffer = direct_io.aligned_empty(direct_io.ALIGNMENT_BYTES, pin=False)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | direct_io.O_DIRECT)
        try:
            os.pwrite(fd, memoryview(buffer.numpy()), 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        path.unlink(missing_ok=True)


@pytest.fixture(params=["direct", "fallback-at-open", "fallback-mid-write"])
def write_path(request, tmp_path, monkeypatch):
    """Which way shards are written; records (path, direct) of every shard write."""
    if request.param == "direct" and not _direct_supported(tmp_path):
        pytest.skip(f"{tmp_path}: the filesystem refuses O_DIRECT")
    if request.param == "fallback-at-open":  # e.g. a filesystem without O_DIRECT
        real_open = os.open

        def refusing_open(path, flags, *args):
            if flags & direct_io.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_open(path, flags, *args)

        monkeypatch.setattr(direct_io.os, "open", refusing_open)
    if request.param == "fallback-mid-write":  # refused after part of the file was written
        real_pwrite = os.pwrite
        calls = []

        def pwrite_refusing_the_second(fd, data, offset):
            calls.append(offset)
            if len(calls) >= 2:  # the first write of the first shard is taken
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_pwrite(fd, data, offset)

        monkeypatch.setattr(direct_io.os, "pwrite", pwrite_refusing_the_second)
        monkeypatch.setattr(direct_io, "CHUNK_BYTES", 64 << 10)  # several writes per shard
    written = []
    real_write = direct_io.write_file_image

    def recording_write(path, image, streams=direct_io.STREAMS):
        f, direct = real_write(path, image, streams)
        written.append((path.name, direct, image.numel()))
        return f, direct

    monkeypatch.setattr(writer_module, "write_file_image", recording_write)
    return request.param, written


def test_shards_written_directly_or_buffered_read_back_bit_identical_and_load(tmp_path, write_path):
    mode, written = write_path
    policy = load_model("builtin:arithmetic-tiny", "float32")
    with torch.no_grad():
        policy.model.embed_tokens.weight.add_(0.01)
        policy.model.norm.weight.copy_(torch.arange(policy.model.norm.weight.numel()) * 0.5)
    state = policy.state_dict()
    path = write_checkpoint(tmp_path / "checkpoints", state, _info(18), BUILTIN_MODEL_DIR, max_shard_size=150_000)
    large = [w for w in written if w[2] >= direct_io.ALIGNMENT_BYTES]
    assert len(written) > 1 and large
    assert all(direct == (mode == "direct") for _, direct, _ in large)
    info = json.loads((path / "training_info.json").read_text())
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    for shard, meta in info["weights"]["shards"].items():
        data = (path / shard).read_bytes()
        assert meta == {"hash": xxhash.xxh3_128_hexdigest(data), "bytes": len(data)}
        header_bytes = 8 + int.from_bytes(data[:8], "little")
        assert header_bytes % direct_io.ALIGNMENT_BYTES == 0  # the data starts aligned in the file
        loaded = load_file(path / shard)
        assert set(loaded) == {n for n, s in index.items() if s == shard}
        for name, tensor in loaded.items():
            assert tensor.dtype == state[name].dtype and torch.equal(tensor.view(torch.uint8), state[name].view(torch.uint8))
        with safe_open(path / shard, "pt") as f:
            assert f.metadata() == {"format": "pt"}
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    weights = read_weights(discover_checkpoints(tmp_path / "checkpoints")[0][0])  # our verified reader too
    assert all(torch.equal(weights[n], state[n]) for n in weights)


def test_file_image_of_any_length_is_written_exactly(tmp_path):
    torch.manual_seed(0)
    for nbytes in (1, direct_io.ALIGNMENT_BYTES - 1, direct_io.ALIGNMENT_BYTES, 3 * direct_io.ALIGNMENT_BYTES + 17):
        image = direct_io.aligned_empty(nbytes, pin=False)
        image.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
        path = tmp_path / f"image_{nbytes}"
        f, _ = direct_io.write_file_image(path, image, streams=3)
        os.fsync(f.fileno())
        f.close()
        assert path.read_bytes() == bytes(image.numpy())
    misaligned = direct_io.aligned_empty(2 * direct_io.ALIGNMENT_BYTES + 1, pin=False)[1:]
    misaligned.fill_(7)
    f, direct = direct_io.write_file_image(tmp_path / "misaligned", misaligned)
    f.close()
    assert not direct and (tmp_path / "misaligned").read_bytes() == b"\x07" * misaligned.numel()


def test_a_full_disk_during_a_direct_write_is_raised_not_hidden(tmp_path, monkeypatch):
    if not _direct_supported(tmp_path):
        pytest.skip(f"{tmp_path}: the filesystem refuses O_DIRECT")

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct_io.os, "pwrite", full)
    image = direct_io.aligned_empty(2 * direct_io.ALIGNMENT_BYTES, pin=False)
    with pytest.raises(OSError) as err:
        direct_io.write_file_image(tmp_path / "x", image)
    assert err.value.errno == errno.ENOSPC


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("range_elements", [None, 100])
def test_fingerprint_of_the_staged_host_copy_equals_the_source_tensors(dtype, device, range_elements, tmp_path,
                                                                       monkeypatch):
    if range_elements is not None:  # tensors split into runs summed by several threads
        monkeypatch.setattr(staging, "CHECKSUM_RANGE_ELEMENTS", range_elements)
    torch.manual_seed(0)
    # odd sizes put later tensors at addresses that are not multiples of 8 in the slot
    state = {
        "a.weight": (torch.randn(37, 29) * 1e3).to(dtype),
        "b.bias": torch.randn(3).to(dtype),
        "c.weight": torch.randn(128, 64).to(dtype),
        "d.scale": torch.tensor([1.5], dtype=dtype),
        "e.weight": torch.randn(5, 7).to(dtype),
    }
    state = {n: t.to(device) for n, t in state.items()}
    writer = AsyncCheckpointer(tmp_path, BUILTIN_MODEL_DIR)
    slot = writer._free.get()
    info = writer._stage(state, slot, _info(1))
    assert info.current_step == 1
    assert any(t.data_ptr() % 8 for t in slot.tensors.values())  # the padded path is taken
    assert all(t.device.type == "cpu" for t in slot.tensors.values())
    expected = weights_fingerprint(state)  # on the source tensors' device
    assert combined_fingerprint(writer.plan, staged_checksums(slot, writer._checksums))["digest"] == expected
    changed = dict(state, **{"c.weight": state["c.weight"].clone()})
    changed["c.weight"][7, 3] += 1
    assert weights_fingerprint(changed) != expected


def test_written_checkpoint_records_the_host_fingerprint_of_bfloat16_weights(tmp_path):
    policy = load_model("builtin:arithmetic-tiny", "bfloat16")
    state = {n: t for n, t in policy.state_dict().items() if n != "lm_head.weight"}
    path = write_checkpoint(tmp_path, policy.state_dict(), _info(18, "bfloat16"), BUILTIN_MODEL_DIR)
    recorded = json.loads((path / "training_info.json").read_text())["weights"]["fingerprint"]
    assert recorded["digest"] == weights_fingerprint(state)
