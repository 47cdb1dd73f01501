"""The checkpoint series an evaluator works through: what it is, the checks made before
anything is evaluated, how a checkpoint is read, and how a refit is proven.

:class:`SeriesSource` is the interface (our trainer's :class:`RunSeries` here; other
trainers' layouts in ``evaluate/foreign_series.py``). :func:`check_series` reads records,
tensor headers and the small non-weight files, never the weights: those are
hash-verified as they are read for the refit (``checkpoint/reader.read_verified``), and
the refit is proven on the device by :func:`verify_refit`. A fault in the series is
returned as a :class:`SeriesProblem`, not raised: it only matters if evaluation must
reach it (the run is scored by its checkpoints up to the first pass).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from mlperf_logging.mllog import constants as C  # noqa: N812

from mlperf_grpo.checkpoint import (
    END_FILE,
    Checkpoint,
    CheckpointCorruptError,
    CheckpointError,
    check_model_files,
    check_same_tensors,
    discover_series,
    published_steps,
    read_training_end,
    remove_checkpoints,
    share_read,
    tensor_specs,
)
from mlperf_grpo.checkpoint.reader import ReadBuffers, read_verified
from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.config.rundir import RunDir
from mlperf_grpo.errors import EvaluationError
from mlperf_grpo.evaluate.settings import evaluation_settings, settings_difference
from mlperf_grpo.inference.base import InferenceEngine
from mlperf_grpo.logs.mllog import ParsedLog
from mlperf_grpo.model.files import check_model_path
from mlperf_grpo.model.fingerprint import (
    DEVICE_FINGERPRINT_ALGORITHM,
    FINGERPRINT_ALGORITHMS,
    FINGERPRINT_V1,
    FINGERPRINT_V2,
    canary_mismatch,
    sharded_fingerprint,
    weights_fingerprint,
)
from mlperf_grpo.tasks import Task, ValidationSet


class RefitError(RuntimeError):
    """After a refit the engine does not run the checkpoint's weights; evaluation stops."""


@dataclass(frozen=True)
class SeriesProblem:
    """A fault in the checkpoint series that only matters if evaluation must reach it.

    ``index``: position in the series of the first checkpoint that cannot be evaluated
    (``len(series)``: the fault lies past the last one, e.g. deleted final checkpoints).
    ``message``: one line naming the checkpoint and the fault.
    """

    index: int
    message: str


