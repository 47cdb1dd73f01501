"""The offline (deferred) evaluation driver.

Reads top to bottom like the lifecycle it runs::

    load the run (config, log path); read the log written so far
    discover step_N/ checkpoints; check the series before evaluating anything
        (steps, records, tensor headers, non-weight files, the end of training)
    plan: the checkpoints after those already logged (up to a series fault)
    N workers (one here, local torchrun ranks, or the ranks of a torchrun that started
    this process on any number of nodes), each with one engine, claim the next one:
        read its shards (hash-verified as read; the next one read meanwhile), refit the
        engine, verify (device fingerprint, canary), validate (pass@k), publish
    commit strictly in step order: eval_start, eval_accuracy, eval_stop in one write
        first pass: commit run_stop(success, time_ms = weight-update time); stop all
    none passed: run_stop(aborted, time_ms = final checkpoint's weight-update time)
    teardown: delete the checkpoints unless retained

The evaluator writes the run's one ``run_stop`` however training ended: the published
series is evaluated (its final checkpoint is the last one published). A run whose
training stopped before its first checkpoint (no ``step_N/``; the log's last trained
step before the first eval step, or at it with its write killed) has nothing to evaluate: it is closed with
``run_stop`` aborted at its last trained step (the time of that step's ``block_stop``,
``run_start``'s when no step finished). Teardown never deletes a checkpoint that was not
evaluated unless the run passed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Protocol

from mlperf_logging.mllog import constants as C  # noqa: N812
import torch
from tqdm import tqdm

from mlperf_grpo import rules
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
)
from mlperf_grpo.checkpoint.reader import ReadBuffers, read_verified
from mlperf_grpo.config import RunConfig
from mlperf_grpo.evaluate.prefetch import CheckpointPrefetcher
from mlperf_grpo.evaluate.prestart import prestart_rank_server
from mlperf_grpo.evaluate.validator import TaskResult, validate
from mlperf_grpo.evaluate.workers import (
    RankFailedError,
    TorchrunRanks,
    WorkQueue,
    die_with_launcher,
    launch,
    local_queue,
    rank_queue,
)
from mlperf_grpo.inference.base import InferenceEngine, SamplingParams, build_engine, check_engine_available
from mlperf_grpo.mllog import MLLogWriter, ParsedLog, now_ms, parse_log_text, read_log, time_to_train_ms
from mlperf_grpo.fingerprint import DEVICE_FINGERPRINT_ALGORITHM, canary_mismatch
from mlperf_grpo.rundir import RunDir, RunLock
from mlperf_grpo.model import check_model_path
from mlperf_grpo.tasks import load_suite, validation_tasks
from mlperf_grpo.tasks.scoring import REWARD_WORKERS, VerifierError, score

RETAIN_ENV = "RETAIN_GRPO_CHECKPOINTS"
"""Environment variable of the reference launcher: ``1`` keeps checkpoints after evaluation."""


class EvaluationError(ValueError):
    """The run cannot be evaluated as it is (bad series, bad log); nothing was logged."""


class RefitError(RuntimeError):
    """After a refit the engine does not run the checkpoint's weights; evaluation stops."""


_ERRORS: dict[str, type[Exception]] = {"EvaluationError": EvaluationError, "RefitError": RefitError, "VerifierError": VerifierError,
                                       "RankFailedError": RankFailedError}
"""The errors a worker reports as a result (raised again, in step order, by the committer)."""


@dataclass(frozen=True)
class EvalOutcome:
    """What the offline evaluation concluded (also written to ``eval/summary.json``).

    ``accuracies`` maps step -> pass@k for every checkpoint logged, in step order.
    ``time_to_train_ms`` is ``run_stop - run_start`` as read back from the log.
    """

    status: str
    passing_step: int | None
    run_stop_time_ms: int
    accuracies: dict[int, float]
    mllog_file: str
    time_to_train_ms: int


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
    checkpoints: list[Checkpoint], config: RunConfig, log: ParsedLog, checkpoint_root: Path,
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
            the engine loads) differ from those training fingerprinted.
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
    if model_dir not in files_checked:
        try:
            check_model_files(checkpoints[0].info.files, model_dir, "model.path")
        except CheckpointError as err:
            raise EvaluationError(str(err)) from None
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
        return [], SeriesProblem(len(checkpoints), str(err))
    return notes, None


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


def _logged_evals(log: ParsedLog) -> list[tuple[int, float]]:
    """``(step, accuracy)`` of the evaluations already in the log, in file order."""
    return [(e.metadata.get("step"), e.value) for e in log.find(C.EVAL_ACCURACY)]


