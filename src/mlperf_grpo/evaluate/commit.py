"""Results into the MLPerf log strictly in step order, whoever evaluated them.

:func:`plan_evaluation` decides what is left to evaluate (:class:`EvalPlan`); workers
write each checkpoint's results to ``eval/unlogged/step_N.jsonl`` and publish them (or
their error) to a work queue; :class:`StepOrderCommitter` takes them in step order,
moves each results file to ``eval/step_N.jsonl`` and commits its ``eval_start`` /
``eval_accuracy`` / ``eval_stop`` (and ``run_stop`` on the first pass, or aborted once
every checkpoint failed) in one write, as :mod:`mlperf_grpo.evaluate.outcome` decides and writes
them. The log is therefore the same, apart from times, for any number of workers.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from mlperf_logging.mllog import constants as C  # noqa: N812
from tqdm import tqdm

from mlperf_grpo.checkpoint import Checkpoint
from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.config.rundir import RunDir
from mlperf_grpo.evaluate import outcome
from mlperf_grpo.evaluate.launch import WorkQueue
from mlperf_grpo.evaluate.logged_result import check_series_in_log
from mlperf_grpo.evaluate.outcome import Evaluation, SeriesEnd
from mlperf_grpo.evaluate.series import EvaluationError, SeriesProblem, SeriesSource
from mlperf_grpo.evaluate.validator import TaskResult
from mlperf_grpo.evaluate.worker_errors import WORKER_ERRORS
from mlperf_grpo.inference.base import SamplingParams
from mlperf_grpo.logs.mllog import MLLogWriter, ParsedLog
from mlperf_grpo.tasks import ValidationSet


def logged_evals(log: ParsedLog) -> list[tuple[int, float]]:
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


@dataclass(frozen=True)
class EvalPlan:
    """What is left to evaluate: the steps of ``pending`` (after those already logged, up
    to a series fault), the series ``problem`` (results are then held until a pass), and
    the final checkpoint's step (its time is an aborted ``run_stop``'s; ``None`` while
    training still runs: the series may grow, so no aborted ``run_stop`` is written)."""

    pending_steps: list[int]
    problem: SeriesProblem | None
    final_step: int | None


def plan_evaluation(source: SeriesSource, config: RunConfig, validation: ValidationSet, log: ParsedLog) -> EvalPlan:
    """Discover and check the series (notes to stderr; ``validation``: the run's, for the
    settings check) and decide what to evaluate.

    Raises:
        EvaluationError: nothing can be evaluated, the log is not a prefix of the series,
            or a checkpoint's weight-update time is not within its step's training in the
            log (the series is another run's: :func:`check_series_in_log`).
    """
    checkpoints, ignored, problem = source.discover()
    for path in ignored:
        print(f"note: ignoring unfinished checkpoint {path} (never evaluated)", file=sys.stderr)
    notes, series_problem = source.check(checkpoints, config, validation, log) if checkpoints or problem is None else ([], None)
    if problem is None or (series_problem is not None and series_problem.index < problem.index):
        problem = series_problem
    if problem is not None and not checkpoints:
        raise EvaluationError(problem.message)
    check_series_in_log(checkpoints if problem is None else checkpoints[: problem.index], log, config.global_batch_size)
    for note in notes:
        print(note, file=sys.stderr)
    done = logged_evals(log)
    if [s for s, _ in done] != [c.step for c in checkpoints[: len(done)]]:
        raise EvaluationError(f"the log's evaluations {[s for s, _ in done]} are not a prefix of the checkpoint series")
    usable = checkpoints if problem is None else checkpoints[: problem.index]
    if problem is not None and len(usable) <= len(done):
        raise EvaluationError(unscorable(problem))
    return EvalPlan([c.step for c in usable[len(done):]], problem, checkpoints[-1].step)


def unscorable(problem: SeriesProblem) -> str:
    """The one-line error when a series problem (a missing or damaged checkpoint) comes
    before any checkpoint passed: the run cannot be scored, and how to recover."""
    return (f"{problem.message}; no checkpoint before it passed, so the run cannot be scored past it "
            "(nothing was logged for the checkpoints evaluated): restore the checkpoint from a copy and run "
            "evaluate again, or train again")


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
        self.held: list[Evaluation] = []
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
                raise WORKER_ERRORS.get(result["error"], RuntimeError)(result["message"])
            self.held.append(Evaluation(step, result["accuracy"], result["start_ms"], result["stop_ms"]))
            self.bar.set_postfix(step=step, acc=f"{result['accuracy']:.3f}", refresh=False)
            self.bar.update(1)
            decision = outcome.decide_result(result["accuracy"], self.target, self.plan.problem is not None)
            if decision.commit:
                self._commit(step if decision.passed else None)
        if not self.decided:
            end = outcome.decide_end(self.plan.problem is not None, self.plan.final_step)
            if end is SeriesEnd.UNSCORABLE:
                self.queue.stop()
                raise EvaluationError(unscorable(self.plan.problem))
            if end is SeriesEnd.WAIT:  # following a training: later checkpoints may pass
                return False
            outcome.commit_aborted_at(self.writer, self.checkpoints[self.plan.final_step])
            self._decide()
        return True

    def _commit(self, passing_step: int | None) -> None:
        for evaluation in self.held:  # each results file in place before its log lines
            os.replace(unlogged_results(self.run, evaluation.step), self.run.eval_dir / f"step_{evaluation.step}.jsonl")
        passing = None if passing_step is None else self.checkpoints[passing_step]
        outcome.commit_evaluations(self.writer, self.held, self.gbs, passing)  # one write
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
