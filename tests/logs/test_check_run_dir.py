"""`check` against the run directory at hand: every logged eval_accuracy is pass@k of the
rewards in `eval/step_N.jsonl`, run_stop is the passing step's weight-update time, and
block_start/block_stop pair up. Forged logs beside a real run are not clean."""

import copy
import json
import shutil

import pytest
from logtools_helpers import find, live_run, real_run, synth, to_text

from mlperf_grpo import rules
from mlperf_grpo.logs.check import check_log, lint_text

PREFIX = ":::MLLOG "


def events_of(path):
    return [json.loads(ln[len(PREFIX):]) for ln in path.read_text().splitlines()]


def rewritten(run, events):
    (run / "mlperf.log").write_text(to_text(events))
    return check_log(run / "mlperf.log")


def rules_of(report):
    return {f.rule for f in report.findings}


def stored_pass_at_k(path):
    """pass@k of a results file, computed here from its task lines (not by the checker's reader)."""
    tasks = [json.loads(ln)["rewards"] for ln in path.read_text().splitlines()[1:] if ln.strip()]
    return sum(any(r > 0 for r in rewards) for rewards in tasks) / len(tasks)


def test_the_real_run_is_clean_and_its_stored_result_matches():
    run = real_run()
    report = check_log(run / "mlperf.log")
    assert report.clean, report.findings
    logged = events_of(run / "mlperf.log")[find(events_of(run / "mlperf.log"), "eval_accuracy", 23)]["value"]
    assert logged == stored_pass_at_k(run / "eval" / "step_23.jsonl") == 175 / 251
    assert any(n.startswith("eval_accuracy not recomputed for step(s) 18, 19, 20, 21, 22") for n in report.notes)


def test_results_of_an_evaluation_of_the_checkpoints_folder_are_found_there():
    # evaluate --checkpoints RUN/checkpoints writes its results to RUN/checkpoints/eval/
    run = real_run()
    (run / "checkpoints").mkdir(exist_ok=True)
    (run / "eval").rename(run / "checkpoints" / "eval")
    report = check_log(run / "mlperf.log")
    assert report.clean, report.findings
    assert any(n.startswith("eval_accuracy not recomputed for step(s) 18, 19, 20, 21, 22: no step_N.jsonl for them "
                            f"in {run.resolve() / 'checkpoints' / 'eval'}") for n in report.notes), report.notes
    events = events_of(run / "mlperf.log")
    events[find(events, "eval_accuracy", 23)]["value"] = 0.72  # the stored rewards there give 175 / 251
    [f] = [f for f in rewritten(run, events).findings if f.rule == "eval-results"]
    assert "0.72 of step 23 is not 0.6972111553784861" in f.problem and "checkpoints/eval/step_23.jsonl" in f.problem


def test_results_split_between_both_folders_are_all_checked():
    # an evaluation of RUN stopped after some steps, resumed with --checkpoints RUN/checkpoints:
    # the steps it committed first stay in RUN/eval/, the others go to RUN/checkpoints/eval/
    run = real_run()
    moved = run / "checkpoints" / "eval"
    moved.mkdir(parents=True)
    shutil.copy(run / "eval" / "step_23.jsonl", run / "eval" / "step_99.jsonl")  # a step RUN/eval/ keeps
    (run / "eval" / "step_23.jsonl").rename(moved / "step_23.jsonl")
    assert check_log(run / "mlperf.log").clean
    events = events_of(run / "mlperf.log")
    events[find(events, "eval_accuracy", 23)]["value"] = 0.72
    [f] = [f for f in rewritten(run, events).findings if f.rule == "eval-results"]
    assert "0.72 of step 23 is not 0.6972111553784861" in f.problem and "checkpoints/eval/step_23.jsonl" in f.problem


def test_a_step_with_other_results_in_the_other_folder_is_a_finding():
    run = real_run()
    (run / "checkpoints" / "eval").mkdir(parents=True)
    lines = (run / "eval" / "step_23.jsonl").read_text().splitlines()
    task = json.loads(lines[1])
    lines[1] = json.dumps({**task, "rewards": [0.0] * len(task["rewards"]) if any(task["rewards"]) else [1.0]})
    (run / "checkpoints" / "eval" / "step_23.jsonl").write_text("\n".join(lines) + "\n")
    report = check_log(run / "mlperf.log")
    [f] = [f for f in report.findings if f.rule == "eval-results"]
    assert "cannot be recomputed" in f.problem and "holds other results for the same step" in f.problem


def test_an_edited_accuracy_is_a_finding():
    run = real_run()
    events = events_of(run / "mlperf.log")
    i = find(events, "eval_accuracy", 23)
    events[i]["value"] = 0.72  # still a pass, but not what step 23's rewards give
    report = rewritten(run, events)
    assert not report.clean
    [f] = [f for f in report.findings if f.rule == "eval-results"]
    assert f.line == i + 1 and "0.72 of step 23 is not 0.6972111553784861" in f.problem and "251 tasks" in f.problem


def test_results_that_cannot_give_an_accuracy_are_a_finding():
    run = real_run()
    path = run / "eval" / "step_23.jsonl"
    lines = path.read_text().splitlines()
    lines[5] = json.dumps({**json.loads(lines[5]), "rewards": [None, 1.0]})
    path.write_text("\n".join(lines) + "\n")
    report = check_log(run / "mlperf.log")
    [f] = [f for f in report.findings if f.rule == "eval-results"]
    assert "cannot be recomputed" in f.problem and "line 6" in f.problem


