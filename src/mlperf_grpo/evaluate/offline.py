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

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from mlperf_logging.mllog import constants as C  # noqa: N812

from mlperf_grpo import rules
from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.config.rundir import RunDir, RunLock
from mlperf_grpo.evaluate import outcome
from mlperf_grpo.evaluate.commit import (
    EvalPlan,
    logged_evals,
    plan_evaluation,
)
from mlperf_grpo.evaluate.launch import TorchrunRanks, WorkQueue, launch
from mlperf_grpo.evaluate.logged_result import check_run_stop_supported, logged_pass
from mlperf_grpo.evaluate.prestart import prestart_rank_server
from mlperf_grpo.evaluate.serial import evaluate_serially
from mlperf_grpo.evaluate.series import EvalJob, EvaluationError, RunSeries, SeriesSource, series_by_step
from mlperf_grpo.evaluate.settings import LOGGED_KEYS, logged_differences
from mlperf_grpo.evaluate.worker import RANK_MODULE, EngineAtFirstUse, evaluate_rank
from mlperf_grpo.evaluate.worker_errors import WORKER_ERRORS
from mlperf_grpo.evaluate.worker_group import check_worker_groups
from mlperf_grpo.inference.factory import check_engine_available
from mlperf_grpo.logs.merge import MergeError, merge_logs
from mlperf_grpo.logs.mllog import MLLogWriter, ParsedLog, parse_log_text, read_log, time_to_train_ms
from mlperf_grpo.step_dirs import tmp_step_dir_name
from mlperf_grpo.tasks import ValidationSet, load_validation_set
from mlperf_grpo.tasks.base import is_agentic
from mlperf_grpo.tasks.lengths import check_prompt_lengths


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


def read_outcome(run: RunDir, mllog_file: Path, eval_log: Path | None = None) -> EvalOutcome:
    """The outcome as read back from the log (its first ``run_stop``); with ``eval_log``
    (the evaluator's own log), from the training log followed by it."""
    log = _read_logs(mllog_file, eval_log)
    stop = log.find(C.RUN_STOP)[0]
    status = stop.metadata.get(C.STATUS)
    accuracies = {step: acc for step, acc in logged_evals(log)}
    outcome = EvalOutcome(
        status=status,
        passing_step=stop.metadata.get("step") if status == C.SUCCESS else None,
        run_stop_time_ms=int(stop.time_ms),
        accuracies=accuracies,
        mllog_file=str(eval_log or mllog_file),
        time_to_train_ms=time_to_train_ms(log),
    )
    return outcome


def evaluate_run(run_dir: Path, retain_checkpoints: bool = False, show_progress: bool = True, workers: int | None = None,
                 ranks: TorchrunRanks | None = None) -> EvalOutcome:
    """Evaluate a trained run's deferred checkpoints and write its ``run_stop``.

    ``workers`` engines evaluate checkpoints in parallel (default: the config's
    ``evaluation.workers``); results are committed strictly in step order, so the log
    is the same, apart from times, for any number of workers.

    ``ranks``: the torchrun ranks this process joined as rank 0 (``workers`` is then
    their number): they are the workers, instead of ranks launched here.

    A run an evaluator followed during training (``evaluate --follow``; its
    ``eval/mlperf_eval.log`` exists) is continued in that log by one worker, which is then
    merged into the training log (:func:`merge_in_place`, ``mlperf-grpo merge``'s core).

    The checkpoints are kept with ``retain_checkpoints`` (``--retain-checkpoints`` or
    ``RETAIN_GRPO_CHECKPOINTS=1``, resolved once by the caller: ``cli/requests.py``), or
    when the run was started to keep them (``run.json``; a flag can only add keeping).

    Holds the run's lock throughout (one writer per run). Resumable and idempotent:
    evaluations already in the log are not repeated, and a finished run (its
    ``eval/summary.json`` written) is only read back, its files untouched. A run whose
    ``run_stop`` is logged but whose teardown was interrupted has the teardown finished.

    Raises:
        RunDirError, ConfigError: the run directory is not usable (RunLockedError: another
            process is writing to it).
        EvaluationError: the checkpoint series or the log is not evaluable; nothing logged.
        TaskError: the task data is unusable (PromptTooLongError: a validation prompt plus
            ``grpo.max_new_tokens`` exceeds the model's context); nothing logged.
        RefitError: the engine does not hold the checkpoint's weights after a refit.
        VerifierError: the reward function raised or timed out on a checkpoint.
        LogWriteError: the log cannot be appended to.
    """
    run = RunDir(run_dir)
    config, mllog_file = run.load()
    retain = retain_checkpoints or run.retain_recorded()
    workers = config.validation.workers if workers is None else workers
    check_worker_groups(config, None if ranks is None else ranks.world_size)
    if run.follow_log.is_file():
        if workers > 1:
            print(f"note: {run.follow_log} (a follower's log) is continued by one worker, not {workers}", file=sys.stderr)
        with RunLock(run.eval_dir, "evaluator"):  # the one writer of eval/mlperf_eval.log
            return evaluate_series(SeriesRequest(run, RunSeries(run.checkpoints), config, mllog_file, eval_log=run.follow_log,
                                                 merge=True, retain=retain, show_progress=show_progress))
    return evaluate_series(SeriesRequest(run, RunSeries(run.checkpoints), config, mllog_file, retain=retain,
                                         show_progress=show_progress, workers=workers, ranks=ranks))


