"""`mlperf-grpo check`: each lint rule on a log that triggers it and one that does not,
real logs pass clean, bad input exits 2, and nothing crashes on random or mutated input."""

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from logtools_helpers import DATA, GBS, find, live_run, real_run, synth, to_text

from mlperf_grpo.cli import main
from mlperf_grpo.logs.check import UnreadableLog, check_log, lint_text
from mlperf_grpo.logs.check.lint import RULES, LintInput
from mlperf_grpo.logs.mllog import parse_log_text

EVAL = ("eval_start", "eval_accuracy", "eval_stop")


def rules_hit(events, run_dir=None):
    _, findings, _ = lint_text(to_text(events), run_dir)
    return {f.rule for f in findings}, findings


def test_clean_synthetic_log_has_no_findings():
    hit, findings = rules_hit(synth())
    assert findings == []
    text = to_text(synth())
    inp = LintInput(parse_log_text(text), text.splitlines())
    for rule in RULES:  # every rule, individually, on the clean log
        assert rule(inp) == [], rule.__name__


def _two_run_stops(e):
    e.append(copy.deepcopy(e[-1]))


def _aborted_but_passed(e):
    e[-1]["metadata"]["status"] = "aborted"


def _weird_status(e):
    e[-1]["metadata"]["status"] = "converged"


def _success_without_pass(e):
    e[:] = synth(accs=(0.5, 0.6), status="success")


def _run_stop_before_evals(e):
    e.insert(find(e, "eval_start"), e.pop())


def _run_stop_before_run_start(e):
    e.insert(find(e, "run_start"), e.pop())


def _eval_after_pass(e):
    e[:] = synth(accs=(0.5, 0.7, 0.4))
    e.append(e.pop(find(e, "run_stop")))


def _gap(e):
    e[:] = synth(accs=(0.5, 0.6, 0.7))
    for i, x in enumerate(e):
        if x["key"] in EVAL and x["metadata"]["step"] == 19:
            e[i] = None
    e[:] = [x for x in e if x is not None]


def _not_ascending(e):
    a, b = find(e, "eval_start", 18), find(e, "eval_start", 19)
    e[a:a + 3], e[b:b + 3] = e[b:b + 3], e[a:a + 3]


def _first_not_at_s0(e):
    for x in e:
        if x["key"] in EVAL or x["key"] == "run_stop":
            x["metadata"]["step"] += 1
            x["metadata"]["samples_count"] += GBS


def _at_target(e):
    e[find(e, "eval_accuracy", 19)]["value"] = 0.69


def _null_value(e):
    e[find(e, "eval_accuracy", 18)]["value"] = None


def _string_value(e):
    e[find(e, "eval_accuracy", 18)]["value"] = "0.5"


def _out_of_range(e):
    e[find(e, "eval_accuracy", 18)]["value"] = 1.5


def _missing_eval_stop(e):
    del e[find(e, "eval_stop", 19)]


def _stop_other_step(e):
    e[find(e, "eval_stop", 19)]["metadata"]["step"] = 18


def _run_stop_after_block_stop(e):
    e[-1]["time_ms"] += 7


def _substring_key(e):
    e.insert(find(e, "run_start"), {**e[find(e, "eval_samples")], "key": "my_eval_accuracy_note", "value": 1})


def _substring_value(e):
    e.insert(find(e, "run_start"), {**e[find(e, "eval_samples")], "key": "config_filename", "value": "global_batch_size_256.yaml"})


def _duplicate_gbs(e):
    e.insert(find(e, "run_start"), copy.deepcopy(e[find(e, "global_batch_size")]))


def _missing_metadata(e):
    del e[find(e, "block_start", 3)]["metadata"]


MUTATIONS = {
    "multiple-run-stop": [_two_run_stops],
    "run-stop-status": [_aborted_but_passed, _weird_status, _success_without_pass],
    "run-stop-order": [_run_stop_before_evals, _run_stop_before_run_start],
    "eval-after-pass": [_eval_after_pass],
    "eval-series": [_gap, _not_ascending, _first_not_at_s0],
    "eval-at-target": [_at_target],
    "eval-value": [_null_value, _string_value, _out_of_range],
    "eval-pairing": [_missing_eval_stop, _stop_other_step],
    "run-stop-time": [_run_stop_after_block_stop],
    "substring-key": [_substring_key, _substring_value],
    "duplicate-gbs": [_duplicate_gbs],
    "invalid-json": [_missing_metadata],
}


