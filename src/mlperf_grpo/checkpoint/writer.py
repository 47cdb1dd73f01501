"""Asynchronous deferred checkpoints: stage on the training path, write in the background.

On the training path (:meth:`AsyncCheckpointer.save`), right after the weight update:

1. take a free slot of the host staging pool (at most ``max_in_flight`` checkpoints exist
   at once; when all are taken, training waits: back-pressure, bounded memory);
2. copy the rollout-dtype weights this rank owns (all of them on one rank; see
   :mod:`~mlperf_grpo.checkpoint.shard_plan`) into the slot's reused host buffers
   (:mod:`~mlperf_grpo.checkpoint.staging`: pinned, with ``non_blocking`` device-to-host
   copies on their own CUDA stream, overlapping what ``info`` computes on the compute
   stream, and one sync; a memcpy on CPU), so training may change the weights as soon
   as ``save`` returns. Nothing else runs on the clock.

In the background, one writer thread per checkpoint in flight, on every rank:

3. write this rank's shard files into ``tmp_step_N/`` in parallel (transformers' sharded
   safetensors format). The slot holds each shard's exact file image at an aligned
   address (header included), so a shard is written with O_DIRECT straight from it
   (:mod:`~mlperf_grpo.checkpoint.direct_io`; buffered where O_DIRECT is refused) and
   hashed with xxh3_128 from the same memory at the same time, while other threads
   compute the fingerprint checksums of the rank's tensors from the same host copy
   (:func:`~mlperf_grpo.checkpoint.staging.staged_checksums`); then the
   slot is free again; fsync the shards. A rank other than 0 then sends rank 0 its report
   (files, hashes, sizes, checksums; or its error) through the job's store
   (:mod:`~mlperf_grpo.checkpoint.rank_group`) and is done with the step;
4. rank 0 waits for every rank's report (a rank that stops beating fails the step), writes
   the index, the non-weight files (snapshotted when training started),
   ``training_info.json`` (every rank's hashes; the fingerprint digest of all ranks'
   checksums, the same as one rank computes over all tensors), fsyncs the directory,
5. waits until ``step_{N-1}`` is published, calls ``before_publish`` (the trainer makes its
   MLPerf log durable there), then renames to ``step_N/`` (so ``N+1`` is never published
   before ``N``, nothing is published past a checkpoint that failed, and nothing before
   every rank's files are on disk).

This is the scheme of torchtitan's async checkpoint mode and ``torch.distributed.
checkpoint.async_save`` (stage into pinned memory, write in a background thread), kept
here as plain threads because the on-disk format is transformers' own, not DCP's.
``finish`` waits for every write and rank 0 records the last published step
(``training_end.json``). A SIGKILL of any rank at any moment leaves only complete
``step_N/`` directories (and possibly ``tmp_step_*`` that are never read).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from mlperf_grpo.checkpoint.direct_io import write_file_image
from mlperf_grpo.checkpoint.format import (
    END_FILE,
    HASH_ALGORITHM,
    INDEX_FILE,
    INFO_FILE,
    NON_WEIGHT_FILES,
    SAFETENSORS_DTYPES,
    CheckpointWriteError,
    TrainingEnd,
    TrainingInfo,
    default_max_shard_size,
    fsync_path,
    hash_bytes,
    new_hasher,
    tensor_specs_digest,
    write_file_synced,
)
from mlperf_grpo.checkpoint.rank_group import Heartbeat, RankGroup, RankReportError
from mlperf_grpo.checkpoint.shard_plan import ShardPlan, layout_of, plan_shards, spec_of
from mlperf_grpo.checkpoint.staging import StagingSlot, Weights, as_planned, fill_slot, staged_checksums, unique_tensors
from mlperf_grpo.model.fingerprint import DEVICE_FINGERPRINT_ALGORITHM, fingerprint_digest
from mlperf_grpo.step_dirs import step_dir_name, tmp_step_dir_name

__all__ = ["AsyncCheckpointer", "CheckpointTiming", "Weights", "unique_tensors", "write_checkpoint"]

SHARD_WRITERS = 4
"""Threads writing the shards of one checkpoint in parallel."""

CHECKSUM_THREADS = 1
"""Threads computing the fingerprint checksums of the staged copies (numpy, the interpreter
lock released), beside the writes. One keeps up with the disk and leaves the training step
alone: on one H200 (1.4B, a checkpoint every step, ``benchmarks/checkpoint.py``) 4 threads
made the steps 1.21x longer, 1 thread 1.02x, none 0.99x (docs/running.md, Outputs)."""


@dataclass(frozen=True)
class CheckpointTiming:
    """What one checkpoint cost. ``critical_path_s``: time :meth:`AsyncCheckpointer.save`
    held the training loop (of which ``wait_s`` waiting for a free staging slot);
    ``publish_s``: weight-update time to ``step_N/`` visible (``None``: not published)."""

    step: int
    critical_path_s: float
    wait_s: float
    publish_s: float | None = None


def snapshot_model_files(model_dir: Path) -> dict[str, bytes]:
    """The bytes of the model directory's :data:`NON_WEIGHT_FILES` that exist."""
    return {name: (model_dir / name).read_bytes() for name in NON_WEIGHT_FILES if (model_dir / name).is_file()}