def check_series(
    checkpoints: list[Checkpoint], config: RunConfig, validation: ValidationSet, log: ParsedLog, checkpoint_root: Path,
    files_checked: set[Path] | None = None,
) -> tuple[list[str], SeriesProblem | None]:
    """Check a checkpoint series before anything is evaluated. Cheap: reads records,
    safetensors headers and the small non-weight files, never the weights (those are
    hash-verified as they are read for the refit).

    The run is scored by its checkpoints up to the first pass, so a fault in a checkpoint
    (or a gap, or missing final checkpoints) is returned, not raised: the caller evaluates
    the checkpoints before it and refuses only if none of them passes.

    Returns:
        ``(notes, problem)``: notes for the user (a series cut short by a hard kill of
        training) and the first fault, or ``None``. Faults: a gap; ``current_step`` or
        ``global_batch_size`` disagreeing with the directory or config; weight-update
        times not increasing or before ``run_start``; tensor names, shapes or dtypes
        differing from the first checkpoint or from the record; a checkpoint's non-weight
        files differing from their training-time fingerprint; a series that ends before
        the last step training published (or, after a hard kill, more than
        ``checkpoint.max_in_flight`` steps before the log's last trained step).

    ``files_checked`` (a follower's, kept across its rounds): the directories (the
    model's, checkpoints') whose files an earlier call found sound; their tensor headers
    and non-weight files are not read again (a published ``step_N/`` never changes, and
    the engine loaded ``model.path`` once), and each one found sound now is added.
    Raises:
        EvaluationError: nothing can be evaluated: no checkpoints; the first not at the
            first eval step; no ``run_start`` in the log; the files of ``model.path`` (what
            the engine loads) differ from those training fingerprinted; the config's
            evaluation settings differ from those training recorded
            (:func:`check_evaluation_settings`).
    """
    s0 = config.first_eval_step
    if not checkpoints:
        raise EvaluationError(f"no step_N checkpoints found; training writes them from step {s0} on")
    steps = [c.step for c in checkpoints]
    if steps[0] != s0:
        raise EvaluationError(f"first checkpoint is step_{steps[0]}, but the first eval step is {s0}")
    run_starts = log.find(C.RUN_START)
    if not run_starts:
        raise EvaluationError("the MLPerf log has no run_start; was training logged to another file?")
    files_checked = set() if files_checked is None else files_checked
    model_dir = check_model_path(config.model.path)
    settings_notes: list[str] = []
    if model_dir not in files_checked:
        try:
            check_model_files(checkpoints[0].info.files, model_dir, "model.path")
        except CheckpointError as err:
            raise EvaluationError(str(err)) from None
        settings_notes = check_evaluation_settings(checkpoints[0], config, validation.tasks)
        files_checked.add(model_dir)
    previous = run_starts[0].time_ms or 0
    for index, c in enumerate(checkpoints):
        fault = _checkpoint_fault(c, checkpoints[0], s0 + index, previous, config, files_checked)
        if fault is not None:
            return [], SeriesProblem(index, fault)
        previous = c.info.training_step_end_time_ms
    try:
        notes = _check_series_end(steps[-1], read_training_end(checkpoint_root), log, config.checkpoint.max_in_flight)
    except (EvaluationError, CheckpointError) as err:
        return settings_notes, SeriesProblem(len(checkpoints), str(err))
    return settings_notes + notes, None


def check_evaluation_settings(first: Checkpoint, config: RunConfig, validation_tasks: list[Task]) -> list[str]:
    """The config evaluates what training recorded: every setting of
    :func:`~mlperf_grpo.evaluate.settings.evaluation_settings` (seed, validation settings,
    ``grpo.max_new_tokens``, the task and its validation tasks' content) equals
    ``first``'s ``training_info.json`` ``evaluation`` record. Loads the task suite.

    Returns:
        A note when ``first`` records no settings (written before they were recorded):
        they are then unchecked.
    Raises:
        EvaluationError: a setting differs (names the key, the config's value and the
            recorded one); TaskError: the task source is unusable.
    """
    if not first.info.evaluation:
        return [f"note: {first.path.name} records no evaluation settings (written before they were): the config's "
                "seed, validation settings and task are not checked against the training's"]
    current = evaluation_settings(config, validation_tasks)
    difference = settings_difference(first.info.evaluation, current)
    if difference is not None:
        raise EvaluationError(
            f"the config's {difference} ({first.path.name}/training_info.json 'evaluation'); what evaluation measures "
            "cannot change after training: evaluate with the settings the run was trained with"
        )
    return []


def _checkpoint_fault(c: Checkpoint, first: Checkpoint, expected_step: int, previous_ms: int, config: RunConfig,
                      files_checked: set[Path]) -> str | None:
    """What is wrong with one checkpoint of the series (None: nothing found); its files
    are read unless ``c.path`` is in ``files_checked``, and it is added there when sound."""
    if c.step != expected_step:
        return f"checkpoint series has a gap: missing step_{expected_step}"
    info = c.info
    if info.current_step != c.step:
        return f"{c.path.name}: training_info.json says current_step {info.current_step}"
    if info.global_batch_size != config.global_batch_size:
        return f"{c.path.name}: global_batch_size {info.global_batch_size} != config's {config.global_batch_size}"
    if info.training_step_end_time_ms <= previous_ms:
        return (f"{c.path.name}: weight-update time {info.training_step_end_time_ms} is not after "
                f"{previous_ms} (run_start or the previous checkpoint)")
    if c.path in files_checked:  # found sound by an earlier call: a published step_N/ never changes
        return None
    try:
        check_same_tensors([first, c] if c is not first else [c])
        if c.info.files != first.info.files:
            raise CheckpointError(f"{c.path.name}: its non-weight files were fingerprinted differently from {first.path.name}")
        if c.info.evaluation != first.info.evaluation:
            raise CheckpointError(f"{c.path.name}: its evaluation settings differ from {first.path.name}'s (training_info.json 'evaluation')")
        check_model_files(c.info.files, c.path, c.path.name)
    except CheckpointError as err:
        return str(err)
    files_checked.add(c.path)
    return None