def test_a_duplicated_block_stop_is_a_finding():
    run = real_run()
    events = events_of(run / "mlperf.log")
    i = find(events, "block_stop", 20)
    events.insert(i + 1, copy.deepcopy(events[i]))
    report = rewritten(run, events)
    [f] = [f for f in report.findings if f.rule == "block-pairing"]
    assert f.line == i + 2 and f"closes no block_start (the previous block_stop is at line {i + 1})" in f.problem
    assert not report.clean


def test_a_missing_block_stop_is_a_finding():
    run = real_run()
    events = events_of(run / "mlperf.log")
    i = find(events, "block_stop", 20)
    del events[i]
    report = rewritten(run, events)
    [f] = [f for f in report.findings if f.rule == "block-pairing"]
    assert f.line == i and "block_start at samples_count 4864 has no block_stop before the next block_start" in f.problem
    assert not report.clean


def test_a_training_stopped_during_its_last_step_is_a_note_not_a_finding():
    events = synth()
    events.insert(find(events, "eval_start"), {**events[find(events, "block_start", 22)], "time_ms": 3200,
                                               "metadata": {"samples_count": 22 * 256, "step": 23}})
    _, findings, notes = lint_text(to_text(events))
    assert findings == [] and any("has no block_stop: training stopped during that step" in n for n in notes)


@pytest.mark.slow
def test_forged_logs_beside_a_live_run_are_not_clean(tmp_path):
    """The issue's two forgeries on a run made now (every eval/step_N.jsonl present): the pass
    moved to an earlier step (its accuracy edited above the target, run_stop set to that
    step's training_step_end_time_ms), and one accuracy edited to 0.72."""
    live = live_run()
    run = tmp_path / "run"
    shutil.copytree(live, run, ignore=shutil.ignore_patterns("*.safetensors"))  # the records, not the weights
    assert check_log(run / "mlperf.log").clean
    summary = json.loads((run / "eval" / "summary.json").read_text())
    passing, gbs = summary["passing_step"], 256
    earlier = passing - 1
    assert earlier >= rules.first_eval_step(gbs), "the live run passed at its first evaluation: nothing to move"
    original = events_of(run / "mlperf.log")

    moved = [copy.deepcopy(e) for e in original if not (e["key"] in ("eval_start", "eval_accuracy", "eval_stop") and e["metadata"]["step"] > earlier)]
    moved[find(moved, "eval_accuracy", earlier)]["value"] = 0.70
    info = json.loads((run / "checkpoints" / f"step_{earlier}" / "training_info.json").read_text())
    moved[-1]["time_ms"] = info["training_step_end_time_ms"]
    moved[-1]["metadata"].update(samples_count=earlier * gbs, step=earlier)
    report = rewritten(run, moved)
    assert not report.clean and "eval-results" in rules_of(report)
    assert [f.line for f in report.findings if f.rule == "eval-results"] == [find(moved, "eval_accuracy", earlier) + 1]

    edited = copy.deepcopy(original)
    edited[find(edited, "eval_accuracy", passing)]["value"] = 0.72  # the issue's "step 21's accuracy to 0.72"
    report = rewritten(run, edited)
    assert not report.clean and rules_of(report) == {"eval-results"}


def test_a_successful_run_stop_is_timed_against_the_first_passing_step():
    """run_stop naming step 22 with step 22's own weight-update time: the time is still not the
    passing step 23's (old: compared with the step the run_stop names, and matched)."""
    run = real_run()
    events = events_of(run / "mlperf.log")
    info = json.loads((run / "checkpoints" / "step_22" / "training_info.json").read_text())
    events[-1]["time_ms"] = info["training_step_end_time_ms"]
    events[-1]["metadata"].update(samples_count=22 * 256, step=22)
    report = rewritten(run, events)
    [f] = [f for f in report.findings if f.rule == "run-stop-time" and "training_info.json" in f.problem]
    assert f"differs from the weight-update time 1795998424706 in {run / 'checkpoints/step_23/training_info.json'}" in f.problem
    assert "run-stop-step" in rules_of(report)


@pytest.mark.slow
def test_another_runs_folder_as_run_dir_is_a_finding_naming_it(tmp_path):
    """Issue 44: `check LOG --run-dir OTHER_RUN` was CLEAN with notes only."""
    other = tmp_path / "other"
    shutil.copytree(live_run(), other)
    (other / "run.json").write_text(json.dumps({"mllog_file": "mlperf.log"}))
    log = real_run() / "mlperf.log"
    assert "run-dir" not in rules_of(check_log(log))  # its own folder
    report = check_log(log, run_dir=other)
    [f] = [f for f in report.findings if f.rule == "run-dir"]
    assert f"the run directory {other} is not this log's run: its log {other / 'mlperf.log'} started at" in f.problem
    assert not report.clean
    (other / "run.json").unlink()  # no log of its own: its checkpoint records tie it
    [f] = [f for f in check_log(log, run_dir=other).findings if f.rule == "run-dir"]
    assert "training_info.json's weight-update time" in f.problem and "is not within step" in f.problem, f.problem