def files_record(files: dict[str, bytes]) -> dict[str, dict]:
    """``training_info.json``'s ``files``: name -> ``{"hash", "bytes"}``."""
    return {name: {"hash": hash_bytes(data), "bytes": len(data)} for name, data in sorted(files.items())}


def combined_fingerprint(plan: ShardPlan, checksums: dict[str, list[int]]) -> dict:
    """``training_info.json``'s ``weights.fingerprint``, ``{"algorithm":
    DEVICE_FINGERPRINT_ALGORITHM, "digest": hex}``, from every rank's per-tensor checksums:
    :func:`~mlperf_grpo.model.fingerprint.fingerprint_digest` over all the plan's tensors, so
    it equals :func:`~mlperf_grpo.model.fingerprint.weights_fingerprint` of the whole
    checkpoint on one rank, which is what the evaluator computes from the engine's tensors.

    Raises:
        KeyError: a tensor of the plan has no checksums.
    """
    values = torch.tensor([checksums[name] for name in sorted(plan.specs)], dtype=torch.int64).view(-1, 2)
    return {"algorithm": DEVICE_FINGERPRINT_ALGORITHM, "digest": fingerprint_digest(plan.specs, values)}


class AsyncCheckpointer:
    """Deferred checkpoints written in the background (see the module docstring).

    Args:
        checkpoint_root: ``<run>/checkpoints``; created on the first write.
        model_dir: the local model directory; its non-weight files are read now (training
            start) and copied into every checkpoint.
        max_in_flight: K, checkpoints staged but not yet written (each holds one host copy
            of the rollout-dtype weights this rank owns: host memory is K x about
            ``1 / world_size`` of the weights' bytes, :attr:`staged_bytes`).
        max_shard_size: bytes (or ``"5GB"``) per shard; default: transformers' own.
        before_publish: called in rank 0's writer thread right before each ``step_N/`` is
            renamed into place; an exception from it fails that checkpoint like an I/O error.
        group: the ranks writing this series (:meth:`RankGroup.of_process_group` under
            torchrun; every rank builds its checkpointer and calls ``prepare``, ``save``
            and ``finish`` at the same steps); default: one rank.
    """

    def __init__(
        self, checkpoint_root: Path, model_dir: Path, max_in_flight: int = 2, max_shard_size: int | str | None = None,
        before_publish: Callable[[], None] | None = None, group: RankGroup | None = None,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.root = checkpoint_root
        self.max_in_flight = max_in_flight
        self.max_shard_size = default_max_shard_size() if max_shard_size is None else max_shard_size
        self.group = group or RankGroup()
        self.model_files = snapshot_model_files(model_dir)
        self.files = files_record(self.model_files)
        self.before_publish = before_publish
        self.timings: dict[int, CheckpointTiming] = {}
        self.published_steps: list[int] = []
        """Steps published so far (rank 0's record: the other ranks publish nothing)."""
        self.plan: ShardPlan | None = None
        self._pin = False
        self._slots = [StagingSlot() for _ in range(max_in_flight)]
        self._free: queue.Queue[StagingSlot] = queue.Queue()
        for slot in self._slots:
            self._free.put(slot)
        self._jobs = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="checkpoint-writer")
        self._shards = ThreadPoolExecutor(max_workers=SHARD_WRITERS, thread_name_prefix="checkpoint-shard")
        self._fingerprints = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="checkpoint-fingerprint")
        self._checksums = ThreadPoolExecutor(max_workers=CHECKSUM_THREADS, thread_name_prefix="checkpoint-checksum")
        self._futures: list[Future] = []
        self._error: CheckpointWriteError | None = None
        self._lock = threading.Lock()
        self._finished = False
        self._heartbeat = Heartbeat(self.group) if self.group.rank != 0 else None

    @property
    def staged_bytes(self) -> int:
        """Bytes of this rank's host staging buffers (all ``max_in_flight`` slots, headers
        and alignment padding included), measured from the buffers themselves."""
        return sum(slot.flat.numel() for slot in self._slots if slot.flat is not None)

    # ------------------------------------------------------------------ training path

    def save(self, weights: Weights, info: TrainingInfo | Callable[[], TrainingInfo]) -> CheckpointTiming:
        """Stage this rank's share of ``weights`` (rollout dtype, any device; see
        :data:`Weights`) and queue ``step_N/`` for writing.

        ``info`` may be a function: it is called while the device-to-host copies run (on
        CUDA they run on their own stream), so work it does on the device, such as the
        canary logits, overlaps the copies instead of adding to them.
        Returns when the weights are copied: the caller may change them right away.
        Raises:
            CheckpointWriteError: an earlier background write failed (nothing more is
                published; the run is evaluable up to the last published checkpoint).
            ValueError: ``weights`` are pairs that differ from those given to
                :meth:`prepare` (pairs are checked as they come, so prepare first).
        """
        start = time.perf_counter()
        self.raise_if_failed()
        slot = self._free.get()  # back-pressure: at most max_in_flight staged copies
        waited = time.perf_counter()
        try:
            info = self._stage(weights, slot, info)
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

    def prepare(self, weights: Weights) -> None:
        """Plan the shards and allocate every staging slot for these weights now (call
        before ``run_start``: allocating pinned memory is slow and belongs off the clock).
        Pairs (:data:`Weights`) are iterated to the end, keeping only names, dtypes and
        shapes: :meth:`save` needs this first for pairs."""
        if isinstance(weights, Mapping):
            self._plan_for(unique_tensors(weights))
        else:
            specs, pin = {}, False
            for name, t in weights:
                specs[name], pin = spec_of(t), pin or t.is_cuda
            self._pin = pin
            self.plan = plan_shards(specs.items(), self.group.world_size, self.max_shard_size)
        slots = [self._free.get() for _ in range(self.max_in_flight)]
        try:
            for slot in slots:
                if slot.layout != self.plan.layout:
                    slot.build(self.plan, self.group.rank, self._pin)
        finally:
            for slot in slots:
                self._free.put(slot)

    def raise_if_failed(self) -> None:
        """Raise the first background write error, if any (call at step boundaries)."""
        if self._error is not None:
            raise self._error

    def finish(self, reason: str = "finished", raise_error: bool = True, record_end: bool = True) -> None:
        """Wait for every queued checkpoint to be published (or discarded after a failure),
        stop the writer threads and, on rank 0, write ``training_end.json``. Idempotent.

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
            self._checksums.shutdown(wait=True)
            if self._heartbeat is not None:  # a rank other than 0: its reports are all sent
                self._send_end()
                self._heartbeat.stop()
            if record_end and self.group.rank == 0 and (self.root.is_dir() or self._futures):
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

    def _plan_for(self, unique: dict[str, torch.Tensor]) -> None:
        """Keep the plan when ``unique``'s layout is the planned one, else plan again."""
        if self.plan is None or self.plan.layout != layout_of(unique.items(), self.group.world_size):
            self._pin = any(t.is_cuda for t in unique.values())
            self.plan = plan_shards(unique.items(), self.group.world_size, self.max_shard_size)

    def _stage(self, weights: Weights, slot: StagingSlot, info: TrainingInfo | Callable[[], TrainingInfo]) -> TrainingInfo:
        """Fill ``slot`` from ``weights`` (planned again, and the slot rebuilt, when their
        layout changed) and return ``info`` (:func:`~mlperf_grpo.checkpoint.staging.fill_slot`)."""
        persistent = isinstance(weights, Mapping)
        if persistent:
            unique = unique_tensors(weights)
            self._plan_for(unique)
            pairs = unique.items()
        elif self.plan is None:
            raise ValueError("save() of (name, tensor) pairs needs prepare() with the same pairs first")
        else:
            pairs = as_planned(weights, self.plan)
        if slot.layout != self.plan.layout:
            slot.build(self.plan, self.group.rank, self._pin)
        return fill_slot(slot, pairs, persistent, info)

    # ------------------------------------------------------------------ background

    def _write(self, info: TrainingInfo, slot: StagingSlot, previous: Future | None) -> int:
        step, plan, rank = info.current_step, slot.plan, self.group.rank
        tmp = self.root / tmp_step_dir_name(step)
        try:
            tmp.mkdir(parents=True, exist_ok=True)  # every rank writes its own files into it
            checksums = self._fingerprints.submit(staged_checksums, slot, self._checksums)  # beside the writes
            try:
                shards, files = self._write_shards(tmp, slot)
            finally:
                wait([checksums])
                self._free.put(slot)  # the buffers are no longer read
            checksums = checksums.result()
            self._sync_shards(files)
        except BaseException as err:
            error = self._write_error(tmp, plan, err)
            if rank != 0:
                self._send_report(step, {"error": str(error)})
            else:
                shutil.rmtree(tmp, ignore_errors=True)
            self._fail(error)
            raise
        if rank != 0:  # rank 0 publishes once every rank's files are on disk
            self._send_report(step, {"shards": shards, "checksums": checksums})
            return step
        try:
            for other in range(1, self.group.world_size):
                report = self.group.await_report(step, other)
                shards.update(report["shards"])
                checksums.update(report["checksums"])
            self._write_metadata(tmp, info, plan, shards, combined_fingerprint(plan, checksums))
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            self._fail(self._write_error(tmp, plan, err))
            raise
        if previous is not None and previous.exception() is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # never publish past a missing checkpoint
            raise CheckpointWriteError(f"{step_dir_name(step)} not published: an earlier checkpoint failed")
        try:
            if self.before_publish is not None:
                self.before_publish()
            final = self.root / step_dir_name(step)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            fsync_path(self.root)
        except BaseException as err:  # any: one that was not an OSError was lost, the run said "finished"
            self._fail(self._write_error(tmp, plan, err))
            raise
        with self._lock:
            self.published_steps.append(step)
            timing = self.timings.get(step)
            if timing is not None:
                self.timings[step] = replace(timing, publish_s=time.time() - info.training_step_end_time_ms / 1000)
        return step

    def _send_report(self, step: int, report: dict) -> None:
        try:
            self.group.send_report(step, report)
        except dist.DistError as err:  # the store is gone: rank 0 sees this rank stall instead
            self._fail(CheckpointWriteError(f"cannot report {step_dir_name(step)} to rank 0: {err}"))

    def _send_end(self) -> None:
        try:
            self.group.send_end(step_dir_name(max(self.timings)) if self.timings else "none")
        except dist.DistError:  # the store is gone: rank 0 sees this rank stall instead
            pass

    def _write_shards(self, tmp: Path, slot: StagingSlot) -> tuple[dict[str, dict], list]:
        """Write this rank's shards in parallel (no fsync yet); returns the per-shard
        records (file name -> ``{"hash", "bytes"}``) and the open files."""
        written = list(self._shards.map(lambda a: self._write_shard(tmp / a[0], a[1], slot), zip(slot.files, slot.shards)))
        records = {name: record for name, (_, record) in zip(slot.files, written)}
        return records, [f for f, _ in written]

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

    def _write_metadata(self, tmp: Path, info: TrainingInfo, plan: ShardPlan, shards: dict[str, dict],
                        fingerprint: dict) -> None:
        index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": plan.weight_map()}
        write_file_synced(tmp / INDEX_FILE, (json.dumps(index, indent=2) + "\n").encode())
        for name, data in self.model_files.items():
            write_file_synced(tmp / name, data)
        specs = {n: (SAFETENSORS_DTYPES[t.dtype], list(t.shape)) for n, t in plan.specs.items()}
        weights = {"hash_algorithm": HASH_ALGORITHM, "shards": dict(sorted(shards.items())),
                   "tensors": tensor_specs_digest(specs), "fingerprint": fingerprint}
        record = replace(info, weights=weights, files=self.files)
        write_file_synced(tmp / INFO_FILE, record.to_json().encode())
        _remove_other_than(tmp, {*shards, INDEX_FILE, INFO_FILE, *self.model_files})
        fsync_path(tmp)

    def _fail(self, error: CheckpointWriteError) -> None:
        with self._lock:
            if self._error is None:
                self._error = error

    def _write_error(self, tmp: Path, plan: ShardPlan, err: BaseException) -> CheckpointWriteError:
        own = isinstance(err, (RankReportError, CheckpointWriteError))
        if own or not isinstance(err, OSError):  # ours, or not the disk's (the job's store lost: its launcher killed)
            return CheckpointWriteError(f"cannot write checkpoint {tmp}: {'' if own else type(err).__name__ + ': '}{err}")
        needed = plan.total_bytes + sum(len(d) for d in self.model_files.values())
        free = shutil.disk_usage(self.root).free if self.root.exists() else 0
        reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
        return CheckpointWriteError(
            f"cannot write checkpoint {tmp}: {reason}; it needs about {needed} bytes and {free} bytes are free"
        )


def _remove_other_than(directory: Path, keep: set[str]) -> None:
    """Remove whatever ``directory`` holds besides ``keep`` (left by an earlier attempt at
    the same step), so the published directory holds this checkpoint's files only."""
    for path in directory.iterdir():
        if path.name not in keep:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def write_checkpoint(checkpoint_root: Path, state_dict: dict[str, torch.Tensor], info: TrainingInfo, model_dir: Path,
                     max_shard_size: int | str | None = None) -> Path:
    """Write one ``step_N/`` and wait until it is published (tests, scripts).

    Raises:
        CheckpointWriteError: the write failed.
    """
    writer = AsyncCheckpointer(checkpoint_root, model_dir, max_in_flight=1, max_shard_size=max_shard_size)
    writer.save(state_dict, info)
    writer.finish(record_end=False)
    return checkpoint_root / step_dir_name(info.current_step)
