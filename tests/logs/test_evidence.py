"""Direct tests of check/evidence.py: pass@k read again from a run directory's
``eval/step_N.jsonl`` (a header line, then one line per task), and the one-sentence
problem of a file that cannot give it. Torch-free (the log tools' tests without torch)."""

import json

from mlperf_grpo.logs.check.evidence import StoredResult, read_result, stored_results

HEADER = {"step": 18, "sampling": {"temperature": 0.1, "top_p": 0.95, "max_new_tokens": 8}, "seed": 1, "engine": {}}


def _results(path, *tasks, header=HEADER):
    """``path`` holding ``header`` and one task line per rewards list (or raw line when a str)."""
    lines = [json.dumps(header)] + [t if isinstance(t, str) else json.dumps({"task_id": f"t{i}", "rewards": t})
                                    for i, t in enumerate(tasks)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_accuracy_is_the_share_of_tasks_with_a_reward_above_zero(tmp_path):
    # passed: any reward > 0; a negative or zero reward is a failure, a task may have any k
    path = _results(tmp_path / "step_18.jsonl", [0, 1, 0, 0], [0, 0, 0, 0], [0.5, 0, 0, 0], [-1, 0], [0, 0, 0, 1e-9])
    # 3 of 5: a ratio of two small integers is one correctly rounded division, so exact
    assert read_result(path) == StoredResult(path, 5, 3 / 5)


def test_the_header_is_not_a_task_and_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "step_18.jsonl"
    path.write_text(json.dumps({"rewards": [1, 1]}) + "\n\n" + json.dumps({"rewards": [0, 0]}) + "\n\n")
    assert read_result(path) == StoredResult(path, 1, 0.0)  # line 1 is the header, whatever it holds


def test_a_file_that_cannot_give_an_accuracy_says_why(tmp_path):
    cases = {
        "no-task": ((), "it holds no task"),
        "not-json": (([1], "{"), "line 3 is not a task with a list of finite rewards"),
        "nan": (([1], '{"rewards": [NaN]}'), "line 3 is not a task with a list of finite rewards"),
        "bool": (([True],), "line 2 is not a task with a list of finite rewards"),
        "empty-rewards": (([],), "line 2 is not a task with a list of finite rewards"),
        "not-a-dict": (("[1, 2]",), "line 2 is not a task with a list of finite rewards"),
    }
    for name, (tasks, problem) in cases.items():
        path = _results(tmp_path / name / "step_18.jsonl", *tasks)
        result = read_result(path)
        assert (result.accuracy, result.problem) == (None, problem), name
    missing = read_result(tmp_path / "step_99.jsonl")
    assert missing.accuracy is None and missing.problem == "cannot read it: No such file or directory"


def test_stored_results_are_every_step_file_of_the_run(tmp_path):
    run = tmp_path / "run"
    assert stored_results(run) == {} and stored_results(None) == {}  # no eval/ yet
    _results(run / "eval" / "step_18.jsonl", [0, 0], [1, 0])
    _results(run / "eval" / "step_19.jsonl", [1, 0], [1, 0])
    _results(run / "eval" / "step_7x.jsonl", [1])  # not a step file's name
    _results(run / "eval" / "unlogged" / "step_20.jsonl", [1])  # not yet logged: not beside the log's results
    (run / "eval" / "summary.json").write_text("{}")
    found = stored_results(run)
    assert sorted(found) == [18, 19]
    assert (found[18].accuracy, found[19].accuracy) == (1 / 2, 1.0)