@pytest.mark.parametrize("rule,mutate", [(r, m) for r, ms in MUTATIONS.items() for m in ms], ids=lambda x: getattr(x, "__name__", x))
def test_rule_triggers(rule, mutate):
    events = synth()
    mutate(events)
    hit, findings = rules_hit(events)
    assert rule in hit, findings
    for f in findings:
        if f.rule == rule:
            assert f.problem and f.impact and f.key


def test_invalid_json_line_is_reported_with_its_line_number():
    text = to_text(synth())
    lines = text.splitlines()
    lines.insert(3, ':::MLLOG {"key": "seed", "value": 1,')
    _, findings, _ = lint_text("\n".join(lines))
    assert [(f.rule, f.line) for f in findings] == [("invalid-json", 4)]


def _run_dir(tmp_path, t_update, tasks=251):
    """A run dir with step_20's training_info.json and an eval result file."""
    d = tmp_path / "run" / "checkpoints" / "step_20"
    d.mkdir(parents=True)
    info = {"current_step": 20, "consumed_samples": 320, "training_step_end_time_ms": t_update, "samples_count": 20 * GBS,
            "global_batch_size": GBS, "num_generations_per_prompt": 16, "dtype": "float32",
            "weights": {"model.safetensors": {"sha256": "0" * 64, "bytes": 1}}}
    (d / "training_info.json").write_text(json.dumps(info))
    (tmp_path / "run" / "eval").mkdir()
    (tmp_path / "run" / "eval" / "step_20.jsonl").write_text('{"sampling": {}}\n' + '{"task_id": "t"}\n' * tasks)
    return tmp_path / "run"


def test_run_stop_time_against_training_info(tmp_path):
    events = synth()  # passes at step 20; run_stop.time_ms = block_stop of step 20
    t = events[-1]["time_ms"]
    assert "run-stop-time" not in rules_hit(events, _run_dir(tmp_path / "a", t))[0]
    hit, findings = rules_hit(events, _run_dir(tmp_path / "b", t - 3))
    assert "run-stop-time" in hit
    assert any("training_info.json" in f.problem for f in findings)


def test_run_stop_time_check_skipped_without_records(tmp_path):
    (tmp_path / "run").mkdir()
    text = to_text(synth())
    _, findings, notes = lint_text(text, tmp_path / "run")
    assert findings == [] and any("training_info.json" in n for n in notes)


def test_eval_samples_against_tasks_evaluated(tmp_path):
    events = synth()
    t = events[-1]["time_ms"]
    assert "eval-samples" not in rules_hit(events, _run_dir(tmp_path / "a", t, tasks=251))[0]
    assert "eval-samples" in rules_hit(events, _run_dir(tmp_path / "b", t, tasks=250))[0]


# --- real logs -----------------------------------------------------------------------


def test_real_log_is_clean_with_success_and_the_run_time_to_train(capsys):
    run = real_run()
    summary = json.loads((run / "eval" / "summary.json").read_text())
    report = check_log(run / "mlperf.log")
    assert report.run_dir == run.resolve()
    assert report.official.verdict == "SUCCESS", report.official.messages
    assert report.findings == [] and report.score.disagreements == [] and report.clean
    # every check made (run_stop against training_info.json, eval_samples and step 23's accuracy
    # against eval/); the stored run is open division, so the note says which series rule applied;
    # it keeps one eval/step_N.jsonl, so the other accuracies could not be recomputed
    assert report.notes == ["eval series judged by the open-division rule (from the log's first evaluation, "
                            "samples_count 4608); closed logs are judged from S0",
                            f"eval_accuracy not recomputed for step(s) 18, 19, 20, 21, 22: no step_N.jsonl for "
                            f"them in {report.run_dir / 'eval'}"]
    assert report.mode.mode == "deferred"
    assert report.score.log_minutes == pytest.approx(summary["time_to_train_ms"] / 60000)
    assert report.score.summarizer_minutes == pytest.approx(summary["time_to_train_ms"] / 60000)
    assert report.score.rcp_samples == report.score.log_samples == summary["passing_step"] * GBS
    assert main(["check", str(run / "mlperf.log")]) == 0
    out = capsys.readouterr().out
    assert "SUCCESS" in out and "lint: no findings" in out
    assert f"{summary['time_to_train_ms'] / 60000:.3f} min" in out