def merge_in_place(train_log: Path, eval_log: Path) -> None:
    """A followed run's end: ``mlperf-grpo merge --train LOG --eval EVAL_LOG -o LOG``
    (``merge.merge_logs``, which reads only the logs and the run's records).

    Raises:
        MergeError: the logs cannot be merged (named in the message); nothing written.
    """
    try:
        result = merge_logs(train_log, eval_log, train_log)
    except MergeError as err:
        raise MergeError(f"cannot merge {eval_log} into {train_log}: {err}") from None
    print(f"merged {eval_log} into {train_log}: {result.appended} eval line(s) appended")


@dataclass(frozen=True)
class SeriesRequest:
    """An evaluation of any series (:func:`evaluate_series`): ``run`` holds the lock and
    the results (``eval/``); ``mllog_file`` is the training log; evaluations and
    ``run_stop`` are appended to it, or to ``eval_log`` (for ``mlperf-grpo merge``).
    With ``merge`` (``eval_log`` a follower's log), it is merged into the training log
    (:func:`merge_in_place`) once its ``run_stop`` is logged (before the teardown); a
    training log that already has a ``run_stop`` was merged before (or closed by
    training), and ``eval_log`` is then not read. ``retain``: keep the checkpoints
    (resolved once by the caller: flag, environment, run record).
    ``workers`` > 1 (torchrun ranks): ``ranks`` (torchrun's, joined by this process as
    rank 0; any source with a ``rank_spec``, which they rebuild it from) or, without,
    ranks launched here (``run`` a run directory of ours, ``source`` its
    :class:`RunSeries`: the ranks load both from it).
    ``validation``: the caller's task suite and validation tasks (a follower's, loaded
    for its rounds); ``None``: loaded here, once for the whole evaluation."""

    run: RunDir
    source: SeriesSource
    config: RunConfig
    mllog_file: Path
    eval_log: Path | None = None
    merge: bool = False
    retain: bool = False
    show_progress: bool = True
    workers: int = 1
    ranks: TorchrunRanks | None = None
    validation: ValidationSet | None = None


def evaluate_series(request: SeriesRequest) -> EvalOutcome:
    """The lifecycle of :func:`evaluate_run` for any series (:class:`SeriesRequest`).

    Raises: as :func:`evaluate_run`.
    """
    r = request
    run, source, config, mllog_file, eval_log = r.run, r.source, r.config, r.mllog_file, r.eval_log
    check_engine_available(config)  # before the lock or anything else is written
    validation = load_validation_set(config) if r.validation is None else r.validation
    check_prompt_lengths(config, {"validation": validation.tasks}, is_agentic(validation.suite))
    if r.workers > 1 and r.ranks is None:
        prestart_rank_server(RANK_MODULE)  # the ranks' imports run while the series is checked
    with RunLock(run.root, "evaluator"):  # held: no trainer is running, training is over
        if r.merge and _read_checked_log(mllog_file).find(C.RUN_STOP):
            eval_log = None  # merged already
        log = _read_checked_log(mllog_file, eval_log)
        target = config.validation.target_accuracy
        if log.find(C.RUN_STOP):  # a passing step nothing measured is never reported
            check_run_stop_supported(log, target, config.global_batch_size, eval_log or mllog_file)
        if log.find(C.RUN_STOP) and run.summary_file.is_file():
            return read_outcome(run, mllog_file, eval_log)  # finished earlier: report, touch nothing
        if not log.find(C.RUN_STOP):
            if (passed := logged_pass(log, target, eval_log or mllog_file)) is not None:
                _close_at_logged_pass(source, config, eval_log or mllog_file, passed)
            elif _stopped_before_first_checkpoint(run, source, config, log, mllog_file):
                _close_aborted(run, config, eval_log or mllog_file, log)
            else:
                _check_logged_settings(config, log, mllog_file)
                _evaluate_checkpoints(EvalJob(run, source, config, validation), eval_log or mllog_file, log,
                                      r.show_progress, r.workers, r.ranks)
        if r.merge and eval_log is not None:
            merge_in_place(mllog_file, eval_log)
            eval_log = None
        if not r.retain:
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


