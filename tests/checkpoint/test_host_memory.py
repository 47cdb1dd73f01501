"""Page-locked host buffers (checkpoint/host_memory.py): exact size and alignment, one
registration per buffer, undone exactly when the last view of the memory goes. The CUDA
runtime is replaced by a recorder (the CPU machine has none); the H200 figures are in
the module docstring."""

from __future__ import annotations

import gc

import pytest
import torch

from mlperf_grpo.checkpoint import host_memory
from mlperf_grpo.checkpoint.direct_io import ALIGNMENT_BYTES, aligned_empty
from mlperf_grpo.checkpoint.reader import ReadBuffers


class RecordingCudart:
    """Stands in for ``torch.cuda.cudart()``: records (un)registrations."""

    def __init__(self, fail: bool = False) -> None:
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.fail = fail

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        if self.fail:
            return 712  # cudaErrorHostMemoryAlreadyRegistered
        assert address not in self.registered and flags == 0
        self.registered[address] = size
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        assert address in self.registered and address not in self.unregistered
        self.unregistered.append(address)
        return 0

    def cudaGetErrorString(self, error: int) -> str:
        return f"error {error}"


@pytest.fixture
def cudart(monkeypatch):
    recorder = RecordingCudart()
    monkeypatch.setattr(host_memory.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(host_memory.torch.cuda, "cudart", lambda: recorder)
    return recorder


def test_buffer_is_registered_once_and_unregistered_when_its_last_view_goes(cudart):
    buffer = host_memory.page_locked_empty(10_000, alignment_bytes=ALIGNMENT_BYTES)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 10_000 and buffer.data_ptr() % ALIGNMENT_BYTES == 0
    [(address, size)] = cudart.registered.items()
    assert address <= buffer.data_ptr() and buffer.data_ptr() + 10_000 <= address + size  # the view lies inside
    view = buffer[100:200].view(torch.int32)
    view.fill_(7)
    del buffer
    gc.collect()
    assert cudart.unregistered == []  # a view still uses the memory
    assert view.tolist() == [7] * 25
    del view
    gc.collect()
    assert cudart.unregistered == [address]


def test_refused_registration_is_one_clear_error(monkeypatch):
    recorder = RecordingCudart(fail=True)
    monkeypatch.setattr(host_memory.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(host_memory.torch.cuda, "cudart", lambda: recorder)
    with pytest.raises(RuntimeError, match="cudaHostRegister of 4097 bytes of host memory failed: error 712"):
        host_memory.page_locked_empty(4096, alignment_bytes=1)


def test_without_cuda_it_refuses(monkeypatch):
    monkeypatch.setattr(host_memory.torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        host_memory.page_locked_empty(16)


def test_checkpoint_buffers_use_it_when_pinned(cudart):
    staging = aligned_empty(5000, pin=True)  # the writer's staging
    assert staging.numel() == 5000 and staging.data_ptr() % ALIGNMENT_BYTES == 0
    buffers = ReadBuffers(pin=True)  # the evaluator's read buffers
    shard = buffers.get("model-00001-of-00001.safetensors", 3000)
    assert shard.numel() == 3000
    assert sorted(cudart.registered.values()) == [3001, 5000 + ALIGNMENT_BYTES]
    unpinned = ReadBuffers(pin=False).get("x", 10)
    assert unpinned.numel() == 10 and len(cudart.registered) == 2