def write_results(
    run: RunDir, step: int, results: list[TaskResult], params: SamplingParams, seed: int, engine: dict,
    refit_check: str = "", path: Path | None = None,
) -> None:
    """``path`` (default ``<run>/eval/step_N.jsonl``): a header (sampling, seed, engine,
    and ``refit_check`` when given: how the refit was verified), then one line per task; written to a temp file and
    renamed, so it is whole or absent."""
    path = run.eval_dir / f"step_{step}.jsonl" if path is None else path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".jsonl.tmp")
    header = {"step": step, "sampling": asdict(params), "seed": seed, "engine": engine}
    if refit_check:
        header["refit_check"] = refit_check
    with open(tmp, "w") as f:
        f.write(json.dumps(header) + "\n")
        for r in results:
            f.write(json.dumps(asdict(r)) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def log_eval(log: MLLogWriter, step: int, gbs: int, accuracy: float, start_ms: int, stop_ms: int) -> None:
    """Queue one checkpoint's ``eval_start``/``eval_accuracy``/``eval_stop`` (metadata
    ``samples_count = step * gbs`` and ``step``; times in Unix ms); the caller commits."""
    md = {C.SAMPLES_COUNT: rules.samples_count(step, gbs), "step": step}
    log.start(C.EVAL_START, metadata=md, time_ms=start_ms)
    log.event(C.EVAL_ACCURACY, accuracy, metadata=md, time_ms=stop_ms)
    log.end(C.EVAL_STOP, metadata=md, time_ms=stop_ms)


def log_run_stop(log: MLLogWriter, status: str, step: int, samples_count: int, time_ms: int) -> None:
    """Queue the run's single ``run_stop`` (shared by the offline and inline evaluators)."""
    log.end(C.RUN_STOP, metadata={C.STATUS: status, C.SAMPLES_COUNT: samples_count, "step": step}, time_ms=time_ms)


def _log_run_stop(log: MLLogWriter, status: str, checkpoint: Checkpoint) -> None:
    info = checkpoint.info
    log_run_stop(log, status, checkpoint.step, info.samples_count, info.training_step_end_time_ms)


def read_outcome(run: RunDir, mllog_file: Path, eval_log: Path | None = None) -> EvalOutcome:
    """The outcome as read back from the log (its first ``run_stop``); with ``eval_log``
    (the evaluator's own log), from the training log followed by it."""
    log = _read_logs(mllog_file, eval_log)
    stop = log.find(C.RUN_STOP)[0]
    status = stop.metadata.get(C.STATUS)
    accuracies = {step: acc for step, acc in _logged_evals(log)}
    outcome = EvalOutcome(
        status=status,
        passing_step=stop.metadata.get("step") if status == C.SUCCESS else None,
        run_stop_time_ms=int(stop.time_ms),
        accuracies=accuracies,
        mllog_file=str(eval_log or mllog_file),
        time_to_train_ms=time_to_train_ms(log),
    )
    return outcome


def retain_requested(flag: bool) -> bool:
    """``--retain-checkpoints`` or ``RETAIN_GRPO_CHECKPOINTS=1`` (unset or ``0``: delete).

    Raises:
        EvaluationError: ``RETAIN_GRPO_CHECKPOINTS`` is set to anything but 0 or 1.
    """
    value = os.environ.get(RETAIN_ENV, "0").strip() or "0"
    if value not in ("0", "1"):
        raise EvaluationError(f"{RETAIN_ENV} must be 0 (delete checkpoints after evaluation) or 1 (keep them), got {value!r}")
    return flag or value == "1"


def evaluate_run(run_dir: Path, retain_checkpoints: bool = False, show_progress: bool = True, workers: int | None = None,
                 merge: MergeLogs | None = None, ranks: TorchrunRanks | None = None) -> EvalOutcome:
    """Evaluate a trained run's deferred checkpoints and write its ``run_stop``.

    ``workers`` engines evaluate checkpoints in parallel (default: the config's
    ``evaluation.workers``); results are committed strictly in step order, so the log
    is the same, apart from times, for any number of workers.

    ``ranks``: the torchrun ranks this process joined as rank 0 (``workers`` is then
    their number): they are the workers, instead of ranks launched here.

    A run an evaluator followed during training (``evaluate --follow``; its
    ``eval/mlperf_eval.log`` exists) is continued in that log by one worker, which is then
    merged into the training log with ``merge`` (the CLI gives ``mlperf-grpo merge``'s).

    Holds the run's lock throughout (one writer per run). Resumable and idempotent:
    evaluations already in the log are not repeated, and a finished run (its
    ``eval/summary.json`` written) is only read back, its files untouched. A run whose
    ``run_stop`` is logged but whose teardown was interrupted has the teardown finished.

    Raises:
        RunDirError, ConfigError: the run directory is not usable (RunLockedError: another
            process is writing to it).
        EvaluationError: the checkpoint series or the log is not evaluable; nothing logged.
        RefitError: the engine does not hold the checkpoint's weights after a refit.
        VerifierError: the reward function raised or timed out on a checkpoint.
        LogWriteError: the log cannot be appended to.
    """
    retain = retain_requested(retain_checkpoints)
    run = RunDir(run_dir)
    config, mllog_file = run.load()
    workers = config.validation.workers if workers is None else workers
    if run.follow_log.is_file():
        if merge is None:
            raise EvaluationError(f"{run.root} was followed during training ({run.follow_log}); "
                                  f"'mlperf-grpo evaluate {run.root}' finishes it and merges that log")
        if workers > 1:
            print(f"note: {run.follow_log} (a follower's log) is continued by one worker, not {workers}", file=sys.stderr)
        with RunLock(run.eval_dir, "evaluator"):  # the one writer of eval/mlperf_eval.log
            return evaluate_series(run, RunSeries(run.checkpoints), config, mllog_file, eval_log=run.follow_log, merge=merge,
                                   retain=retain, show_progress=show_progress)
    return evaluate_series(run, RunSeries(run.checkpoints), config, mllog_file, retain=retain, show_progress=show_progress,
                           workers=workers, ranks=ranks)


MergeLogs = Callable[[Path, Path], None]
"""``merge(training_log, eval_log)``: append the evaluator's own log to the training log in
place, as ``mlperf-grpo merge`` does (the CLI passes it; the log tools sit above evaluation)."""


class SeriesSource(Protocol):
    """Where a checkpoint series comes from, and how the evaluator reads and proves it.

    Records have ``step``, ``path`` and ``info`` with ``samples_count`` and
    ``training_step_end_time_ms`` (Unix ms). :class:`RunSeries` is our trainer's series;
    ``evaluate/foreign.py`` has those of other trainers.
    """

    root: Path

    def discover(self) -> tuple[list, list[Path], SeriesProblem | None]:
        """``(checkpoints in step order, ignored unfinished dirs, first unreadable one)``."""

    def check(self, checkpoints: list, config: RunConfig, log: ParsedLog) -> tuple[list[str], SeriesProblem | None]:
        """Cheap checks before anything is evaluated (see :func:`check_series`)."""

    def read(self, checkpoint, buffers: ReadBuffers) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors (may be views into ``buffers``, reused after the
        refit); raises EvaluationError or CheckpointError when it cannot be read."""

    def verify(self, engine: InferenceEngine, checkpoint, weights: dict[str, torch.Tensor]) -> str:
        """Prove the engine runs the checkpoint after a refit from ``weights``; returns
        how (recorded in the results); raises RefitError."""

    def published_steps(self) -> list[int]:
        """Steps of every published checkpoint (names only)."""

    def remove(self) -> None:
        """Teardown: delete the series."""


@dataclass(frozen=True)
class RunSeries:
    """Our trainer's series, ``<root>/step_N/`` (hash-verified reads, canary, files)."""

    root: Path

    def discover(self) -> tuple[list[Checkpoint], list[Path], SeriesProblem | None]:
        return _discover(self.root)

    def check(self, checkpoints: list[Checkpoint], config: RunConfig, log: ParsedLog) -> tuple[list[str], SeriesProblem | None]:
        return check_series(checkpoints, config, log, self.root)

    def read(self, checkpoint: Checkpoint, buffers: ReadBuffers) -> dict[str, torch.Tensor]:
        return read_verified(checkpoint, buffers)  # hash-verified as read

    def verify(self, engine: InferenceEngine, checkpoint: Checkpoint, weights: dict[str, torch.Tensor]) -> str:
        return verify_refit(engine, checkpoint, list(weights))

    def published_steps(self) -> list[int]:
        return published_steps(self.root)

    def remove(self) -> None:
        remove_checkpoints(self.root)


def evaluate_series(
    run: RunDir,
    source: SeriesSource,
    config: RunConfig,
    mllog_file: Path,
    *,
    eval_log: Path | None = None,
    merge: MergeLogs | None = None,
    retain: bool = False,
    show_progress: bool = True,
    workers: int = 1,
    ranks: TorchrunRanks | None = None,
) -> EvalOutcome:
    """The lifecycle of :func:`evaluate_run` for any series: ``run`` holds the lock and
    the results (``eval/``); ``mllog_file`` is the training log; evaluations and
    ``run_stop`` are appended to it, or to ``eval_log`` (for ``mlperf-grpo merge``).
    With ``merge``, ``eval_log`` is merged into the training log once its ``run_stop``
    is logged (before the teardown); a training log that already has a ``run_stop`` was
    merged before (or closed by training), and ``eval_log`` is then not read.
    ``workers`` > 1 (torchrun ranks) needs ``run`` to be a run directory of ours with
    ``source`` its :class:`RunSeries`: the ranks load both from it; they are ``ranks``
    (torchrun's, joined by this process as rank 0) or, without, launched here.

    Raises: as :func:`evaluate_run`.
    """
    check_engine_available(config)  # before the lock or anything else is written
    if workers > 1 and ranks is None:
        prestart_rank_server(__name__)  # the ranks' imports run while the series is checked
    with RunLock(run.root, "evaluator"):  # held: no trainer is running, training is over
        if merge is not None and _read_checked_log(mllog_file).find(C.RUN_STOP):
            eval_log = None  # merged already
        log = _read_checked_log(mllog_file, eval_log)
        if log.find(C.RUN_STOP) and run.summary_file.is_file():
            return read_outcome(run, mllog_file, eval_log)  # finished earlier: report, touch nothing
        if not log.find(C.RUN_STOP):
            if _stopped_before_first_checkpoint(run, source, config, log, mllog_file):
                _close_aborted(run, config, eval_log or mllog_file, log)
            else:
                _evaluate_checkpoints(run, source, config, eval_log or mllog_file, log, show_progress, workers, ranks)
        if merge is not None and eval_log is not None:
            merge(mllog_file, eval_log)
            eval_log = None
        if not retain:
            _teardown(source, _read_logs(mllog_file, eval_log))
        outcome = read_outcome(run, mllog_file, eval_log)
        write_summary(run, outcome)  # marks the run finished
    return outcome


def write_summary(run: RunDir, outcome: EvalOutcome) -> None:
    """``<run>/eval/summary.json``: the outcome, with the log recorded relative to the
    run directory when it lies inside it (as ``run.json`` does), so a moved run's summary
    still names its log."""
    record = asdict(outcome)
    try:
        record["mllog_file"] = str(Path(outcome.mllog_file).resolve().relative_to(run.root.resolve()))
    except ValueError:
        record["mllog_file"] = str(Path(outcome.mllog_file).resolve())
    run.eval_dir.mkdir(parents=True, exist_ok=True)
    run.summary_file.write_text(json.dumps(record, indent=2) + "\n")


def last_trained_step(log: ParsedLog) -> tuple[int, int]:
    """``(step, time_ms)`` of the log's last ``block_stop``, or ``(0, run_start time)``
    when no step finished; time in Unix ms. The log must have a ``run_start``."""
    stops = log.find(C.BLOCK_STOP)
    if stops:
        return int(stops[-1].metadata.get("step", 0)), int(stops[-1].time_ms)
    return 0, int(log.find(C.RUN_START)[0].time_ms)


def _stopped_before_first_checkpoint(run: RunDir, source: SeriesSource, config: RunConfig, log: ParsedLog,
                                     mllog_file: Path) -> bool:
    """True for a run whose training ended before publishing any checkpoint: nothing
    evaluated or published, and the last trained step before the first eval step (no
    checkpoint was due) or at it with ``tmp_step_N/`` left (its write was killed).
    Otherwise a missing series is an error of :func:`check_series` (deleted or moved).

    Raises:
        EvaluationError: training never started (no ``run_start``): nothing to score.
    """
    if source.published_steps() or _logged_evals(log):
        return False
    if not log.find(C.RUN_START):
        raise EvaluationError(
            f"{run.root}: training never started (no run_start in {mllog_file}), so the run has nothing to "
            "evaluate or score; delete the directory and train again"
        )
    last, s0 = last_trained_step(log)[0], config.first_eval_step
    return last < s0 or (last == s0 and (source.root / f"tmp_step_{s0}").is_dir())


def _close_aborted(run: RunDir, config: RunConfig, mllog_file: Path, log: ParsedLog) -> None:
    """Write ``run_stop`` aborted at the last trained step and say why (stderr)."""
    step, time_ms = last_trained_step(log)
    writer = MLLogWriter(mllog_file)
    log_run_stop(writer, C.ABORTED, step, rules.samples_count(step, config.global_batch_size), time_ms)
    writer.commit()
    print(
        f"note: training of {run.root} stopped after step {step}, before its first checkpoint (step "
        f"{config.first_eval_step}); with nothing to evaluate the run is closed: run_stop aborted at step {step}",
        file=sys.stderr,
    )


def _teardown(source: SeriesSource, log: ParsedLog) -> None:
    """Delete the checkpoints of a finished run, unless one was never evaluated and the
    run did not pass (a ``run_stop`` aborted written before they were evaluated)."""
    passed = log.find(C.RUN_STOP)[0].metadata.get(C.STATUS) == C.SUCCESS
    evaluated = {step for step, _ in _logged_evals(log)}
    unevaluated = [step for step in source.published_steps() if step not in evaluated]
    if unevaluated and not passed:
        print(
            f"note: kept {source.root}: checkpoints {unevaluated} were never evaluated and the log's "
            "run_stop (aborted) was written before they were; delete them yourself if they are not needed",
            file=sys.stderr,
        )
        return
    source.remove()


def _read_logs(mllog_file: Path, eval_log: Path | None = None) -> ParsedLog:
    """The training log, followed by the evaluator's own log when there is one (absent:
    nothing evaluated yet). Raises OSError."""
    if eval_log is None:
        return read_log(mllog_file)
    text = mllog_file.read_bytes().decode("utf-8", errors="replace")
    if eval_log.is_file():
        text = text.rstrip("\n") + "\n" + eval_log.read_bytes().decode("utf-8", errors="replace")
    return parse_log_text(text)


def _read_checked_log(mllog_file: Path, eval_log: Path | None = None) -> ParsedLog:
    try:
        log = _read_logs(mllog_file, eval_log)
    except OSError as err:
        raise EvaluationError(f"cannot read the MLPerf log {err.filename}: {err.strerror}") from None
    if log.bad_lines:
        line_no, reason = log.bad_lines[0]
        raise EvaluationError(f"{mllog_file}:{line_no}: not a valid MLPerf line ({reason}); was a writer killed mid-line? repair the log first")
    if len(log.find(C.RUN_STOP)) > 1:
        raise EvaluationError(f"{mllog_file} already has {len(log.find(C.RUN_STOP))} run_stop lines; it cannot be scored")
    return log


def verify_refit(engine: InferenceEngine, checkpoint: Checkpoint, names: list[str]) -> str:
    """Prove the engine runs ``checkpoint`` after a refit: the fingerprint of the engine's
    tensors ``names`` (computed on the engine's device) against the one training recorded
    (``weights.fingerprint``), and the engine's canary logits against the recorded ones.

    Returns:
        ``"fingerprint+canary"``; ``"canary (fingerprint unchecked: ...)"`` for a
        checkpoint that records no fingerprint of this algorithm (written before it
        existed): the canary is then the only check, and the caller says so.
    Raises:
        RefitError: the fingerprints differ, or the canary logits differ beyond the dtype's
            tolerance.
    """
    recorded = checkpoint.info.weights.get("fingerprint") or {}
    if recorded.get("algorithm") == DEVICE_FINGERPRINT_ALGORITHM:
        if engine.weights_fingerprint(names) != recorded.get("digest"):
            raise RefitError(f"{checkpoint.path.name}: the engine's weights differ from the checkpoint after refit")
        checked = "fingerprint+canary"
    else:
        why = f"algorithm {recorded['algorithm']!r} unknown" if recorded.get("algorithm") else "none recorded"
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


def _corrupt(checkpoint: Checkpoint, err: Exception) -> Exception:
    """The error for a checkpoint whose read failed (the message says what the user can do)."""
    if isinstance(err, CheckpointCorruptError):
        return EvaluationError(
            f"{err}; no earlier checkpoint passed, so the run cannot be scored past it: restore "
            f"{checkpoint.path.name}/ from a copy and run evaluate again (it resumes there), or train again"
        )
    if isinstance(err, CheckpointError):
        return EvaluationError(str(err))
    return err


def _discover(checkpoint_root: Path) -> tuple[list[Checkpoint], list[Path], SeriesProblem | None]:
    """:func:`discover_series`, its first unreadable checkpoint made a problem (it only
    matters if evaluation must reach it)."""
    checkpoints, ignored, unreadable = discover_series(checkpoint_root)
    return checkpoints, ignored, None if unreadable is None else SeriesProblem(len(checkpoints), unreadable[1])


@dataclass(frozen=True)
class EvalPlan:
    """What is left to evaluate: the steps of ``pending`` (after those already logged, up
    to a series fault), the series ``problem`` (results are then held until a pass), and
    the final checkpoint's step (its time is an aborted ``run_stop``'s; ``None`` while
    training still runs: the series may grow, so no aborted ``run_stop`` is written)."""

    pending_steps: list[int]
    problem: SeriesProblem | None
    final_step: int | None


def plan_evaluation(source: SeriesSource, config: RunConfig, log: ParsedLog) -> EvalPlan:
    """Discover and check the series (notes to stderr) and decide what to evaluate.

    Raises:
        EvaluationError: nothing can be evaluated, or the log is not a prefix of the series.
    """
    checkpoints, ignored, problem = source.discover()
    for path in ignored:
        print(f"note: ignoring unfinished checkpoint {path} (never evaluated)", file=sys.stderr)
    notes, series_problem = source.check(checkpoints, config, log) if checkpoints or problem is None else ([], None)
    if problem is None or (series_problem is not None and series_problem.index < problem.index):
        problem = series_problem
    if problem is not None and not checkpoints:
        raise EvaluationError(problem.message)
    for note in notes:
        print(note, file=sys.stderr)
    done = _logged_evals(log)
    if [s for s, _ in done] != [c.step for c in checkpoints[: len(done)]]:
        raise EvaluationError(f"the log's evaluations {[s for s, _ in done]} are not a prefix of the checkpoint series")
    usable = checkpoints if problem is None else checkpoints[: problem.index]
    if problem is not None and len(usable) <= len(done):
        raise EvaluationError(_unscorable(problem))
    return EvalPlan([c.step for c in usable[len(done):]], problem, checkpoints[-1].step)


class StepOrderCommitter:
    """Commits results to the log strictly in step order, whoever evaluated them.

    :meth:`advance` takes the results of the queue's indices in order: each one's
    ``eval/unlogged/step_N.jsonl`` is moved to ``eval/step_N.jsonl`` and its
    ``eval_start``/``eval_accuracy``/``eval_stop`` (and ``run_stop`` success on the first
    pass) committed in one write; after a pass, or once every checkpoint failed
    (``run_stop`` aborted), the queue is stopped. With a series ``problem`` results are
    held until one passes (none: nothing is logged). Results after the decision are
    never logged (their files stay in ``eval/unlogged/``).
    """

    def __init__(self, run: RunDir, config: RunConfig, mllog_file: Path, plan: EvalPlan, checkpoints: dict[int, Checkpoint],
                 queue: WorkQueue, show_progress: bool) -> None:
        self.run, self.plan, self.queue, self.checkpoints = run, plan, queue, checkpoints
        self.gbs, self.target = config.global_batch_size, config.validation.target_accuracy
        self.writer = MLLogWriter(mllog_file)
        self.next = 0
        self.held: list[tuple[int, dict]] = []
        self.decided = False
        self.bar = tqdm(total=len(plan.pending_steps), desc="evaluate", unit="ckpt", disable=not show_progress)

    def advance(self, block: bool) -> bool:
        """Commit every result available in order (waiting for each when ``block``);
        True once the run is decided (its ``run_stop`` committed; never without a pass
        while the plan's ``final_step`` is ``None``).

        Raises:
            EvaluationError, RefitError, VerifierError: the next result in step order is
                that error (the queue is stopped; earlier results are committed).
        """
        while not self.decided and self.next < len(self.plan.pending_steps):
            result = self.queue.result(self.next, block)
            if result is None:
                return False
            step = self.plan.pending_steps[self.next]
            self.next += 1
            if "error" in result:
                self.queue.stop()
                raise _ERRORS.get(result["error"], RuntimeError)(result["message"])
            self.held.append((step, result))
            self.bar.set_postfix(step=step, acc=f"{result['accuracy']:.3f}", refresh=False)
            self.bar.update(1)
            passing = rules.is_passing(result["accuracy"], self.target)
            if self.plan.problem is None or passing:
                self._commit(step if passing else None)
        if not self.decided:
            if self.plan.problem is not None:
                self.queue.stop()
                raise EvaluationError(_unscorable(self.plan.problem))
            if self.plan.final_step is None:  # following a training: later checkpoints may pass
                return False
            _log_run_stop(self.writer, C.ABORTED, self.checkpoints[self.plan.final_step])
            self.writer.commit()
            self._decide()
        return True

    def _commit(self, passing_step: int | None) -> None:
        for step, result in self.held:
            os.replace(unlogged_results(self.run, step), self.run.eval_dir / f"step_{step}.jsonl")
            log_eval(self.writer, step, self.gbs, result["accuracy"], result["start_ms"], result["stop_ms"])
        if passing_step is not None:
            _log_run_stop(self.writer, C.SUCCESS, self.checkpoints[passing_step])
        self.writer.commit()  # the eval triples (and run_stop on a pass) in one write
        self.held.clear()
        if passing_step is not None:
            self._decide()

    def _decide(self) -> None:
        self.decided = True
        self.queue.stop()
        self.close()

    def close(self) -> None:
        """End the progress bar (before any error line is printed)."""
        self.bar.close()


def unlogged_results(run: RunDir, step: int) -> Path:
    """``eval/unlogged/step_N.jsonl``: a result evaluated but not (yet) in the log."""
    return run.eval_dir / "unlogged" / f"step_{step}.jsonl"


def evaluate_claimed(queue: WorkQueue, run: RunDir, source: SeriesSource, config: RunConfig, checkpoints: dict[int, Checkpoint],
                     plan: EvalPlan, engine: Callable[[], InferenceEngine], after_each=lambda: None) -> None:
    """One worker: claim the next pending checkpoint, refit from its prefetched verified
    read (the next one is read meanwhile), verify, validate, write its results to
    ``eval/unlogged/`` and publish its result (or its error) until none is left or the
    run is decided. ``engine()`` gives the worker's engine; it is called once, after the
    first claim, so an engine started then (:class:`EngineAtFirstUse`) starts while its
    first checkpoint is read. ``after_each()`` runs after every publish (the serial
    committer)."""
    suite = load_suite(config)
    tasks = validation_tasks(suite, config.validation.num_tasks)
    v = config.validation
    params = SamplingParams(v.temperature, v.top_p, config.grpo.max_new_tokens)
    prefetcher = CheckpointPrefetcher(source.read, pin=_pins_host_buffers(config), reserve=isinstance(source, RunSeries))
    try:
        claimed = _claim(queue, plan, checkpoints, prefetcher)
        worker_engine = engine() if claimed else None
        while claimed and not queue.stopped():
            wait_start_s = time.perf_counter()
            item = prefetcher.take()
            claimed = _claim(queue, plan, checkpoints, prefetcher)  # read it while this one is validated
            try:
                if item.error is not None:
                    raise _corrupt(item.checkpoint, item.error)
                start_ms, refit_start_s = now_ms(), time.perf_counter()
                worker_engine.load_weights(item.weights)  # refit, no optimizer state; waits for the copies
                checked = source.verify(worker_engine, item.checkpoint, item.weights)
                prefetcher.release(item)
                generation_start_s = time.perf_counter()
                accuracy, results = validate(worker_engine, tasks, suite.reward, v.generations_per_task, params, seed=config.seed)
                generation_stop_s = time.perf_counter()
                write_results(run, item.checkpoint.step, results, params, config.seed, worker_engine.describe(), checked,
                              unlogged_results(run, item.checkpoint.step))
                record_timing(run, item.checkpoint.step, read_wait_s=refit_start_s - wait_start_s,
                              refit_s=generation_start_s - refit_start_s, generation_s=generation_stop_s - generation_start_s)
                queue.publish(item.index, {"accuracy": accuracy, "start_ms": start_ms, "stop_ms": now_ms()})
            except tuple(_ERRORS.values()) as err:
                queue.publish(item.index, {"error": type(err).__name__, "message": str(err)})
            after_each()
    finally:
        prefetcher.close()


def record_timing(run: RunDir, step: int, **seconds: float) -> None:
    """Append one line to ``eval/timing.jsonl``: where one checkpoint's evaluation time
    went, in seconds (``read_wait_s``: waiting for its verified read, the part the
    prefetch did not hide; ``refit_s``: weights into the engine and verified;
    ``generation_s``: validation), which rank evaluated it, and the process
    (:func:`process_fields`). Informational only."""
    record = {"step": step, "rank": int(os.environ.get("RANK", 0)), **{k: round(v, 4) for k, v in seconds.items()},
              **process_fields()}
    with open(run.eval_dir / "timing.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def process_fields() -> dict[str, int | float | None]:
    """``{"pid": ..., "process_start_unix_s": ...}`` of the calling process, for the
    lines of ``eval/timing.jsonl`` and ``eval/startup.jsonl``: together they name the
    process that wrote a line (a pid is reused only by a later process), so the lines of
    each evaluation attempt (these files are appended to across resumes) can be told
    apart. The start time is the kernel's (``/proc/PID/stat`` field 22 after the boot
    time of ``/proc/stat``, ``proc(5)``; to the second), ``None`` where there is no
    ``/proc``."""
    return {"pid": os.getpid(), "process_start_unix_s": _process_start_unix_s(os.getpid())}


@functools.lru_cache(maxsize=None)
def _process_start_unix_s(pid: int) -> float | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot_unix_s = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                           if line.startswith("btime "))
    except (OSError, StopIteration):
        return None
    start_ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22; fields after "(comm)" start at 3
    return round(boot_unix_s + start_ticks / os.sysconf("SC_CLK_TCK"), 2)


def start_engine(run: RunDir, config: RunConfig, launch_unix_s: float | None = None) -> InferenceEngine:
    """This worker's engine, ready before it refits its first checkpoint: built with its
    weights unset (``refit_only``: the first refit fills every one, verified by
    fingerprint and canary), then warmed up by generating 2 tokens for the validation
    prompts of one engine batch (``validation.batch_size`` rows on a GPU, where the first
    batch of that shape pays the allocator's growth and the first kernel launches; one
    row on the CPU) and scoring one completion once per reward worker (their start and
    imports), so no checkpoint's time includes start-up. Appends where start-up went to
    ``eval/startup.jsonl`` (:func:`record_startup`).

    Args:
        launch_unix_s: Unix time (s) at which the evaluator launched the worker ranks
            (None: this is the evaluator's own process).
    Raises:
        ModelLoadError, EngineUnavailableError: the engine cannot be built.
    """
    start_unix_s, start_s = time.time(), time.perf_counter()
    engine = build_engine(config, batch_size=config.validation.batch_size, refit_only=True)
    built_s = time.perf_counter()
    try:
        suite = load_suite(config)
        tasks = validation_tasks(suite, config.validation.num_tasks)
        v = config.validation
        rows = v.batch_size if _engine_on_cuda(engine) else 1
        prompts = [tasks[i % len(tasks)].prompt for i in range(rows)]
        completion = engine.generate(prompts, SamplingParams(v.temperature, v.top_p, 2), seeds=list(range(rows)))[0]
        try:
            score(suite.reward, [(completion.text, tasks[0])] * REWARD_WORKERS)  # the rewards are discarded
        except VerifierError:
            pass  # a broken reward fails the first checkpoint's validation, in step order, as without warm-up
        if _engine_on_cuda(engine):
            torch.cuda.synchronize(engine.device)
    except BaseException:
        engine.close()
        raise
    ready_s = time.perf_counter()
    record_startup(run, launch_unix_s=launch_unix_s, start_unix_s=start_unix_s,
                   engine_s=built_s - start_s, warm_up_s=ready_s - built_s)
    return engine


def record_startup(run: RunDir, **fields: float | None) -> None:
    """Append one line to ``eval/startup.jsonl``: one worker's start-up (``rank``;
    ``launch_unix_s``: when the evaluator launched the ranks, null for the evaluator's own
    worker; ``start_unix_s``: when this worker began building its engine, after its
    imports; ``engine_s``: engine built; ``warm_up_s``: the warm-up generation and
    scoring; ``pid``, ``process_start_unix_s``: :func:`process_fields`).
    Informational only."""
    record = {"rank": int(os.environ.get("RANK", 0)),
              **{k: (None if v is None else round(v, 4)) for k, v in fields.items()}, **process_fields()}
    run.eval_dir.mkdir(parents=True, exist_ok=True)
    with open(run.eval_dir / "startup.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def _claim(queue: WorkQueue, plan: EvalPlan, checkpoints: dict[int, Checkpoint], prefetcher: CheckpointPrefetcher) -> bool:
    index = queue.claim()
    if index is None:
        return False
    prefetcher.submit(index, checkpoints[plan.pending_steps[index]])
    return True


def _engine_on_cuda(engine: InferenceEngine) -> bool:
    return str(getattr(engine, "device", "cpu")).startswith("cuda")


def _pins_host_buffers(config: RunConfig) -> bool:
    """The checkpoint reads go to pinned host memory: the ``hf`` engine on a GPU refits
    from it with one DMA per tensor (vLLM takes the weights through its own process)."""
    return config.inference.engine == "hf" and config.model.device.startswith("cuda")


class EngineAtFirstUse:
    """A worker's engine, started (:func:`start_engine`) the first time it is asked for;
    :meth:`close` closes it if it was started.

    Args:
        run, config, launch_unix_s: as :func:`start_engine`'s.
    """

    def __init__(self, run: RunDir, config: RunConfig, launch_unix_s: float | None = None) -> None:
        self._start = lambda: start_engine(run, config, launch_unix_s)
        self._engine: InferenceEngine | None = None

    def __call__(self) -> InferenceEngine:
        if self._engine is None:
            self._engine = self._start()
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None


def _evaluate_checkpoints(run: RunDir, source: SeriesSource, config: RunConfig, mllog_file: Path, log: ParsedLog,
                          show_progress: bool, workers: int, ranks: TorchrunRanks | None = None) -> None:
    """Evaluate the pending checkpoints with ``workers`` engines and commit in step order
    up to the first pass; one worker runs here, more are torchrun ranks (``ranks``, or
    launched here: :func:`launch`)."""
    plan = plan_evaluation(source, config, log)
    try:
        _run_workers(run, source, config, mllog_file, plan, show_progress, workers, ranks)
    except EvaluationError:
        _remove_if_nothing_committed(run)
        raise


def _remove_if_nothing_committed(run: RunDir) -> None:
    """A refused run (nothing scorable) leaves no ``eval/``: delete it when it holds only
    what the workers wrote for results that were never logged (no ``step_N.jsonl``, no
    summary). Called once every worker has stopped."""
    import shutil

    if run.eval_dir.is_dir() and not any(run.eval_dir.glob("step_*.jsonl")) and not run.summary_file.exists():
        shutil.rmtree(run.eval_dir)


def _run_workers(run: RunDir, source: SeriesSource, config: RunConfig, mllog_file: Path, plan: EvalPlan,
                 show_progress: bool, workers: int, ranks: TorchrunRanks | None) -> None:
    if workers == 1:
        checkpoints = _series_by_step(source)
        queue = local_queue(len(plan.pending_steps))
        engine = EngineAtFirstUse(run, config)
        committer = StepOrderCommitter(run, config, mllog_file, plan, checkpoints, queue, show_progress)
        try:
            evaluate_claimed(queue, run, source, config, checkpoints, plan, engine,
                             after_each=lambda: committer.advance(block=False))
            committer.advance(block=True)
        finally:
            committer.close()
            engine.close()
        return
    if source != RunSeries(run.checkpoints):
        raise EvaluationError("--workers N > 1 evaluates a run directory of ours; evaluate this series with one worker")
    if ranks is None:
        outcome = launch(evaluate_rank, (str(run.root), str(mllog_file), plan, show_progress, time.time()), workers)[0]
    else:  # this process is rank 0 of the ranks torchrun started: they are the workers
        ranks.publish_plan({"mllog_file": str(mllog_file), "plan": asdict(plan)})
        try:
            outcome = evaluate_rank(str(run.root), str(mllog_file), plan, show_progress)
        except BaseException:
            WorkQueue(ranks.store, 0).stop()  # the others claim nothing more
            raise
        finally:
            ranks.wait_ended()  # no rank reads a checkpoint or writes a result past this
    if outcome is not None:
        raise _ERRORS.get(outcome["error"], RuntimeError)(outcome["message"])


def _series_by_step(source: SeriesSource) -> dict[int, Checkpoint]:
    return {c.step: c for c in source.discover()[0]}


def evaluate_rank(run_dir: str, mllog_file: str, plan: EvalPlan, show_progress: bool,
                  launch_unix_s: float | None = None) -> dict | None:
    """A torchrun rank of ``evaluate --workers N`` (or of ``evaluate`` under torchrun):
    one engine on device ``LOCAL_RANK`` (CUDA) or a CPU process with its share of its
    node's cores, started (:func:`start_engine`)
    once the rank has claimed its first checkpoint, while that one is read (a rank that
    claims nothing starts none); rank 0 also commits (a thread with its own store
    connection) to ``mllog_file`` (the evaluator's, resolved when it took the lock).
    Dies with the launching evaluator (it holds the lock; :func:`die_with_launcher`).
    ``launch_unix_s``: when the evaluator launched the ranks (Unix s; for
    ``eval/startup.jsonl``).

    Returns:
        rank 0: ``None`` or ``{"error": class name, "message": ...}``; others ``None``.
    """
    die_with_launcher()
    # one process, one bar: a thread lock, not tqdm's default multiprocessing one (a named
    # semaphore that, in a forkserver rank, the evaluator's resource tracker would report
    # leaked when the launcher stops the rank with SIGTERM)
    tqdm.set_lock(threading.RLock())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run = RunDir(Path(run_dir))
    config = run.load()[0]
    if config.model.device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    engine = EngineAtFirstUse(run, config, launch_unix_s)
    failure: list[dict] = []
    committer_thread = None
    try:
        source = RunSeries(run.checkpoints)
        checkpoints = _series_by_step(source)
        queue = rank_queue(len(plan.pending_steps), serve=True)
        if rank == 0:
            committer = StepOrderCommitter(run, config, Path(mllog_file), plan, checkpoints,
                                           rank_queue(len(plan.pending_steps), serve=False), show_progress)

            def commit_all() -> None:
                try:
                    committer.advance(block=True)
                except tuple(_ERRORS.values()) as err:
                    failure.append({"error": type(err).__name__, "message": str(err)})
                finally:
                    committer.close()

            committer_thread = threading.Thread(target=commit_all, name="commit-in-step-order")
            committer_thread.start()
        evaluate_claimed(queue, run, source, config, checkpoints, plan, engine)
    finally:
        engine.close()
    if committer_thread is not None:
        committer_thread.join()
    return failure[0] if failure else None


def join_evaluation(run_dir: Path, ranks: TorchrunRanks) -> int:
    """A rank other than 0 of ``evaluate RUN_DIR`` under torchrun: wait for rank 0's
    plan and evaluate as a worker (:func:`evaluate_rank`), or nothing when rank 0
    concluded without a plan (nothing to evaluate, or it failed first); then tell rank 0
    this rank stopped (with its error if it failed) and wait for rank 0 to conclude.
    Writes only what a worker writes (``eval/unlogged/``, ``eval/timing.jsonl``,
    ``eval/startup.jsonl``).

    Returns:
        this rank's exit code (:meth:`TorchrunRanks.verdict`).
    Raises:
        RankFailedError: rank 0 failed, and this rank is on another node (its message).
        whatever :func:`evaluate_rank` raises (reported to rank 0 first).
    """
    shared = ranks.wait_plan()
    try:
        if shared is not None:
            p = shared["plan"]
            plan = EvalPlan(p["pending_steps"], p["problem"] and SeriesProblem(**p["problem"]), p["final_step"])
            evaluate_rank(str(run_dir), shared["mllog_file"], plan, show_progress=False)
    except BaseException as err:
        with contextlib.suppress(Exception):  # best effort (rank 0 may be gone): this error is the one raised
            ranks.end(failure=f"rank {ranks.rank}: {type(err).__name__}: {err}")
        raise
    ranks.end()
    exit_code, error = ranks.verdict()
    if error is not None and exit_code:
        raise RankFailedError(f"rank 0 failed: {error}")
    return exit_code


def _unscorable(problem: SeriesProblem) -> str:
    return (f"{problem.message}; no checkpoint before it passed, so the run cannot be scored past it "
            "(nothing was logged for the checkpoints evaluated): restore the checkpoint from a copy and run "
            "evaluate again, or train again")