def _check_series_end(last: int, end, log: ParsedLog, max_in_flight: int) -> list[str]:
    """The final checkpoint is the last one training published: deleting the last
    checkpoints is not a shorter run. Without ``training_end.json`` (training was killed
    hard) up to ``max_in_flight`` trained steps may have had their checkpoint in flight."""
    if end is not None:
        if end.last_published_step != last:
            raise EvaluationError(
                f"the last checkpoint is step_{last}, but training published up to step_{end.last_published_step} "
                f"({END_FILE}); restore the missing checkpoints (a shorter series is not a shorter run)"
            )
        return []
    trained = [e.metadata.get("step") for e in log.find(C.BLOCK_STOP) if isinstance(e.metadata.get("step"), int)]
    last_trained = max(trained, default=0)
    if last < last_trained - max_in_flight:
        raise EvaluationError(
            f"the last checkpoint is step_{last}, but the log trained to step {last_trained} and training did not "
            f"record its end ({END_FILE}); a hard kill loses at most {max_in_flight} checkpoints in flight, so "
            f"step_{last + 1}.. were removed: restore them (a shorter series is not a shorter run)"
        )
    if last < last_trained:
        lost = f"step {last_trained}" if last + 1 == last_trained else f"steps {last + 1}..{last_trained}"
        return [
            f"note: training was killed before recording its end; the checkpoint(s) of {lost} "
            f"were in flight and never published; the final checkpoint is step_{last}"
        ]
    return []


class SeriesSource(Protocol):
    """Where a checkpoint series comes from, and how the evaluator reads and proves it.

    Records have ``step``, ``path`` and ``info`` with ``samples_count`` and
    ``training_step_end_time_ms`` (Unix ms). :class:`RunSeries` is our trainer's series;
    ``evaluate/foreign_series.py`` has those of other trainers.
    """

    root: Path

    def discover(self) -> tuple[list, list[Path], SeriesProblem | None]:
        """``(checkpoints in step order, ignored unfinished dirs, first unreadable one)``."""

    def check(self, checkpoints: list, config: RunConfig, validation: ValidationSet,
              log: ParsedLog) -> tuple[list[str], SeriesProblem | None]:
        """Cheap checks before anything is evaluated (see :func:`check_series`)."""

    def read(self, checkpoint, buffers: ReadBuffers, stop: threading.Event | None = None) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors (may be views into ``buffers``, reused after the
        refit); raises EvaluationError or CheckpointError when it cannot be read, and
        may give up with ReadStopped once ``stop`` is set."""

    def verify(self, engine: InferenceEngine, checkpoint, weights: dict[str, torch.Tensor]) -> str:
        """Prove the engine runs the checkpoint after a refit from ``weights``; returns
        how (recorded in the results); raises RefitError."""

    def read_share(self, checkpoint, slices: dict, buffers: ReadBuffers, group_rank: int, group_size: int,
                   stop: threading.Event | None = None) -> dict[str, torch.Tensor]:
        """A tensor-parallel rank's slice of each tensor (``slices``: name -> index into
        the full tensor, a name not in it whole), checked as :meth:`read` checks, the
        checks divided among the group's ranks (combine them with
        ``share_read.agree_on_read``)."""

    def reserve_share(self, buffers: ReadBuffers, checkpoint, slices: dict) -> None:
        """Allocate ahead the buffers :meth:`read_share` of ``checkpoint`` needs."""

    def rank_spec(self) -> dict | None:
        """What the other torchrun ranks need to rebuild this source (JSON), or None for
        the run directory's own series."""

    def published_steps(self) -> list[int]:
        """Steps of every published checkpoint (names only)."""

    def remove(self) -> str | None:
        """Teardown: delete the series (or keep it, for a series another trainer wrote);
        returns one line for the user saying what was deleted or kept, or ``None``."""


