"""The offline (deferred) evaluation driver.

Reads top to bottom like the lifecycle it runs::

    load the run (config, log path); read the log written so far
    discover step_N/ checkpoints; check the series before evaluating anything
        (steps, records, tensor headers, non-weight files, the end of training)
    build one engine; for each checkpoint in step order (after those already logged):
        read its shards (hash-verified as read), refit the engine, validate (pass@k)
        commit eval_start, eval_accuracy, eval_stop in one write
        first pass: commit run_stop(success, time_ms = weight-update time); stop
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

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

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
    read_weights,
    remove_checkpoints,
)
from mlperf_grpo.config import RunConfig
from mlperf_grpo.evaluate.validator import TaskResult, validate
from mlperf_grpo.inference.base import InferenceEngine, SamplingParams, build_engine, check_engine_available
from mlperf_grpo.mllog import MLLogWriter, ParsedLog, now_ms, parse_log_text, read_log, time_to_train_ms
from mlperf_grpo.fingerprint import canary_mismatch, weights_fingerprint
from mlperf_grpo.rundir import RunDir, RunLock
from mlperf_grpo.model import check_model_path
from mlperf_grpo.tasks import load_suite, validation_tasks

RETAIN_ENV = "RETAIN_GRPO_CHECKPOINTS"
"""Environment variable of the reference launcher: ``1`` keeps checkpoints after evaluation."""


class EvaluationError(ValueError):
    """The run cannot be evaluated as it is (bad series, bad log); nothing was logged."""


class RefitError(RuntimeError):
    """After a refit the engine does not run the checkpoint's weights; evaluation stops."""


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
    checkpoints: list[Checkpoint], config: RunConfig, log: ParsedLog, checkpoint_root: Path
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
    try:
        check_model_files(checkpoints[0].info.files, check_model_path(config.model.path), "model.path")
    except CheckpointError as err:
        raise EvaluationError(str(err)) from None
    previous = run_starts[0].time_ms or 0
    for index, c in enumerate(checkpoints):
        fault = _checkpoint_fault(c, checkpoints[0], s0 + index, previous, config)
        if fault is not None:
            return [], SeriesProblem(index, fault)
        previous = c.info.training_step_end_time_ms
    try:
        notes = _check_series_end(steps[-1], read_training_end(checkpoint_root), log, config.checkpoint.max_in_flight)
    except (EvaluationError, CheckpointError) as err:
        return [], SeriesProblem(len(checkpoints), str(err))
    return notes, None


def _checkpoint_fault(c: Checkpoint, first: Checkpoint, expected_step: int, previous_ms: int, config: RunConfig) -> str | None:
    """What is wrong with one checkpoint of the series (None: nothing found)."""
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
    try:
        check_same_tensors([first, c] if c is not first else [c])
        if c.info.files != first.info.files:
            raise CheckpointError(f"{c.path.name}: its non-weight files were fingerprinted differently from {first.path.name}")
        check_model_files(c.info.files, c.path, c.path.name)
    except CheckpointError as err:
        return str(err)
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
    run: RunDir, step: int, results: list[TaskResult], params: SamplingParams, seed: int, engine: dict
) -> None:
    """``<run>/eval/step_N.jsonl``: a header (sampling, seed, engine), then one line per
    task; written to a temp file and renamed, so it is whole or absent."""
    run.eval_dir.mkdir(parents=True, exist_ok=True)
    path = run.eval_dir / f"step_{step}.jsonl"
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps({"step": step, "sampling": asdict(params), "seed": seed, "engine": engine}) + "\n")
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


def evaluate_run(run_dir: Path, retain_checkpoints: bool = False, show_progress: bool = True) -> EvalOutcome:
    """Evaluate a trained run's deferred checkpoints and write its ``run_stop``.

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
    return evaluate_series(run, RunSeries(run.checkpoints), config, mllog_file, retain=retain, show_progress=show_progress)


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

    def read(self, checkpoint) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors; raises EvaluationError when it cannot be read."""

    def verify(self, engine: InferenceEngine, checkpoint, weights: dict[str, torch.Tensor]) -> None:
        """Prove the engine runs the checkpoint after a refit; raises RefitError."""

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

    def read(self, checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
        return _read_verified(checkpoint)

    def verify(self, engine: InferenceEngine, checkpoint: Checkpoint, weights: dict[str, torch.Tensor]) -> None:
        verify_refit(engine, checkpoint, weights)

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
    retain: bool = False,
    show_progress: bool = True,
) -> EvalOutcome:
    """The lifecycle of :func:`evaluate_run` for any series: ``run`` holds the lock and
    the results (``eval/``); ``mllog_file`` is the training log; evaluations and
    ``run_stop`` are appended to it, or to ``eval_log`` (for ``mlperf-grpo merge``).

    Raises: as :func:`evaluate_run`.
    """
    check_engine_available(config)  # before the lock or anything else is written
    with RunLock(run.root, "evaluator"):  # held: no trainer is running, training is over
        log = _read_checked_log(mllog_file, eval_log)
        if log.find(C.RUN_STOP) and run.summary_file.is_file():
            return read_outcome(run, mllog_file, eval_log)  # finished earlier: report, touch nothing
        if not log.find(C.RUN_STOP):
            if _stopped_before_first_checkpoint(run, source, config, log, mllog_file):
                _close_aborted(run, config, eval_log or mllog_file, log)
            else:
                _evaluate_checkpoints(run, config, eval_log or mllog_file, log, show_progress, source)
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


