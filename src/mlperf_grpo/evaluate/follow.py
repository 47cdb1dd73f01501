"""Follow a running training: evaluate each checkpoint as it is published.

Reads top to bottom like the lifecycle it runs::

    wait for the run (a trainer in setup holds its lock before run.json exists)
    training already over, nothing followed: evaluate it as 'evaluate' does
    hold eval/.lock (the one writer of eval/mlperf_eval.log) and, while the trainer holds the run:
        new step_N/ published: plan the checkpoints not yet logged (reading the files only
            of checkpoints no earlier round checked), evaluate them in step order with one
            engine (kept across rounds), commit to eval/mlperf_eval.log
        a pass committed: run_stop (success, backdated) in eval/mlperf_eval.log;
            --stop-training-at-pass: write stop_training.json, the trainer stops after its step
    training ended (its lock released): evaluate what is left (none passed: run_stop
        aborted at the final checkpoint), merge eval/mlperf_eval.log into the training log
        (mlperf-grpo merge), teardown, eval/summary.json  -- offline.evaluate_series

The training log is the trainer's until it ends, so the follower's events go to its own
log; the merged log is the one train-then-evaluate writes, apart from times. A killed
follower is resumed by ``evaluate --follow`` again, or by a plain ``evaluate`` once
training ended (it continues ``eval/mlperf_eval.log`` and merges it). One engine
evaluates: checkpoints arrive one per training step, and ``--workers N`` applies to a
finished run.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from mlperf_logging.mllog import constants as C  # noqa: N812

from mlperf_grpo.checkpoint import Checkpoint
from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.config.rundir import RunDir, RunDirError, RunLock, RunLockedError
from mlperf_grpo.evaluate.commit import plan_evaluation
from mlperf_grpo.evaluate.offline import EvalOutcome, SeriesRequest, evaluate_run, evaluate_series
from mlperf_grpo.evaluate.serial import evaluate_serially
from mlperf_grpo.evaluate.series import EvalJob, RunSeries, SeriesProblem, check_series
from mlperf_grpo.evaluate.worker_group import check_worker_groups
from mlperf_grpo.inference.base import InferenceEngine
from mlperf_grpo.inference.factory import build_engine, check_engine_available
from mlperf_grpo.logs.mllog import ParsedLog, now_ms, parse_log_text
from mlperf_grpo.tasks import ValidationSet, load_validation_set

POLL_S = 1.0
"""Seconds between looks at the checkpoint directory and the run's lock."""


START_WAIT_S = 300.0
"""Seconds ``--follow`` waits for a training to create a run directory that does not exist yet."""
EMPTY_WAIT_S = 10.0
"""Seconds ``--follow`` waits on a directory that exists and is empty: a trainer that made
it writes its lock there at once, so a longer wait only delays the error."""


def follow_run(run_dir: Path, retain_checkpoints: bool = False, stop_training_at_pass: bool = False,
               show_progress: bool = True, poll_s: float = POLL_S) -> EvalOutcome:
    """Evaluate a run's checkpoints while its training runs; finish it once training ended.

    Args:
        run_dir: the ``--output`` of a ``train`` that is running (or has run).
        retain_checkpoints: keep the checkpoints (``--retain-checkpoints`` or
            ``RETAIN_GRPO_CHECKPOINTS=1``, resolved by the caller; also
            the run's recorded choice, ``run.json``);
            they are deleted, as by ``evaluate``, only after training ended.
        stop_training_at_pass: at a committed pass write ``stop_training.json``: the
            trainer stops after the step it is on and writes no ``run_stop``.
        poll_s: seconds between looks for new checkpoints and for the trainer's end.
    Returns:
        The outcome, read back from the merged training log.
    Raises:
        RunDirError: no run at ``run_dir`` and no trainer setting one up there
            (RunLockedError: another evaluator writes to the run).
        EvaluationError, RefitError, VerifierError, LogWriteError: as :func:`evaluate_run`.
    """
    run = RunDir(Path(run_dir))
    config, mllog_file = _wait_for_run(run, poll_s)
    retain = retain_checkpoints or run.retain_recorded()
    check_engine_available(config)
    check_worker_groups(config, None)  # one worker of one rank: a tensor-parallel engine is refused
    if not _trainer_running(run) and not run.follow_log.is_file():
        print(f"note: the training of {run.root} has ended; evaluating it as 'mlperf-grpo evaluate' does", file=sys.stderr)
        return evaluate_run(run.root, retain_checkpoints=retain, show_progress=show_progress)
    run.eval_dir.mkdir(parents=True, exist_ok=True)
    with RunLock(run.eval_dir, "follower"):  # the one writer of eval/mlperf_eval.log
        run.follow_log.touch()  # marks the run followed: a later 'evaluate' continues this log
        validation = load_validation_set(config)  # once for every round and the final evaluation
        _follow(run, config, validation, mllog_file, stop_training_at_pass, show_progress, poll_s)
        return evaluate_series(SeriesRequest(run, RunSeries(run.checkpoints), config, mllog_file, eval_log=run.follow_log,
                                             merge=True, retain=retain, show_progress=show_progress, validation=validation))