@dataclass(frozen=True)
class EvalJob:
    """What an evaluation of a series works on, handed from the driver to its workers:
    ``run`` holds the lock and the results (``eval/``), ``source`` the checkpoints,
    ``config`` how they are validated, ``validation`` the task suite and validation tasks
    (loaded once)."""

    run: RunDir
    source: SeriesSource
    config: RunConfig
    validation: ValidationSet


@dataclass(frozen=True)
class RunSeries:
    """Our trainer's series, ``<root>/step_N/`` (hash-verified reads, canary, files)."""

    root: Path

    def discover(self) -> tuple[list[Checkpoint], list[Path], SeriesProblem | None]:
        return discover_run_series(self.root)

    def check(self, checkpoints: list[Checkpoint], config: RunConfig, validation: ValidationSet,
              log: ParsedLog) -> tuple[list[str], SeriesProblem | None]:
        return check_series(checkpoints, config, validation, log, self.root)

    def read(self, checkpoint: Checkpoint, buffers: ReadBuffers, stop: threading.Event | None = None) -> dict[str, torch.Tensor]:
        return read_verified(checkpoint, buffers, stop)  # hash-verified as read, stoppable between chunks

    def verify(self, engine: InferenceEngine, checkpoint: Checkpoint, weights: dict[str, torch.Tensor]) -> str:
        return verify_refit(engine, checkpoint, list(weights))

    def read_share(self, checkpoint: Checkpoint, slices: dict, buffers: ReadBuffers, group_rank: int, group_size: int,
                   stop: threading.Event | None = None) -> dict[str, torch.Tensor]:
        return share_read.read_share(checkpoint, slices, buffers, group_rank, group_size, stop)

    def reserve_share(self, buffers: ReadBuffers, checkpoint: Checkpoint, slices: dict) -> None:
        share_read.reserve_share(buffers, checkpoint, slices)

    def rank_spec(self) -> None:
        return None  # the ranks rebuild it from the run directory

    def published_steps(self) -> list[int]:
        return published_steps(self.root)

    def remove(self) -> None:
        remove_checkpoints(self.root)  # <run>/checkpoints: the step directories our trainer wrote


def verify_refit(engine: InferenceEngine, checkpoint: Checkpoint, names: list[str]) -> str:
    """Prove the engine runs ``checkpoint`` after a refit: the fingerprint of the engine's
    tensors ``names`` (computed on the engine's device, by the algorithm the checkpoint
    records; a tensor-parallel engine's slices combined over its group) against the one
    training recorded (``weights.fingerprint``), and the engine's canary logits against
    the recorded ones. At ``engine.tp_size > 1`` every rank of the group calls it.

    Returns:
        ``"fingerprint+canary"``; ``"canary (fingerprint unchecked: ...)"`` for a
        checkpoint that records no fingerprint of an algorithm this engine computes
        (written before it existed): the canary is then the only check, and the caller
        says so.
    Raises:
        RefitError: the fingerprints differ, or the canary logits differ beyond the dtype's
            tolerance.
        EvaluationError: a tensor-parallel engine and a checkpoint whose algorithm cannot
            be combined over slices (v1).
    """
    recorded = checkpoint.info.weights.get("fingerprint") or {}
    digest = engine_fingerprint(engine, checkpoint, names, recorded.get("algorithm"))
    if digest is not None:
        if digest != recorded.get("digest"):
            raise RefitError(f"{checkpoint.path.name}: the engine's weights differ from the checkpoint after refit")
        checked = "fingerprint+canary"
    else:
        algorithm = recorded.get("algorithm")
        why = ("none recorded" if not algorithm else f"algorithm {algorithm!r} unknown" if algorithm not in FINGERPRINT_ALGORITHMS
               else f"algorithm {algorithm!r} not computed by this engine")
        checked = f"canary (fingerprint unchecked: {why})"
    worst = canary_mismatch(
        checkpoint.info.canary_logits, engine.canary_logits(), checkpoint.info.dtype, up_to_constant=engine.canary_is_log_softmax
    )
    if worst is not None:
        raise RefitError(
            f"{checkpoint.path.name}: the engine's canary logits differ from the checkpoint's by {worst:.3g}; "
            "the engine is not running these weights"
        )
    return checked