def verify_refit(engine: InferenceEngine, checkpoint: Checkpoint, weights: dict[str, torch.Tensor]) -> None:
    """Prove the engine runs ``checkpoint`` after a refit.

    Raises:
        RefitError: the engine's tensors differ from the checkpoint's (fingerprint), or its
            canary logits differ from those recorded when the checkpoint was written.
    """
    want = weights_fingerprint({n: t.to(engine.dtype) for n, t in weights.items()})
    if engine.weights_fingerprint(list(weights)) != want:
        raise RefitError(f"{checkpoint.path.name}: the engine's weights differ from the checkpoint after refit")
    worst = canary_mismatch(
        checkpoint.info.canary_logits, engine.canary_logits(), checkpoint.info.dtype, up_to_constant=engine.canary_is_log_softmax
    )
    if worst is not None:
        raise RefitError(
            f"{checkpoint.path.name}: the engine's canary logits differ from the checkpoint's by {worst:.3g}; "
            "the engine is not running these weights"
        )


def _read_verified(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """The checkpoint's weights, hash-verified as read. Only checkpoints up to the first
    pass are ever read, so a corrupt one after it never blocks the result.

    Raises:
        EvaluationError: the checkpoint is corrupt (nothing after the last logged
            evaluation is logged; the message says what the user can do).
    """
    try:
        return read_weights(checkpoint)
    except CheckpointCorruptError as err:
        raise EvaluationError(
            f"{err}; no earlier checkpoint passed, so the run cannot be scored past it: restore "
            f"{checkpoint.path.name}/ from a copy and run evaluate again (it resumes there), or train again"
        ) from None
    except CheckpointError as err:
        raise EvaluationError(str(err)) from None


def _discover(checkpoint_root: Path) -> tuple[list[Checkpoint], list[Path], SeriesProblem | None]:
    """:func:`discover_series`, its first unreadable checkpoint made a problem (it only
    matters if evaluation must reach it)."""
    checkpoints, ignored, unreadable = discover_series(checkpoint_root)
    return checkpoints, ignored, None if unreadable is None else SeriesProblem(len(checkpoints), unreadable[1])


def _evaluate_checkpoints(run: RunDir, config: RunConfig, mllog_file: Path, log: ParsedLog, show_progress: bool,
                          source: SeriesSource) -> None:
    """Evaluate in step order up to the first pass. When the series has a fault, only the
    checkpoints before it are evaluated, and their results are committed only if one of
    them passes (a fault after the pass never blocks the result; one before any pass is
    refused with nothing logged)."""
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

    writer = MLLogWriter(mllog_file)
    suite = load_suite(config)
    tasks = validation_tasks(suite, config.validation.num_tasks)
    v = config.validation
    params = SamplingParams(v.temperature, v.top_p, config.grpo.max_new_tokens)
    gbs = config.global_batch_size
    engine = build_engine(config, batch_size=v.batch_size)
    bar = tqdm(total=len(usable), initial=len(done), desc="evaluate", unit="ckpt", disable=not show_progress)
    held: list[tuple[Checkpoint, list[TaskResult], float, int, int]] = []  # evaluations not yet committed
    passing = None
    try:
        for checkpoint in usable[len(done):]:
            start_ms = now_ms()
            weights = source.read(checkpoint)  # hash-verified as read where the format records hashes
            engine.load_weights(weights)  # refit, no optimizer state
            source.verify(engine, checkpoint, weights)
            accuracy, results = validate(engine, tasks, suite.reward, v.generations_per_task, params, seed=config.seed)
            held.append((checkpoint, results, accuracy, start_ms, now_ms()))
            if rules.is_passing(accuracy, v.target_accuracy):
                passing = checkpoint
            if problem is None or passing is not None:  # commit now (resumable), in step order
                for c, res, acc, t0, t1 in held:
                    write_results(run, c.step, res, params, seed=config.seed, engine=engine.describe())
                    log_eval(writer, c.step, gbs, acc, t0, t1)
                if passing is not None:
                    _log_run_stop(writer, C.SUCCESS, passing)
                writer.commit()  # the eval triples (and run_stop on a pass) in one write
                held.clear()
            bar.set_postfix(step=checkpoint.step, acc=f"{accuracy:.3f}", refresh=False)
            bar.update(1)
            if passing:
                break
        if passing is None and problem is not None:
            raise EvaluationError(_unscorable(problem))
        if passing is None:
            _log_run_stop(writer, C.ABORTED, checkpoints[-1])
            writer.commit()
    finally:
        bar.close()


def _unscorable(problem: SeriesProblem) -> str:
    return (f"{problem.message}; no checkpoint before it passed, so the run cannot be scored past it "
            "(nothing was logged for the checkpoints evaluated): restore the checkpoint from a copy and run "
            "evaluate again, or train again")
