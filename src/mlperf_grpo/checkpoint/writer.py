"""Asynchronous deferred checkpoints: stage on the training path, write in the background.

On the training path (:meth:`AsyncCheckpointer.save`), right after the weight update:

1. take a free slot of the host staging pool (at most ``max_in_flight`` checkpoints exist
   at once; when all are taken, training waits: back-pressure, bounded memory);
2. copy the rollout-dtype weights into the slot's reused host buffers (pinned, with
   ``non_blocking`` device-to-host copies on their own CUDA stream, overlapping what
   ``info`` computes on the compute stream, and one sync; a memcpy on CPU), so training
   may change the weights as soon as ``save`` returns. Nothing else runs on the clock.

In the background, one writer thread per checkpoint in flight:

3. write ``tmp_step_N/``: the weight shards in parallel (transformers' sharded
   safetensors format). The slot holds each shard's exact file image at an aligned
   address (header included), so a shard is written with O_DIRECT straight from it
   (:mod:`~mlperf_grpo.checkpoint.direct_io`; buffered where O_DIRECT is refused) and
   hashed with xxh3_128 from the same memory at the same time, while another thread
   computes the weights' fingerprint (:mod:`mlperf_grpo.fingerprint`) from the same host
   copy; then the slot is free again; fsync the shards, write the index, the non-weight
   files (snapshotted when training started), ``training_info.json``; fsync the directory;
4. wait until ``step_{N-1}`` is published, call ``before_publish`` (the trainer makes its
   MLPerf log durable there), then rename to ``step_N/`` (so ``N+1`` is never
   published before ``N``, and nothing is published past a checkpoint that failed).

This is the scheme of torchtitan's async checkpoint mode and ``torch.distributed.
checkpoint.async_save`` (stage into pinned memory, write in a background thread), kept
here as plain threads because the on-disk format is transformers' own, not DCP's.
``finish`` waits for every write and records the last published step
(``training_end.json``). A SIGKILL at any moment leaves only complete ``step_N/``
directories (and possibly ``tmp_step_*`` that are never read).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from huggingface_hub import split_torch_state_dict_into_shards

from mlperf_grpo.checkpoint.direct_io import ALIGNMENT_BYTES, aligned_empty, write_file_image
from mlperf_grpo.checkpoint.format import (
    END_FILE,
    HASH_ALGORITHM,
    INDEX_FILE,
    INFO_FILE,
    NON_WEIGHT_FILES,
    CheckpointWriteError,
    TrainingEnd,
    TrainingInfo,
    default_max_shard_size,
    fsync_path,
    hash_bytes,
    new_hasher,
    safetensors_header,
    shard_name,
    tensor_specs_digest,
    write_file_synced,
    SAFETENSORS_DTYPES,
)
from mlperf_grpo.fingerprint import DEVICE_FINGERPRINT_ALGORITHM, weights_fingerprint

SHARD_WRITERS = 4
"""Threads writing the shards of one checkpoint in parallel."""


@dataclass(frozen=True)
class CheckpointTiming:
    """What one checkpoint cost. ``critical_path_s``: time :meth:`AsyncCheckpointer.save`
    held the training loop (of which ``wait_s`` waiting for a free staging slot);
    ``publish_s``: weight-update time to ``step_N/`` visible (``None``: not published)."""

    step: int
    critical_path_s: float
    wait_s: float
    publish_s: float | None = None


@dataclass
class StagingSlot:
    """One host copy of the weights, laid out as the shard files' exact bytes: one flat
    byte buffer (pinned when the weights are on CUDA) holding shard after shard, each
    starting at a multiple of :data:`~mlperf_grpo.checkpoint.direct_io.ALIGNMENT_BYTES`
    with its safetensors header (spaces pad it so the data starts aligned too) followed
    by its tensors back to back, exactly as in the file. So a shard is written with
    O_DIRECT and hashed as one contiguous aligned range. The headers depend only on the
    tensors' names, dtypes and shapes: written once, when the slot is built. Reused from
    checkpoint to checkpoint; rebuilt only if the tensors' layout changes."""

    layout: tuple = ()
    flat: torch.Tensor | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """name -> view into ``flat`` with the tensor's dtype and shape."""
    shards: list[tuple[list[str], int, int]] = field(default_factory=list)
    """(tensor names in file order, start byte, end byte of the file image) per shard."""

    def build(self, unique: dict[str, torch.Tensor], max_shard_size: int | str) -> None:
        split = split_torch_state_dict_into_shards(unique, max_shard_size=max_shard_size)
        # largest element size first keeps every view aligned (safetensors orders so too)
        groups = [sorted(group, key=lambda n: -unique[n].element_size()) for group in split.filename_to_tensors.values()]
        headers = [safetensors_header([(n, unique[n]) for n in names], {"format": "pt"}, ALIGNMENT_BYTES) for names in groups]
        offsets, self.shards, offset = {}, [], 0
        for names, header in zip(groups, headers):
            start = offset
            offset += len(header)
            for n in names:
                offsets[n] = offset
                offset += unique[n].numel() * unique[n].element_size()
            self.shards.append((names, start, offset))
            offset = -(-offset // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
        self.flat = aligned_empty(offset, pin=any(t.is_cuda for t in unique.values()))
        for header, (_, start, _) in zip(headers, self.shards):
            self.flat[start: start + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        self.tensors = {
            n: self.flat[offsets[n]: offsets[n] + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for n, t in unique.items()
        }
        self.layout = _layout(unique)


def _layout(unique: dict[str, torch.Tensor]) -> tuple:
    return tuple((n, t.dtype, tuple(t.shape)) for n, t in unique.items())


def snapshot_model_files(model_dir: Path) -> dict[str, bytes]:
    """The bytes of the model directory's :data:`NON_WEIGHT_FILES` that exist."""
    return {name: (model_dir / name).read_bytes() for name in NON_WEIGHT_FILES if (model_dir / name).is_file()}


def files_record(files: dict[str, bytes]) -> dict[str, dict]:
    """``training_info.json``'s ``files``: name -> ``{"hash", "bytes"}``."""
    return {name: {"hash": hash_bytes(data), "bytes": len(data)} for name, data in sorted(files.items())}


def unique_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop names that are the same tensor as an earlier name (tied embeddings, e.g.
    ``lm_head.weight``), as ``save_pretrained`` stores them: once, under the first name;
    ``from_pretrained`` re-ties them.

    Two names are tied when they view the same bytes the same way: one storage (its
    device and address), the same offset, shape, stride and dtype. An empty tensor
    (``numel() == 0``) is never tied: every empty storage has address 0, so the address
    says nothing about it (safetensors/safetensors#280), and each is kept under its name.
    """
    seen: set[tuple] = set()
    out = {}
    for name, tensor in state_dict.items():
        if tensor.numel() > 0:
            key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                   tensor.stride(), tensor.dtype)
            if key in seen:
                continue
            seen.add(key)
        out[name] = tensor.detach()
    return out


def staged_fingerprint(slot: StagingSlot) -> dict:
    """``training_info.json``'s ``weights.fingerprint`` of a filled slot: ``{"algorithm":
    DEVICE_FINGERPRINT_ALGORITHM, "digest": hex}``, computed on the CPU from the staged
    host copy (in the writer, off the training path). The algorithm's sums modulo 2**64 do
    not depend on the order of additions, so this equals
    :func:`~mlperf_grpo.fingerprint.weights_fingerprint` of the source tensors on their
    device, which is what the evaluator computes from the engine's tensors."""
    return {"algorithm": DEVICE_FINGERPRINT_ALGORITHM, "digest": weights_fingerprint(slot.tensors)}


class AsyncCheckpointer:
    """Deferred checkpoints written in the background (see the module docstring).

    Args:
        checkpoint_root: ``<run>/checkpoints``; created on the first write.
        model_dir: the local model directory; its non-weight files are read now (training
            start) and copied into every checkpoint.
        max_in_flight: K, checkpoints staged but not yet written (each holds one host copy
            of the rollout-dtype weights: host memory is K x the weights' bytes).
        max_shard_size: bytes (or ``"5GB"``) per shard; default: transformers' own.
        before_publish: called in the writer thread right before each ``step_N/`` is
            renamed into place; an exception from it fails that checkpoint like an I/O error.
    """

    def __init__(
        self, checkpoint_root: Path, model_dir: Path, max_in_flight: int = 2, max_shard_size: int | str | None = None,
        before_publish: Callable[[], None] | None = None,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.root = checkpoint_root
        self.max_in_flight = max_in_flight
        self.max_shard_size = default_max_shard_size() if max_shard_size is None else max_shard_size
        self.model_files = snapshot_model_files(model_dir)
        self.files = files_record(self.model_files)
        self.before_publish = before_publish
        self.timings: dict[int, CheckpointTiming] = {}
        self.published_steps: list[int] = []
        self._free: queue.Queue[StagingSlot] = queue.Queue()
        for _ in range(max_in_flight):
            self._free.put(StagingSlot())
        self._jobs = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="checkpoint-writer")
        self._shards = ThreadPoolExecutor(max_workers=SHARD_WRITERS, thread_name_prefix="checkpoint-shard")
        self._fingerprints = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="checkpoint-fingerprint")
        self._futures: list[Future] = []
        self._error: CheckpointWriteError | None = None
        self._lock = threading.Lock()
        self._finished = False

    # ------------------------------------------------------------------ training path

    def save(self, state_dict: dict[str, torch.Tensor], info: TrainingInfo | Callable[[], TrainingInfo]) -> CheckpointTiming:
        """Stage ``state_dict`` (rollout dtype, any device) and queue ``step_N/`` for writing.

        ``info`` may be a function: it is called while the device-to-host copies run (on
        CUDA they run on their own stream), so work it does on the device, such as the
        canary logits, overlaps the copies instead of adding to them.
        Returns when the weights are copied: the caller may change them right away.
        Raises:
            CheckpointWriteError: an earlier background write failed (nothing more is
                published; the run is evaluable up to the last published checkpoint).
        """
        start = time.perf_counter()
        self.raise_if_failed()
        slot = self._free.get()  # back-pressure: at most max_in_flight staged copies
        waited = time.perf_counter()
        try:
            info = self._stage(state_dict, slot, self.max_shard_size, info)
        except BaseException:
            slot.layout = ()  # partly copied: rebuilt and refilled on next use
            self._free.put(slot)
            raise
        previous = self._futures[-1] if self._futures else None
        future = self._jobs.submit(self._write, info, slot, previous)
        self._futures.append(future)
        timing = CheckpointTiming(info.current_step, time.perf_counter() - start, waited - start)
        self.timings[info.current_step] = timing
        return timing

    def prepare(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Allocate every staging slot for these weights now (call before ``run_start``:
        allocating pinned memory is slow and belongs off the clock)."""
        unique = unique_tensors(state_dict)
        slots = [self._free.get() for _ in range(self.max_in_flight)]
        try:
            for slot in slots:
                if slot.layout != _layout(unique):
                    slot.build(unique, self.max_shard_size)
        finally:
            for slot in slots:
                self._free.put(slot)

    def raise_if_failed(self) -> None:
        """Raise the first background write error, if any (call at step boundaries)."""
        if self._error is not None:
            raise self._error

    def finish(self, reason: str = "finished", raise_error: bool = True, record_end: bool = True) -> None:
        """Wait for every queued checkpoint to be published (or discarded after a failure),
        stop the writer threads and write ``training_end.json``. Idempotent.

        Raises:
            CheckpointWriteError: a background write failed (when ``raise_error``).
        """
        for future in self._futures:
            future.exception()  # waits; errors are kept in self._error
        if not self._finished:
            self._finished = True
            self._jobs.shutdown(wait=True)
            self._shards.shutdown(wait=True)
            self._fingerprints.shutdown(wait=True)
            if record_end and (self.root.is_dir() or self._futures):
                self.root.mkdir(parents=True, exist_ok=True)
                last = self.published_steps[-1] if self.published_steps else None
                end = TrainingEnd(last, self.max_in_flight, reason if self._error is None else "write_failed")
                try:
                    write_file_synced(self.root / END_FILE, end.to_json().encode())
                    fsync_path(self.root)
                except OSError:  # e.g. the disk is full: the evaluator then applies the hard-kill rule
                    (self.root / END_FILE).unlink(missing_ok=True)
        if raise_error:
            self.raise_if_failed()

    @staticmethod
    def _stage(
        state_dict: dict[str, torch.Tensor], slot: StagingSlot, max_shard_size: int | str,
        info: TrainingInfo | Callable[[], TrainingInfo],
    ) -> TrainingInfo:
        unique = unique_tensors(state_dict)
        if slot.layout != _layout(unique):
            slot.build(unique, max_shard_size)
        if not slot.flat.is_pinned():  # CPU: a memcpy
            for name, src in unique.items():
                slot.tensors[name].copy_(src)
            return info() if callable(info) else info
        copies = torch.cuda.Stream()
        copies.wait_stream(torch.cuda.current_stream())  # the weights as the optimizer left them
        with torch.cuda.stream(copies):
            for name, src in unique.items():
                slot.tensors[name].copy_(src, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(copies)
        # on the compute stream, overlapping the copies (which only the copy engine does):
        # whatever ``info`` computes (the canary logits)
        info = info() if callable(info) else info
        computed = torch.cuda.Event()
        computed.record()
        copied.synchronize()  # one sync for all copies, before training changes the weights
        computed.synchronize()
        return info

    # ------------------------------------------------------------------ background

    def _write(self, info: TrainingInfo, slot: StagingSlot, previous: Future | None) -> int:
        step = info.current_step
        staged = slot.tensors
        tmp = self.root / f"tmp_step_{step}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            fingerprint = self._fingerprints.submit(staged_fingerprint, slot)  # beside the writes
            try:
                shards, weight_map, files = self._write_shards(tmp, slot)
            finally:
                wait([fingerprint])
                self._free.put(slot)  # the buffers are no longer read
            fingerprint = fingerprint.result()
            self._sync_shards(files)
            self._write_metadata(tmp, info, staged, shards, weight_map, fingerprint)
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            self._fail(self._write_error(tmp, staged, err))
            raise
        if previous is not None and previous.exception() is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # never publish past a missing checkpoint
            raise CheckpointWriteError(f"step_{step} not published: an earlier checkpoint failed")
        try:
            if self.before_publish is not None:
                self.before_publish()
            final = self.root / f"step_{step}"
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            fsync_path(self.root)
        except OSError as err:
            self._fail(self._write_error(tmp, staged, err))
            raise
        with self._lock:
            self.published_steps.append(step)
            timing = self.timings.get(step)
            if timing is not None:
                self.timings[step] = replace(timing, publish_s=time.time() - info.training_step_end_time_ms / 1000)
        return step

    def _write_shards(self, tmp: Path, slot: StagingSlot) -> tuple[dict[str, dict], dict[str, str], list]:
        """Write the shards in parallel (no fsync yet); returns the per-shard records, the
        index's ``weight_map`` (tensor name -> shard file) and the open files."""
        count = len(slot.shards)
        names = [shard_name(i + 1, count) for i in range(count)]
        written = list(self._shards.map(lambda a: self._write_shard(tmp / a[0], a[1], slot), zip(names, slot.shards)))
        records = {name: record for name, (_, record) in zip(names, written)}
        weight_map = {t: name for name, (group, _, _) in zip(names, slot.shards) for t in group}
        return records, weight_map, [f for f, _ in written]

    def _sync_shards(self, files: list) -> None:
        def sync(f) -> None:
            try:
                os.fsync(f.fileno())
            finally:
                f.close()

        list(self._shards.map(sync, files))

    @staticmethod
    def _write_shard(path: Path, shard: tuple[list[str], int, int], slot: StagingSlot):
        """Write one shard's file image from the slot (O_DIRECT where allowed), hashing the
        same memory at the same time (both release the interpreter lock); returns the open
        file (not yet fsynced) and the shard's ``{"hash", "bytes"}``."""
        _, start, end = shard
        image = slot.flat[start:end]
        digest = new_hasher()
        hasher = threading.Thread(target=digest.update, args=(memoryview(image.numpy()),), name="checkpoint-hash")
        hasher.start()
        try:
            f, _ = write_file_image(path, image)
        finally:
            hasher.join()
        return f, {"hash": digest.hexdigest(), "bytes": end - start}

    def _write_metadata(self, tmp: Path, info: TrainingInfo, staged: dict, shards: dict[str, dict], weight_map: dict[str, str],
                        fingerprint: dict) -> None:
        total = sum(t.numel() * t.element_size() for t in staged.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        write_file_synced(tmp / INDEX_FILE, (json.dumps(index, indent=2) + "\n").encode())
        for name, data in self.model_files.items():
            write_file_synced(tmp / name, data)
        specs = {n: (SAFETENSORS_DTYPES[t.dtype], list(t.shape)) for n, t in staged.items()}
        weights = {"hash_algorithm": HASH_ALGORITHM, "shards": shards, "tensors": tensor_specs_digest(specs),
                   "fingerprint": fingerprint}
        record = replace(info, weights=weights, files=self.files)
        write_file_synced(tmp / INFO_FILE, record.to_json().encode())
        fsync_path(tmp)

    def _fail(self, error: CheckpointWriteError) -> None:
        with self._lock:
            if self._error is None:
                self._error = error

    def _write_error(self, tmp: Path, staged: dict, err: BaseException) -> CheckpointWriteError:
        needed = sum(t.numel() * t.element_size() for t in staged.values()) + sum(len(d) for d in self.model_files.values())
        free = shutil.disk_usage(self.root).free if self.root.exists() else 0
        reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
        return CheckpointWriteError(
            f"cannot write checkpoint {tmp}: {reason}; it needs about {needed} bytes and {free} bytes are free"
        )


def write_checkpoint(checkpoint_root: Path, state_dict: dict[str, torch.Tensor], info: TrainingInfo, model_dir: Path,
                     max_shard_size: int | str | None = None) -> Path:
    """Write one ``step_N/`` and wait until it is published (tests, scripts).

    Raises:
        CheckpointWriteError: the write failed.
    """
    writer = AsyncCheckpointer(checkpoint_root, model_dir, max_in_flight=1, max_shard_size=max_shard_size)
    writer.save(state_dict, info)
    writer.finish(record_end=False)
    return checkpoint_root / f"step_{info.current_step}"