@pytest.mark.slow
def test_live_run_log_is_clean():
    """A log made now by `mlperf-grpo run` (not the stored one) checks clean."""
    run = live_run()
    report = check_log(run / "mlperf.log")
    assert report.clean, (report.official.messages, report.findings, report.score.disagreements)
    summary = json.loads((run / "eval" / "summary.json").read_text())
    assert report.score.summarizer_minutes == pytest.approx(summary["time_to_train_ms"] / 60000)


def test_real_log_json_output_and_findings_exit_1(tmp_path, capsys):
    run = real_run()
    assert main(["check", "--json", str(run / "mlperf.log")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["clean"] and data["logs"][0]["official"]["verdict"] == "SUCCESS"
    bad = tmp_path / "bad.log"
    lines = (run / "mlperf.log").read_text().splitlines()
    lines.append(lines[-1])  # a second run_stop: the compliance checker passes it (a warning only)
    bad.write_text("\n".join(lines) + "\n")
    assert main(["check", "--json", str(bad)]) == 1
    data = json.loads(capsys.readouterr().out)
    assert {f["rule"] for f in data["logs"][0]["findings"]} == {"multiple-run-stop"}
    assert data["logs"][0]["official"]["verdict"] == "SUCCESS"


def test_official_checker_crash_becomes_a_message(tmp_path):
    run = real_run()
    lines = (run / "mlperf.log").read_text().splitlines()
    lines.insert(5, ':::MLLOG {"key": "seed", "value": 1, "metadata": {}}')  # no time_ms: the official parser raises KeyError
    bad = tmp_path / "bad.log"
    bad.write_text("\n".join(lines) + "\n")
    report = check_log(bad, auto_run_dir=False)
    assert not report.clean and report.official.verdict == "CRASHED"
    assert any(f.rule == "invalid-json" and f.line == 6 for f in report.findings)


@pytest.mark.parametrize("content", [None, b"", b"\n  \n", b"\x89PNG\r\n\x1a\n\x00\x00", b"just some text\n"])
def test_unreadable_input_exits_2_with_one_line(tmp_path, capsys, content):
    path = tmp_path / "x.log"
    if content is not None:
        path.write_bytes(content)
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mlperf-grpo: error: ") and "Traceback" not in err


# --- never crash ---------------------------------------------------------------------

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@FAST
@given(st.binary(max_size=2000))
def test_parser_and_lint_never_crash_on_random_bytes(data):
    text = data.decode("utf-8", errors="replace")
    lint_text(text)
    lint_text(":::MLLOG " + text)


@FAST
@given(st.lists(st.dictionaries(st.sampled_from(["key", "value", "time_ms", "metadata", "event_type"]),
                                st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=20),
                                          st.sampled_from(["run_stop", "run_start", "eval_accuracy", "eval_start", "eval_stop",
                                                           "global_batch_size", "block_stop", "block_start"]),
                                          st.dictionaries(st.sampled_from(["samples_count", "step", "status"]),
                                                          st.one_of(st.none(), st.integers(-5, 10_000), st.text(max_size=5)))),
                                max_size=5), max_size=30))
def test_lint_never_crashes_on_random_json_events(dicts):
    lint_text("".join(":::MLLOG " + json.dumps(d) + "\n" for d in dicts))


def _mutate(lines, ops, draw_text):
    lines = list(lines)
    for op, i, j, txt in ops:
        if not lines:
            break
        i, j = i % len(lines), j % len(lines)
        if op == 0:
            del lines[i]
        elif op == 1:
            lines.insert(j, lines[i])
        elif op == 2:
            lines[i], lines[j] = lines[j], lines[i]
        elif op == 3:
            k = j % max(len(lines[i]), 1)
            lines[i] = lines[i][:k] + txt + lines[i][k + 1:]
        else:
            lines[i] = lines[i][: j % max(len(lines[i]), 1)]
    return lines


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 10_000), st.integers(0, 10_000),
                          st.sampled_from(["", "x", "null", '"', "}", "{", "9e999", "-1", "NaN", "\\u0000", "ü", "\x00"])),
                min_size=1, max_size=6))
def test_check_never_crashes_on_mutated_real_logs(tmp_path, ops):
    lines = (DATA / "mlperf.log").read_text().splitlines()
    path = tmp_path / "mutated.log"
    path.write_text("\n".join(_mutate(lines, ops, None)) + "\n")
    try:
        report = check_log(path, auto_run_dir=False)
    except UnreadableLog:
        return
    report.to_dict()
    from mlperf_grpo.logs.check.render import format_reports, to_json

    format_reports([report])
    json.loads(to_json([report]))


