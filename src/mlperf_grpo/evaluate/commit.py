"""Results into the MLPerf log strictly in step order, whoever evaluated them.

:func:`plan_evaluation` decides what is left to evaluate (:class:`EvalPlan`); workers
write each checkpoint's results to ``eval/unlogged/step_N.jsonl`` and publish them (or
their error) to a work queue; :class:`StepOrderCommitter` takes them in step order,
moves each results file to ``eval/step_N.jsonl`` and commits its ``eval_start`` /
``eval_accuracy`` / ``eval_stop`` (and ``run_stop`` on the first pass, or aborted once
every checkpoint failed) in one write. The log is therefore the same, apart from times,
for any number of workers.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from mlperf_logging.mllog import constants as C  # noqa: N812
from tqdm import tqdm

from mlperf_grpo import rules
from mlperf_grpo.checkpoint import Checkpoint
from mlperf_grpo.config import RunConfig
from mlperf_grpo.evaluate.series import EvaluationError, RefitError, SeriesProblem, SeriesSource
from mlperf_grpo.evaluate.validator import TaskResult
from mlperf_grpo.evaluate.workers import RankFailedError, WorkQueue
from mlperf_grpo.inference.base import SamplingParams
from mlperf_grpo.mllog import MLLogWriter, ParsedLog
from mlperf_grpo.rundir import RunDir
from mlperf_grpo.tasks.scoring import RewardValueError, VerifierError


WORKER_ERRORS: dict[str, type[Exception]] = {"EvaluationError": EvaluationError, "RefitError": RefitError, "VerifierError": VerifierError,
                                       "RewardValueError": RewardValueError, "RankFailedError": RankFailedError}
"""The errors a worker reports as a result (raised again, in step order, by the committer)."""


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


def log_run_stop_at(log: MLLogWriter, status: str, checkpoint: Checkpoint) -> None:
    info = checkpoint.info
    log_run_stop(log, status, checkpoint.step, info.samples_count, info.training_step_end_time_ms)


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
    done = logged_evals(log)
    if [s for s, _ in done] != [c.step for c in checkpoints[: len(done)]]:
        raise EvaluationError(f"the log's evaluations {[s for s, _ in done]} are not a prefix of the checkpoint series")
    usable = checkpoints if problem is None else checkpoints[: problem.index]
    if problem is not None and len(usable) <= len(done):
        raise EvaluationError(unscorable(problem))
    return EvalPlan([c.step for c in usable[len(done):]], problem, checkpoints[-1].step)


def unscorable(problem: SeriesProblem) -> str:
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
                raise WORKER_ERRORS.get(result["error"], RuntimeError)(result["message"])
            self.held.append((step, result))
            self.bar.set_postfix(step=step, acc=f"{result['accuracy']:.3f}", refresh=False)
            self.bar.update(1)
            passing = rules.is_passing(result["accuracy"], self.target)
            if self.plan.problem is None or passing:
                self._commit(step if passing else None)
        if not self.decided:
            if self.plan.problem is not None:
                self.queue.stop()
                raise EvaluationError(unscorable(self.plan.problem))
            if self.plan.final_step is None:  # following a training: later checkpoints may pass
                return False
            log_run_stop_at(self.writer, C.ABORTED, self.checkpoints[self.plan.final_step])
            self.writer.commit()
            self._decide()
        return True

    def _commit(self, passing_step: int | None) -> None:
        for step, result in self.held:
            os.replace(unlogged_results(self.run, step), self.run.eval_dir / f"step_{step}.jsonl")
            log_eval(self.writer, step, self.gbs, result["accuracy"], result["start_ms"], result["stop_ms"])
        if passing_step is not None:
            log_run_stop_at(self.writer, C.SUCCESS, self.checkpoints[passing_step])
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