def _stopped_before_first_checkpoint(run: RunDir, source: SeriesSource, config: RunConfig, log: ParsedLog,
                                     mllog_file: Path) -> bool:
    """True for a run whose training ended before publishing any checkpoint: nothing
    evaluated or published, and the last trained step before the first eval step (no
    checkpoint was due) or at it with ``tmp_step_N/`` left (its write was killed).
    Otherwise a missing series is an error of :func:`check_series` (deleted or moved).

    Raises:
        EvaluationError: training never started (no ``run_start``): nothing to score.
    """
    if source.published_steps() or logged_evals(log):
        return False
    if not log.find(C.RUN_START):
        raise EvaluationError(
            f"{run.root}: training never started (no run_start in {mllog_file}), so the run has nothing to "
            "evaluate or score; delete the directory and train again"
        )
    last, s0 = outcome.last_trained_step(log)[0], config.first_eval_step
    return last < s0 or (last == s0 and (source.root / tmp_step_dir_name(s0)).is_dir())


def _close_aborted(run: RunDir, config: RunConfig, mllog_file: Path, log: ParsedLog) -> None:
    """Write ``run_stop`` aborted at the last trained step and say why (stderr)."""
    step, time_ms = outcome.last_trained_step(log)
    writer = MLLogWriter(mllog_file)
    outcome.log_aborted_run_stop(writer, step, rules.samples_count(step, config.global_batch_size), time_ms)
    writer.commit()
    print(
        f"note: training of {run.root} stopped after step {step}, before its first checkpoint (step "
        f"{config.first_eval_step}); with nothing to evaluate the run is closed: run_stop aborted at step {step}",
        file=sys.stderr,
    )


def _close_at_logged_pass(source: SeriesSource, config: RunConfig, mllog_file: Path, step: int) -> None:
    """Write the ``run_stop`` success a logged pass lacks, at its checkpoint's
    weight-update time (:mod:`~mlperf_grpo.evaluate.logged_result`), and say so.

    Raises:
        EvaluationError: the passing step's checkpoint is gone (its time is unknown).
    """
    passing = next((c for c in source.discover()[0] if c.step == step), None)
    if passing is None:
        raise EvaluationError(f"{mllog_file} logs step {step} passing but no run_stop, and step {step}'s checkpoint (its "
                              f"weight-update time, the run_stop's time) is not in {source.root}: restore it and run "
                              "evaluate again")
    writer = MLLogWriter(mllog_file)
    outcome.commit_evaluations(writer, [], config.global_batch_size, passing)
    print(f"note: {mllog_file} logged step {step} passing without a run_stop; closed it there (run_stop success at "
          "its weight-update time), nothing evaluated", file=sys.stderr)


def _check_logged_settings(config: RunConfig, log: ParsedLog, mllog_file: Path) -> None:
    """The config's seed and validation settings are those the training log recorded
    (``evaluate.settings.LOGGED_KEYS``; a key the log lacks is not compared): the one check
    of them a series from another trainer allows.

    Raises:
        EvaluationError: a value differs; names the config key, both values and the log.
    """
    differences = logged_differences(config, {key: log.first_value(key) for key in LOGGED_KEYS if log.find(key)})
    if differences:
        raise EvaluationError(f"the config's {differences[0]} ({mllog_file}); what evaluation measures cannot change "
                              "after training: evaluate with the settings the run was trained with")