def engine_fingerprint(engine: InferenceEngine, checkpoint: Checkpoint, names: list[str], algorithm: str | None) -> str | None:
    """The fingerprint (``algorithm``) of the engine's tensors ``names``, or ``None``
    when this engine cannot compute that algorithm (unknown, or v1 on an engine that
    hands out no weights). A tensor-parallel engine (``tp_size > 1``): its local slices'
    v2 partials summed over ``engine.tp_group``
    (:func:`~mlperf_grpo.model.fingerprint.sharded_fingerprint`; full shapes from the
    checkpoint's headers), a collective.

    Raises:
        EvaluationError: ``tp_size > 1`` and a v1 checkpoint.
        RefitError: the group's slices or replicas disagree.
    """
    if getattr(engine, "tp_size", 1) > 1:
        if algorithm == FINGERPRINT_V1:
            raise EvaluationError(
                f"{checkpoint.path.name} records fingerprint algorithm {FINGERPRINT_V1}, which cannot be combined over "
                "tensor-parallel slices: evaluate with inference.tensor_parallel_size 1"
            )
        if algorithm != FINGERPRINT_V2:
            return None
        own, specs = engine.weights(), tensor_specs(checkpoint)
        local = {n: own[n] for n in names}
        try:
            return sharded_fingerprint(local, engine.weight_slices(),
                                       {n: (str(t.dtype).removeprefix("torch."), specs[n][1]) for n, t in local.items()},
                                       engine.tp_group)
        except ValueError as err:
            raise RefitError(f"{checkpoint.path.name}: {err}") from None
    if algorithm == DEVICE_FINGERPRINT_ALGORITHM:
        return engine.weights_fingerprint(names)
    own = engine.weights() if algorithm in FINGERPRINT_ALGORITHMS else None
    return None if own is None else weights_fingerprint({n: own[n] for n in names}, algorithm)


def read_error(checkpoint: Checkpoint, err: BaseException) -> BaseException:
    """The error for a checkpoint whose read failed (the message says what the user can do)."""
    if isinstance(err, CheckpointCorruptError):
        return EvaluationError(
            f"{err}; no earlier checkpoint passed, so the run cannot be scored past it: restore "
            f"{checkpoint.path.name}/ from a copy and run evaluate again (it resumes there), or train again"
        )
    if isinstance(err, CheckpointError):
        return EvaluationError(str(err))
    return err


def discover_run_series(checkpoint_root: Path) -> tuple[list[Checkpoint], list[Path], SeriesProblem | None]:
    """:func:`discover_series`, its first unreadable checkpoint made a problem (it only
    matters if evaluation must reach it)."""
    checkpoints, ignored, unreadable = discover_series(checkpoint_root)
    return checkpoints, ignored, None if unreadable is None else SeriesProblem(len(checkpoints), unreadable[1])


def series_by_step(source: SeriesSource) -> dict[int, Checkpoint]:
    """step -> checkpoint of the series ``source`` discovers now (its published ones)."""
    return {c.step: c for c in source.discover()[0]}
