"""Direct tests of the run's outcome (outcome.py) and of the step-order committer
(evaluate/commit.py): the pass/aborted decision and the order of the lines written."""

from types import SimpleNamespace

import pytest
from mlperf_logging.mllog import constants as C  # noqa: N812

from mlperf_grpo.config.load import load_config
from mlperf_grpo.config.rundir import RunDir
from mlperf_grpo.evaluate import outcome
from mlperf_grpo.evaluate.commit import EvalPlan, StepOrderCommitter, unlogged_results
from mlperf_grpo.evaluate.launch import local_queue
from mlperf_grpo.evaluate.outcome import Evaluation, SeriesEnd
from mlperf_grpo.evaluate.series import EvaluationError, SeriesProblem
from mlperf_grpo.logs.mllog import MLLogWriter, read_log

GBS = 16


def _checkpoint(step: int, update_ms: int):
    """What the outcome reads of a checkpoint: its step and training_info.json's two fields."""
    return SimpleNamespace(step=step, info=SimpleNamespace(samples_count=step * GBS, training_step_end_time_ms=update_ms))


def _lines(path):
    return [(e.key, e.metadata.get("step"), e.time_ms) for e in read_log(path).events]


@pytest.mark.parametrize("accuracy, fault, commit, passed", [
    (0.5, False, True, False),  # at the target is not a pass (strictly above)
    (0.5000001, False, True, True),
    (0.2, True, False, False),  # a series fault holds results until one passes
    (0.9, True, True, True),
])
def test_a_result_is_committed_unless_a_series_fault_holds_it(accuracy, fault, commit, passed):
    assert outcome.decide_result(accuracy, 0.5, fault) == outcome.ResultDecision(commit, passed)


def test_the_end_without_a_pass():
    assert outcome.decide_end(series_fault=True, final_step=5) is SeriesEnd.UNSCORABLE
    assert outcome.decide_end(series_fault=False, final_step=None) is SeriesEnd.WAIT
    assert outcome.decide_end(series_fault=False, final_step=5) is SeriesEnd.ABORTED


def test_a_pass_is_committed_after_its_evaluations_backdated_to_the_weight_update(tmp_path):
    log = tmp_path / "mlperf.log"
    evaluations = [Evaluation(2, 0.25, 1000, 1500), Evaluation(3, 0.75, 1600, 2100)]
    outcome.commit_evaluations(MLLogWriter(log), evaluations, GBS, passing=_checkpoint(3, 900))
    assert _lines(log) == [
        (C.EVAL_START, 2, 1000), (C.EVAL_ACCURACY, 2, 1500), (C.EVAL_STOP, 2, 1500),
        (C.EVAL_START, 3, 1600), (C.EVAL_ACCURACY, 3, 2100), (C.EVAL_STOP, 3, 2100),
        (C.RUN_STOP, 3, 900),
    ]
    stop = read_log(log).find(C.RUN_STOP)[0]
    assert stop.metadata[C.STATUS] == C.SUCCESS and stop.metadata[C.SAMPLES_COUNT] == 3 * GBS
    assert [e.metadata[C.SAMPLES_COUNT] for e in read_log(log).find(C.EVAL_ACCURACY)] == [2 * GBS, 3 * GBS]


def test_aborted_run_stops(tmp_path):
    log = tmp_path / "mlperf.log"
    outcome.commit_aborted_at(MLLogWriter(log), _checkpoint(4, 700))
    writer = MLLogWriter(log)
    outcome.log_aborted_run_stop(writer, 1, 16, 300)
    writer.commit()
    stops = read_log(log).find(C.RUN_STOP)
    assert [(s.metadata[C.STATUS], s.metadata["step"], s.metadata[C.SAMPLES_COUNT], s.time_ms) for s in stops] == [
        (C.ABORTED, 4, 64, 700), (C.ABORTED, 1, 16, 300)]


def test_an_inline_pass_stops_at_the_evaluations_end(tmp_path):
    log = tmp_path / "mlperf.log"
    assert not outcome.commit_inline_evaluation(MLLogWriter(log), Evaluation(1, 0.1, 10, 20), GBS, target=0.5)
    assert outcome.commit_inline_evaluation(MLLogWriter(log), Evaluation(2, 0.6, 30, 40), GBS, target=0.5)
    assert _lines(log)[-1] == (C.RUN_STOP, 2, 40)
    assert len(read_log(log).find(C.RUN_STOP)) == 1


