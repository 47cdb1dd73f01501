"""Direct tests of evaluate/commit.py beyond the committer's order (tests/evaluate/test_outcome.py):
what :func:`plan_evaluation` leaves to evaluate for a series and a log, the results file
:func:`write_results` writes, the log's evaluations :func:`logged_evals` reads, and a
worker's error raised again, as its own type, in step order."""

import json
from types import SimpleNamespace

import pytest

from mlperf_grpo.config.load import load_config
from mlperf_grpo.config.rundir import RunDir
from mlperf_grpo.evaluate import outcome
from mlperf_grpo.evaluate.commit import (
    EvalPlan,
    StepOrderCommitter,
    logged_evals,
    plan_evaluation,
    unlogged_results,
    write_results,
)
from mlperf_grpo.evaluate.launch import local_queue
from mlperf_grpo.evaluate.outcome import Evaluation
from mlperf_grpo.evaluate.series import EvaluationError, RefitError, SeriesProblem
from mlperf_grpo.evaluate.validator import TaskResult
from mlperf_grpo.evaluate.worker_errors import WORKER_ERRORS
from mlperf_grpo.inference.base import SamplingParams
from mlperf_grpo.logs.mllog import MLLogWriter, read_log
from mlperf_grpo.tasks.scoring import VerifierError

CONFIG = load_config(None)
GBS = CONFIG.global_batch_size


def _checkpoint(step):
    return SimpleNamespace(step=step, info=SimpleNamespace(samples_count=step * GBS, training_step_end_time_ms=100 * step))


class Source:
    """A series source with the given discovery and check results; records its calls."""

    def __init__(self, steps, ignored=(), discover_problem=None, check_problem=None, notes=()):
        self.checkpoints = [_checkpoint(s) for s in steps]
        self.ignored, self.discover_problem = list(ignored), discover_problem
        self.check_problem, self.notes = check_problem, list(notes)
        self.checked = []

    def discover(self):
        return list(self.checkpoints), self.ignored, self.discover_problem

    def check(self, checkpoints, config, validation, log):
        self.checked.append([c.step for c in checkpoints])
        return self.notes, self.check_problem


def _log(tmp_path, evaluated):
    """A log holding the eval triples of ``evaluated`` (step -> accuracy), in that order."""
    path = tmp_path / "mlperf.log"
    outcome.commit_evaluations(MLLogWriter(path), [Evaluation(s, a, 10 * s, 10 * s + 5) for s, a in evaluated.items()],
                               GBS, passing=None)
    return read_log(path)


def test_a_clean_series_leaves_every_checkpoint_after_those_logged(tmp_path):
    source = Source([18, 19, 20, 21])
    log = _log(tmp_path, {18: 0.25, 19: 0.5})
    assert logged_evals(log) == [(18, 0.25), (19, 0.5)]
    assert plan_evaluation(source, CONFIG, None, log) == EvalPlan([20, 21], None, 21)
    assert source.checked == [[18, 19, 20, 21]]


def test_an_empty_log_leaves_the_whole_series(tmp_path):
    assert plan_evaluation(Source([18, 19]), CONFIG, None, _log(tmp_path, {})) == EvalPlan([18, 19], None, 19)


def test_a_log_that_is_not_a_prefix_of_the_series_is_refused(tmp_path):
    with pytest.raises(EvaluationError, match=r"the log's evaluations \[19\] are not a prefix of the checkpoint series"):
        plan_evaluation(Source([18, 19, 20]), CONFIG, None, _log(tmp_path, {19: 0.5}))


def test_the_earlier_of_two_problems_cuts_the_series(tmp_path):
    """Discovery finds the 4th checkpoint unreadable, the check a fault at the 2nd: only
    the 1st is evaluated, the check's problem held; the other way round, the first three."""
    unreadable, fault = SeriesProblem(3, "step_21: unreadable"), SeriesProblem(1, "step_19: time not increasing")
    log = _log(tmp_path, {})
    steps = [18, 19, 20]  # discovery returns the readable checkpoints before the unreadable one
    assert plan_evaluation(Source(steps, discover_problem=unreadable, check_problem=fault), CONFIG, None, log) == EvalPlan(
        [18], fault, 20)
    late = SeriesProblem(3, "gap: missing step_21")
    assert plan_evaluation(Source(steps, discover_problem=unreadable, check_problem=late), CONFIG, None, log) == EvalPlan(
        [18, 19, 20], unreadable, 20)