def _follow(run: RunDir, config: RunConfig, validation: ValidationSet, mllog_file: Path, stop_training_at_pass: bool,
            show_progress: bool, poll_s: float) -> None:
    """Evaluate newly published checkpoints until the trainer has ended; after a pass only
    wait (asking the trainer to stop, with ``stop_training_at_pass``)."""
    engine: InferenceEngine | None = None
    passing_step = _passing_step(_live_log(mllog_file, run.follow_log))  # a resumed follower may have passed
    seen: list[int] | None = None
    source = LiveSeries(run.checkpoints)  # kept across rounds: what it checked once is not read again
    try:
        while _trainer_running(run):
            if passing_step is not None:
                if stop_training_at_pass and run.training_stop_request() is None:
                    run.request_training_stop(passing_step, now_ms())
                    print(f"note: step_{passing_step} passed; asked the trainer to stop after its current step "
                          f"({run.stop_request_file})", file=sys.stderr)
            elif (steps := run.published_steps()) != seen:
                seen = steps
                if steps:
                    engine = engine or build_engine(config, batch_size=config.validation.batch_size)
                    _evaluate_published(run, config, validation, mllog_file, engine, source, show_progress)
                    passing_step = _passing_step(_live_log(mllog_file, run.follow_log))
                    if passing_step is not None:  # nothing more to evaluate: free the device now
                        engine.close()
                        engine = None
                continue  # look again at once: more may have been published meanwhile
            time.sleep(poll_s)
    finally:
        if engine is not None:
            engine.close()


def _evaluate_published(run: RunDir, config: RunConfig, validation: ValidationSet, mllog_file: Path, engine: InferenceEngine,
                        source: LiveSeries, show_progress: bool) -> None:
    """One round: evaluate the published checkpoints not yet logged, commit them in step
    order to the follower's log, up to a pass (its ``run_stop``); never an aborted one."""
    plan = replace(plan_evaluation(source, config, validation, _live_log(mllog_file, run.follow_log)), final_step=None)
    if not plan.pending_steps:
        return
    checkpoints = {c.step: c for c in source.discover()[0]}
    evaluate_serially(EvalJob(run, source, config, validation), run.follow_log, plan, checkpoints, lambda: engine,
                      show_progress)


@dataclass(frozen=True)
class LiveSeries(RunSeries):
    """Our trainer's series while it is still written: ``tmp_step_N/`` are the writes in
    flight (not reported), and the end of the series is not checked (training has not
    ended; :func:`~mlperf_grpo.evaluate.series.check_series` reports that fault, and its
    notes, at index ``len(checkpoints)``); every other check is the offline one, and a
    checkpoint's files (and ``model.path``'s) are read by the first round that checks it
    only (``files_checked``: a published ``step_N/`` appears by an atomic rename and
    never changes)."""

    files_checked: set[Path] = field(default_factory=set, compare=False)

    def discover(self) -> tuple[list[Checkpoint], list[Path], SeriesProblem | None]:
        checkpoints, _in_flight, problem = super().discover()
        return checkpoints, [], problem

    def check(self, checkpoints: list[Checkpoint], config: RunConfig, validation: ValidationSet,
              log: ParsedLog) -> tuple[list[str], SeriesProblem | None]:
        _notes, problem = check_series(checkpoints, config, validation, log, self.root, self.files_checked)
        return [], None if problem is not None and problem.index == len(checkpoints) else problem


def _live_log(mllog_file: Path, follow_log: Path) -> ParsedLog:
    """The training log's complete lines (the trainer may be mid-write) followed by the
    follower's own log."""
    text = mllog_file.read_bytes().decode("utf-8", errors="replace")
    text = text[: text.rfind("\n") + 1]
    if follow_log.is_file():
        text += follow_log.read_bytes().decode("utf-8", errors="replace")
    return parse_log_text(text)


def _passing_step(log: ParsedLog) -> int | None:
    """The step of a successful ``run_stop`` in ``log``, else ``None``."""
    stops = [e for e in log.find(C.RUN_STOP) if e.metadata.get(C.STATUS) == C.SUCCESS]
    return stops[0].metadata.get("step") if stops else None


def _trainer_running(run: RunDir) -> bool:
    """True while the run's lock is held by its trainer (the kernel releases it when the
    trainer exits, even on SIGKILL). Probing takes the lock for an instant when it is free.

    Raises:
        RunLockedError: another evaluator holds the run.
    """
    try:
        with RunLock(run.root, "follower"):
            return False
    except RunLockedError:
        holder = (run.root / ".lock").read_text(errors="replace")
        if holder.startswith("the trainer") or not holder:  # empty: the trainer is writing its name
            return True
        raise


def _wait_for_run(run: RunDir, poll_s: float) -> tuple[RunConfig, Path]:
    """The run's config and log path, waiting while a trainer sets the run up, and up to
    :data:`START_WAIT_S` for one to create it (a trainer checks its model and data before
    it creates its ``--output``, so ``train ... & evaluate --follow`` starts first), or
    :data:`EMPTY_WAIT_S` for one to take an existing empty directory.

    Raises:
        RunDirError: no run there, no trainer holding its lock, and none created it in
            time (or the path is not an empty or absent directory).
    """
    empty = run.root.is_dir() and not any(run.root.iterdir())  # a trainer's just made, or the user's
    wait_s = EMPTY_WAIT_S if empty else START_WAIT_S
    deadline = time.monotonic() + wait_s
    noted = False
    while True:
        try:
            return run.load()
        except RunDirError as err:
            if not ((run.root / ".lock").is_file() and _trainer_running(run)):
                not_yet = not run.root.exists() or (run.root.is_dir() and not any(run.root.iterdir()))
                if not not_yet or time.monotonic() >= deadline:
                    waited = f" (waited {wait_s:.0f} s)" if not_yet else ""
                    raise RunDirError(f"--follow: {err}{waited}; start 'mlperf-grpo train --output {run.root}' "
                                      "first, then follow it") from None
                if not noted:
                    what = f"start in the empty folder {run.root}" if empty else f"create {run.root}"
                    print(f"note: waiting up to {wait_s:.0f} s for a training to {what}", file=sys.stderr)
                    noted = True
        time.sleep(poll_s)