def _committer(tmp_path, steps, problem=None, final_step=None):
    run = RunDir(tmp_path / "run")
    config = load_config(None)
    gbs = config.global_batch_size
    checkpoints = {s: SimpleNamespace(step=s, info=SimpleNamespace(samples_count=s * gbs, training_step_end_time_ms=100 * s))
                   for s in steps}
    queue = local_queue(len(steps))
    plan = EvalPlan(list(steps), problem, steps[-1] if final_step is None else final_step)
    for s in steps:
        unlogged_results(run, s).parent.mkdir(parents=True, exist_ok=True)
        unlogged_results(run, s).write_text("{}\n")
    return run, queue, StepOrderCommitter(run, config, tmp_path / "mlperf.log", plan, checkpoints, queue, False)


def _result(accuracy, step):
    return {"accuracy": accuracy, "start_ms": 1000 * step, "stop_ms": 1000 * step + 500}


def test_the_committer_logs_in_step_order_whatever_order_results_arrive(tmp_path):
    run, queue, committer = _committer(tmp_path, [2, 3, 4])
    queue.publish(1, _result(0.1, 3))  # step 3 is in before step 2
    assert committer.advance(block=False) is False
    assert not (tmp_path / "mlperf.log").exists() or not read_log(tmp_path / "mlperf.log").events
    queue.publish(0, _result(0.2, 2))
    queue.publish(2, _result(0.1, 4))
    assert committer.advance(block=False) is True  # none passed, the final checkpoint is in: aborted
    assert [(k, s) for k, s, _ in _lines(tmp_path / "mlperf.log") if k in (C.EVAL_ACCURACY, C.RUN_STOP)] == [
        (C.EVAL_ACCURACY, 2), (C.EVAL_ACCURACY, 3), (C.EVAL_ACCURACY, 4), (C.RUN_STOP, 4)]
    stop = read_log(tmp_path / "mlperf.log").find(C.RUN_STOP)[0]
    assert stop.metadata[C.STATUS] == C.ABORTED and stop.time_ms == 400
    assert sorted(p.name for p in run.eval_dir.glob("step_*.jsonl")) == ["step_2.jsonl", "step_3.jsonl", "step_4.jsonl"]


def test_the_committer_stops_at_the_first_pass_and_leaves_later_results_unlogged(tmp_path):
    run, queue, committer = _committer(tmp_path, [2, 3, 4])
    target = load_config(None).validation.target_accuracy
    for i, (acc, step) in enumerate([(0.0, 2), (min(1.0, target + 0.1), 3), (1.0, 4)]):
        queue.publish(i, _result(acc, step))
    assert committer.advance(block=False) is True
    assert queue.stopped()
    assert [(k, s, t) for k, s, t in _lines(tmp_path / "mlperf.log")][-1] == (C.RUN_STOP, 3, 300)
    assert unlogged_results(run, 4).is_file() and not (run.eval_dir / "step_4.jsonl").exists()


def test_with_a_series_fault_results_are_held_and_none_passing_logs_nothing(tmp_path):
    run, queue, committer = _committer(tmp_path, [2, 3], problem=SeriesProblem(2, "checkpoint step_4: gone"))
    queue.publish(0, _result(0.0, 2))
    queue.publish(1, _result(0.0, 3))
    with pytest.raises(EvaluationError, match="step_4: gone; no checkpoint before it passed"):
        committer.advance(block=False)
    assert not (tmp_path / "mlperf.log").exists() or not read_log(tmp_path / "mlperf.log").events


def test_following_a_training_no_aborted_run_stop_is_written(tmp_path):
    run, queue, committer = _committer(tmp_path, [2], final_step=None)
    committer.plan = EvalPlan([2], None, None)
    queue.publish(0, _result(0.0, 2))
    assert committer.advance(block=False) is False
    assert not read_log(tmp_path / "mlperf.log").find(C.RUN_STOP)