def _teardown(source: SeriesSource, log: ParsedLog) -> None:
    """Delete the checkpoints of a finished run, unless one was never evaluated and the
    run did not pass (a ``run_stop`` aborted written before they were evaluated)."""
    passed = log.find(C.RUN_STOP)[0].metadata.get(C.STATUS) == C.SUCCESS
    evaluated = {step for step, _ in logged_evals(log)}
    unevaluated = [step for step in source.published_steps() if step not in evaluated]
    if unevaluated and not passed:
        print(
            f"note: kept {source.root}: checkpoints {unevaluated} were never evaluated and the log's "
            "run_stop (aborted) was written before they were; delete them yourself if they are not needed",
            file=sys.stderr,
        )
        return
    if (what := source.remove()) is not None:
        print(what, file=sys.stderr)


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
    if not log.events and not log.bad_lines:
        what = "is empty" if mllog_file.stat().st_size == 0 else "holds no MLPerf lines"
        raise EvaluationError(f"the MLPerf log {mllog_file} {what}: training writes its lines there; point run.json "
                              "(or --mllog) at the training's log, or train again")
    if log.bad_lines:
        line_no, reason = log.bad_lines[0]
        raise EvaluationError(f"{mllog_file}:{line_no}: not a valid MLPerf line ({reason}); was a writer killed mid-line? repair the log first")
    if len(log.find(C.RUN_STOP)) > 1:
        raise EvaluationError(f"{mllog_file} already has {len(log.find(C.RUN_STOP))} run_stop lines; it cannot be scored")
    return log


def _evaluate_checkpoints(job: EvalJob, mllog_file: Path, log: ParsedLog, show_progress: bool, workers: int,
                          ranks: TorchrunRanks | None = None) -> None:
    """Evaluate the pending checkpoints with ``workers`` engines and commit in step order
    up to the first pass; one worker runs here, more are torchrun ranks (``ranks``, or
    launched here: :func:`launch`). Workers launched here are no more than the pending
    checkpoints (one at least): a worker beyond them would claim nothing, and ``--workers
    99999`` would start that many engines."""
    plan = plan_evaluation(job.source, job.config, job.validation, log)
    if ranks is None and workers > max(1, len(plan.pending_steps)):
        print(f"note: {len(plan.pending_steps)} checkpoint(s) to evaluate: {max(1, len(plan.pending_steps))} "
              f"worker(s), not {workers}", file=sys.stderr)
        workers = max(1, len(plan.pending_steps))
    try:
        _run_workers(job, mllog_file, plan, show_progress, workers, ranks)
    except EvaluationError:
        _remove_if_nothing_committed(job.run)
        raise


def _remove_if_nothing_committed(run: RunDir) -> None:
    """A refused run (nothing scorable) leaves no ``eval/``: delete it when it holds only
    what the workers wrote for results that were never logged (no ``step_N.jsonl``, no
    summary). Called once every worker has stopped."""
    import shutil

    if run.eval_dir.is_dir() and not any(run.eval_dir.glob("step_*.jsonl")) and not run.summary_file.exists():
        shutil.rmtree(run.eval_dir)


def _run_workers(job: EvalJob, mllog_file: Path, plan: EvalPlan, show_progress: bool, workers: int,
                 ranks: TorchrunRanks | None) -> None:
    """One worker here, or ``workers`` torchrun ranks (``ranks``, or launched here; a
    launched rank is its own process and loads the validation set itself)."""
    run, source, config, validation = job.run, job.source, job.config, job.validation
    if workers == 1:
        engine = EngineAtFirstUse(run, config, validation)
        try:
            evaluate_serially(job, mllog_file, plan, series_by_step(source), engine, show_progress)
        finally:
            engine.close()
        return
    series = None if source == RunSeries(run.checkpoints) else source.rank_spec()
    if ranks is None and series is not None:
        raise EvaluationError("--workers N > 1 evaluates a run directory of ours; evaluate this series with one worker")
    if ranks is None:
        outcome = launch(evaluate_rank, (str(run.root), str(mllog_file), plan, show_progress, time.time()), workers)[0]
    else:  # this process is rank 0 of the ranks torchrun started: they are the workers
        ranks.publish_plan({"run_dir": str(run.root), "mllog_file": str(mllog_file), "plan": asdict(plan), "series": series})
        try:
            outcome = evaluate_rank(str(run.root), str(mllog_file), plan, show_progress, validation=validation,
                                    series=series)
        except BaseException:
            WorkQueue(ranks.store, 0).stop()  # the others claim nothing more
            raise
        finally:
            ranks.wait_ended()  # no rank reads a checkpoint or writes a result past this
    if outcome is not None:
        raise WORKER_ERRORS.get(outcome["error"], RuntimeError)(outcome["message"])