# --- issue 19: a verdict in bounded time on any input ------------------------------------

import importlib  # noqa: E402
import time  # noqa: E402

import mlperf_grpo.logs.check as check_pkg  # noqa: E402

lint_mod = importlib.import_module("mlperf_grpo.logs.check.lint")  # the package's 'lint' name is the function


def test_deeply_nested_json_is_a_finding_not_a_recursion_error(tmp_path, capsys):
    lines = (DATA / "mlperf.log").read_text().splitlines()
    lines.insert(3, ":::MLLOG " + "[" * 2000)
    path = tmp_path / "nested.log"
    path.write_text("\n".join(lines) + "\n")
    report = check_log(path, auto_run_dir=False)
    assert any(f.rule == "invalid-json" and f.line == 4 and "nested too deeply" in f.problem for f in report.findings)
    assert main(["check", "--no-run-dir", str(path)]) == 1
    out = capsys.readouterr().out
    assert "result: NOT CLEAN" in out


def test_non_scalar_samples_count_is_a_finding_about_its_line():
    events = [ev for ev in synth()[:5]]
    events += [{"namespace": "", "time_ms": 2000, "event_type": "INTERVAL_START", "key": "block_start", "value": None,
                "metadata": {"samples_count": []}},
               {"namespace": "", "time_ms": 2001, "event_type": "POINT_IN_TIME", "key": "eval_accuracy", "value": 0.7,
                "metadata": {"samples_count": 1}},
               {"namespace": "", "time_ms": 2002, "event_type": "INTERVAL_END", "key": "run_stop", "value": None,
                "metadata": {"status": "success"}}]
    hit, findings = rules_hit(events)  # the old lint raised TypeError: unhashable type: 'list'
    assert any(f.rule == "metadata-type" and f.line == 6 and "samples_count []" in f.problem for f in findings)


@pytest.mark.parametrize("bad", [[], {}, {"a": [1]}, "4608", 4608.0, -256, True])
def test_any_wrong_typed_metadata_value_is_a_finding(bad):
    events = synth()
    events[find(events, "eval_accuracy", 19)]["metadata"]["samples_count"] = bad
    hit, findings = rules_hit(events)
    line = find(events, "eval_accuracy", 19) + 1
    assert any(f.rule == "metadata-type" and f.line == line for f in findings), findings


def test_a_very_long_line_is_a_finding_and_the_official_checkers_are_skipped(tmp_path, capsys):
    lines = (DATA / "mlperf.log").read_text().splitlines()
    lines.insert(3, ':::MLLOG {"key": "x", "value": "' + "v" * 1_000_000 + '", "time_ms": 1, "metadata": {}}')
    path = tmp_path / "long.log"
    path.write_text("\n".join(lines) + "\n")
    t = time.perf_counter()
    report = check_log(path, auto_run_dir=False)
    assert time.perf_counter() - t < 30  # the old check did not finish in 45 s
    assert report.official.verdict == "SKIPPED" and not report.clean
    assert [f.line for f in report.findings if f.rule == "long-line"] == [4]
    assert main(["check", "--no-run-dir", str(path)]) == 1
    assert "SKIPPED" in capsys.readouterr().out


def test_official_checkers_past_the_time_limit_give_a_timeout_verdict(tmp_path, monkeypatch, capsys):
    """A 300 kB line under a raised length limit: the quadratic official checker is killed."""
    monkeypatch.setattr(lint_mod, "MAX_LINE_CHARS", 10_000_000)
    monkeypatch.setattr(check_pkg, "MAX_LINE_CHARS", 10_000_000)
    lines = (DATA / "mlperf.log").read_text().splitlines()
    lines.insert(3, ':::MLLOG {"key": "x", "value": "' + "v" * 300_000 + '", "time_ms": 1, "metadata": {}}')
    path = tmp_path / "slow.log"
    path.write_text("\n".join(lines) + "\n")
    t = time.perf_counter()
    report = check_log(path, auto_run_dir=False, time_limit_s=1.0)
    assert time.perf_counter() - t < 20
    assert report.official.verdict == "TIMEOUT" and not report.clean
    assert "within 1 s" in report.official_summary()
    assert report.score.summarizer_minutes is None and report.score.rcp_samples is None
    assert main(["check", "--no-run-dir", "--time-limit-s", "1", str(path)]) == 1
    assert "TIMEOUT" in capsys.readouterr().out