def test_nothing_readable_is_refused_with_the_problem_and_no_check(tmp_path):
    source = Source([], discover_problem=SeriesProblem(0, "step_18/training_info.json is missing"))
    with pytest.raises(EvaluationError, match=r"^step_18/training_info.json is missing$"):
        plan_evaluation(source, CONFIG, None, _log(tmp_path, {}))
    assert source.checked == []


def test_a_problem_right_after_the_logged_evaluations_is_unscorable(tmp_path):
    """Everything before the fault is logged and none passed: nothing is left to evaluate."""
    source = Source([18, 19, 20], check_problem=SeriesProblem(2, "gap: missing step_20"))
    with pytest.raises(EvaluationError) as caught:
        plan_evaluation(source, CONFIG, None, _log(tmp_path, {18: 0.1, 19: 0.2}))
    assert str(caught.value) == (
        "gap: missing step_20; no checkpoint before it passed, so the run cannot be scored past it (nothing was "
        "logged for the checkpoints evaluated): restore the checkpoint from a copy and run evaluate again, or train again")


def test_notes_and_ignored_directories_go_to_stderr(tmp_path, capsys):
    source = Source([18], ignored=[tmp_path / "tmp_step_19"], notes=["note: training was killed"])
    plan_evaluation(source, CONFIG, None, _log(tmp_path, {}))
    assert capsys.readouterr().err.splitlines() == [
        f"note: ignoring unfinished checkpoint {tmp_path / 'tmp_step_19'} (never evaluated)", "note: training was killed"]


def test_results_file_is_its_header_then_one_line_per_task(tmp_path):
    run = RunDir(tmp_path / "run")
    results = [TaskResult("t0", "1+1=", "2", ["2", "3"], [1.0, 0.0]), TaskResult("t1", "2+2=", "4", ["5", "6"], [0.0, 0.0])]
    params = SamplingParams(0.1, 0.95, 8)
    write_results(run, 18, results, params, seed=7, engine={"model": "m"}, refit_check="fingerprint+canary")
    lines = [json.loads(line) for line in (run.eval_dir / "step_18.jsonl").read_text().splitlines()]
    assert lines == [
        {"step": 18, "sampling": {"temperature": 0.1, "top_p": 0.95, "max_new_tokens": 8}, "seed": 7,
         "engine": {"model": "m"}, "refit_check": "fingerprint+canary"},
        {"task_id": "t0", "prompt": "1+1=", "answer": "2", "completions": ["2", "3"], "rewards": [1.0, 0.0]},
        {"task_id": "t1", "prompt": "2+2=", "answer": "4", "completions": ["5", "6"], "rewards": [0.0, 0.0]},
    ]
    path = unlogged_results(run, 19)  # elsewhere, without a refit check: no such field; no temporary file left
    write_results(run, 19, results[:1], params, seed=7, engine={}, path=path)
    assert "refit_check" not in json.loads(path.read_text().splitlines()[0])
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_19.jsonl"]


@pytest.mark.parametrize("error", sorted(WORKER_ERRORS))
def test_a_workers_error_is_raised_again_in_step_order_after_the_results_before_it(tmp_path, error):
    run = RunDir(tmp_path / "run")
    queue = local_queue(2)
    committer = StepOrderCommitter(run, CONFIG, tmp_path / "mlperf.log", EvalPlan([18, 19], None, 19),
                                   {s: _checkpoint(s) for s in (18, 19)}, queue, show_progress=False)
    unlogged_results(run, 18).parent.mkdir(parents=True)
    unlogged_results(run, 18).write_text("{}\n")
    queue.publish(1, {"error": error, "message": "step_19: the engine's weights differ"})
    assert committer.advance(block=False) is False and not queue.stopped()  # step 18 first
    queue.publish(0, {"accuracy": 0.0, "start_ms": 1, "stop_ms": 2})
    with pytest.raises(WORKER_ERRORS[error], match="^step_19: the engine's weights differ$"):
        committer.advance(block=False)
    assert queue.stopped()
    assert [(e.key, e.metadata["step"]) for e in read_log(tmp_path / "mlperf.log").events] == [
        ("eval_start", 18), ("eval_accuracy", 18), ("eval_stop", 18)]


def test_the_worker_errors_are_the_evaluators_own():
    assert WORKER_ERRORS["RefitError"] is RefitError and WORKER_ERRORS["VerifierError"] is VerifierError
    assert all(name == cls.__name__ for name, cls in WORKER_ERRORS.items())