def test_official_rule_files_are_parsed_before_the_fork_and_results_are_unchanged(monkeypatch):
    """The parse cache of the compliance checker's rule files is filled in the parent:
    with PyYAML's parser broken afterwards, the forked checkers still give the same results."""
    import yaml

    from mlperf_grpo.logs.check import official

    log = DATA / "mlperf.log"
    official.preload_checkers()
    before = official.run_official(log)
    assert before.compliance.verdict == "SUCCESS", before.compliance.messages

    def no_parsing(*args, **kwargs):
        raise AssertionError("a rule file was parsed again")

    monkeypatch.setattr(yaml, "load", no_parsing)
    after = official.run_official(log)
    assert after.compliance.verdict == "SUCCESS", after.compliance.messages
    assert (after.compliance.messages, after.compliance.configs) == (before.compliance.messages, before.compliance.configs)
    assert (after.summarizer, after.rcp) == (before.summarizer, before.rcp)


def test_parsed_rule_files_equal_a_fresh_parse_and_each_load_is_a_copy():
    from pathlib import Path

    import yaml
    from mlperf_logging.compliance_checker import mlp_compliance

    from mlperf_grpo.logs.check import official

    official.preload_checkers()
    common = Path(mlp_compliance.__file__).parent / "training_6.1.0" / "common.yaml"
    with open(common) as f:
        fresh = yaml.load(f, Loader=yaml.BaseLoader)
    with open(common) as f:
        first = mlp_compliance.yaml.load(f, Loader=yaml.BaseLoader)
    assert first == fresh and isinstance(mlp_compliance.yaml, official._ParsedRuleFiles)
    first.clear()  # what one run does to its copy does not reach the next
    with open(common) as f:
        assert mlp_compliance.yaml.load(f, Loader=yaml.BaseLoader) == fresh
    assert mlp_compliance.yaml.BaseLoader is yaml.BaseLoader


def _nested(draw_depth):
    return ":::MLLOG " + "[" * draw_depth


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(500, 6000), st.sampled_from(["[", '{"a":', '{"key": "x", "metadata": {"samples_count": [']))
def test_lint_never_crashes_on_deep_nesting(depth, opener):
    lint_text(to_text(synth()) + ":::MLLOG " + opener * depth + "\n")


@FAST
@given(st.lists(st.tuples(st.sampled_from(["block_start", "block_stop", "eval_start", "eval_accuracy", "eval_stop", "run_stop",
                                           "tracked_stats", "global_batch_size"]),
                          st.dictionaries(st.sampled_from(["samples_count", "step", "status"]),
                                          st.recursive(st.one_of(st.none(), st.integers(-3, 9000), st.floats(), st.text(max_size=3)),
                                                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner, max_size=2),
                                                       max_leaves=6))),
                max_size=25))
def test_lint_never_crashes_on_non_scalar_metadata(events):
    base = synth()
    extra = [{"namespace": "", "time_ms": 1000 + i, "event_type": "POINT_IN_TIME", "key": k, "value": 0.7, "metadata": md}
             for i, (k, md) in enumerate(events)]
    lint_text(to_text(base[:5] + extra + base[5:]))  # inside the run, before the real blocks and evaluations


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.integers(lint_mod.MAX_LINE_CHARS + 1, 400_000))
def test_check_answers_quickly_on_long_lines(tmp_path, length):
    path = tmp_path / "long.log"
    path.write_text(to_text(synth()) + ':::MLLOG {"key": "x", "value": "' + "v" * length + '", "time_ms": 1, "metadata": {}}\n')
    t = time.perf_counter()
    report = check_log(path, auto_run_dir=False)
    assert time.perf_counter() - t < 20 and report.official.verdict == "SKIPPED"


# --- issue 8 part 3: check's blind spots ----------------------------------------------------


def _open(events):
    events[find(events, "submission_division")]["value"] = "open"
    return events


def _first_eval_at(events, step):
    """Move every evaluation (and run_stop) so the series starts at ``step``."""
    shift = step - 18
    for x in events:
        if x["key"] in EVAL or x["key"] == "run_stop":
            x["metadata"]["step"] += shift
            x["metadata"]["samples_count"] += shift * GBS
    return events


def test_open_logs_are_judged_by_their_own_series():
    events = _open(_first_eval_at(synth(steps=22), 3))
    events[-1]["time_ms"] = events[find(events, "block_stop", 5)]["time_ms"]
    text = to_text(events)
    _, findings, notes = lint_text(text)
    assert findings == []  # the old lint: 'expected 4608 (step 18)' on every evaluation
    assert any("open-division rule" in n for n in notes)
    closed = _first_eval_at(synth(steps=22), 3)
    closed[-1]["time_ms"] = closed[find(closed, "block_stop", 5)]["time_ms"]
    hit, findings = rules_hit(closed)
    assert "eval-series" in hit and "closed division" in next(f.impact for f in findings if f.rule == "eval-series")


def test_open_logs_still_need_a_contiguous_series():
    events = _open(_first_eval_at(synth(accs=(0.5, 0.6, 0.7)), 3))
    del events[find(events, "eval_start", 4):find(events, "eval_start", 4) + 3]  # a gap at step 4
    hit, findings = rules_hit(events)
    assert any(f.rule == "eval-series" and "expected 1024 (step 4)" in f.problem and "open division" in f.impact for f in findings)


def test_run_stop_success_must_name_the_first_passing_step():
    events = synth()  # passes at step 20
    events[-1]["metadata"].update(samples_count=21 * GBS, step=21)
    events[-1]["time_ms"] = events[find(events, "block_stop", 21)]["time_ms"]
    hit, findings = rules_hit(events)
    assert any(f.rule == "run-stop-step" and "first passing evaluation's samples_count 5120" in f.problem for f in findings)


def test_run_stop_success_must_be_a_trained_step():
    events = synth(steps=19, accs=(0.5, 0.6, 0.7))  # evaluates 18-20 but trained to 19 only
    hit, findings = rules_hit(events)
    assert any(f.rule == "run-stop-step" and "never trained" in f.problem for f in findings), findings


def test_run_stop_aborted_must_sit_at_the_final_trained_step():
    events = synth(accs=(0.5, 0.6, 0.65), steps=22, status="aborted")
    events[-1]["metadata"].update(samples_count=20 * GBS, step=20)  # final trained step is 22
    events[-1]["time_ms"] = events[find(events, "block_stop", 20)]["time_ms"]
    hit, findings = rules_hit(events)
    assert any(f.rule == "run-stop-step" and "final trained step (samples_count 5632)" in f.problem for f in findings)
    assert "run-stop-step" not in rules_hit(synth(accs=(0.5, 0.6, 0.65), steps=20, status="aborted"))[0]


@pytest.mark.parametrize("before", ["run_start", "init_stop"])
def test_evaluations_before_the_run_are_flagged(before):
    events = synth()
    events.insert(find(events, "run_start"), {"namespace": "", "time_ms": 990, "event_type": "INTERVAL_END", "key": "init_stop",
                                              "value": None, "metadata": {}})
    at = find(events, before)
    triple = [copy.deepcopy(events[find(events, k, 18)]) for k in EVAL]
    for x in triple:
        x["metadata"].update(samples_count=17 * GBS, step=17)
    events[at:at] = triple
    hit, findings = rules_hit(events)
    outside = [f for f in findings if f.rule == "eval-outside-run"]
    assert [f.line for f in outside] == [at + 1, at + 2, at + 3] and before in outside[0].problem


# --- issue 8 part 5: check on several logs, JSON on bad input ----------------------------------


def test_one_unreadable_log_still_reports_the_readable_one(tmp_path, capsys):
    good = DATA / "mlperf.log"
    assert main(["check", "--no-run-dir", str(good), str(tmp_path / "missing.log")]) == 2
    captured = capsys.readouterr()
    assert f"== {good}" in captured.out and "result: CLEAN" in captured.out
    assert captured.err.count("\n") == 1 and "missing.log: no such file" in captured.err


def test_json_on_bad_input_is_json(tmp_path, capsys):
    assert main(["check", "--json", "--no-run-dir", str(DATA / "mlperf.log"), str(tmp_path / "missing.log")]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["clean"] is False and data["logs"][0]["clean"] is True
    assert data["logs"][1] == {"log": str(tmp_path / "missing.log"), "clean": False, "error": f"{tmp_path / 'missing.log'}: no such file"}
    assert main(["check", "--json", "--run-dir", str(tmp_path / "nope"), str(DATA / "mlperf.log")]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["clean"] is False and "is not a directory" in data["error"]
