"""`check`'s messages say what the log holds: file line numbers, whole-ms times, what a
repeated run_stop carries, no time-to-train for an aborted log, and a note when the
backdated run_stop could not be verified (no verdict changes)."""

import copy
import json

from logtools_helpers import find, real_run, synth, to_text

from mlperf_grpo.logs.check import check_log, lint_text
from mlperf_grpo.logs.check.render import format_report
from mlperf_grpo.logs.check.shape import evaluation_mode
from mlperf_grpo.logs.mllog import parse_log_text

PREFIX = ":::MLLOG "


def real_events(run):
    return [json.loads(ln[len(PREFIX):]) for ln in (run / "mlperf.log").read_text().splitlines()]


def write(path, events, head=""):
    path.write_text(head + to_text(events))
    return path


def test_official_summary_names_the_file_line(tmp_path):
    """The checker numbers the :::MLLOG lines from 0; the summary gives the file line."""
    events = real_events(real_run())
    i = find(events, "eval_samples")
    events[i]["value"] = 256
    plain = check_log(write(tmp_path / "a.log", events), auto_run_dir=False)
    assert f"eval_samples (line {i + 1}) fails v['value'] == 251" in plain.official_summary()
    # two lines of other output before the log (a launcher's banner): two file lines later
    banner = check_log(write(tmp_path / "b.log", events, head="starting\n\n"), auto_run_dir=False)
    assert f"eval_samples (line {i + 3}) fails" in banner.official_summary()


def test_a_repeated_run_stop_is_described_by_its_time_and_metadata():
    events = synth()
    again = copy.deepcopy(events[-1])
    again["time_ms"] += 7
    events.append(again)
    _, findings, _ = lint_text(to_text(events))
    [f] = [f for f in findings if f.rule == "multiple-run-stop"]
    first = events[-2]
    assert "None" not in f.problem
    assert f"time_ms {first['time_ms'] + 7}, metadata" in f.problem and f"has time_ms {first['time_ms']}, metadata" in f.problem


def test_a_second_result_of_the_passing_checkpoint_is_not_read_instead_of_itself():
    events = synth(accs=(0.5, 0.7))
    at = find(events, "run_stop")
    events[at:at] = copy.deepcopy(events[find(events, "eval_start", 19):at])  # step 19 evaluated twice
    _, findings, _ = lint_text(to_text(events))
    [f] = [f for f in findings if f.rule == "eval-after-pass"]
    assert "instead of" not in f.impact and "the same" in f.impact and "4864" in f.impact


def test_a_successful_run_stop_before_the_evaluations_is_not_called_aborted():
    events = synth()
    events.insert(find(events, "eval_start"), events.pop())
    _, _, notes = lint_text(to_text(events))
    assert "run_stop time not checked: no evaluation is logged before it" in notes
    assert not any("aborted" in n for n in notes)
    aborted = synth(accs=())  # killed before any evaluation: training itself aborted
    aborted[-1]["metadata"]["status"] = "aborted"
    assert any("training itself was aborted" in n for n in lint_text(to_text(aborted))[2])


def test_times_in_messages_are_whole_ms():
    start, stop, ev = 1795998422491, 1795998424706, 1795998425357  # as in the real log: 1.796e+12 all
    text = to_text([{"namespace": "", "time_ms": t, "event_type": et, "key": k, "value": None, "metadata": {}}
                    for t, k, et in ((start, "run_start", "INTERVAL_START"), (ev, "eval_start", "INTERVAL_START"),
                                     (stop, "run_stop", "INTERVAL_END"))])
    mode = evaluation_mode(parse_log_text(text))
    assert mode.mode == "deferred"
    assert f"time_ms {stop})" in mode.evidence and f"({ev})" in mode.evidence and "e+" not in mode.evidence


def test_an_aborted_log_has_no_time_to_train(tmp_path):
    events = real_events(real_run())
    events[find(events, "eval_accuracy", 23)]["value"] = 0.68
    last = events[find(events, "block_stop", 30)]
    events[-1]["metadata"].update(status="aborted", samples_count=last["metadata"]["samples_count"], step=30)
    events[-1]["time_ms"] = last["time_ms"]
    report = check_log(write(tmp_path / "aborted.log", events), auto_run_dir=False)
    assert report.score.status == "aborted" and report.score.log_minutes is None
    assert "time-to-train, log         none (run_stop status 'aborted': no score)" in format_report(report)


def test_a_log_checked_without_its_run_directory_says_run_stop_was_not_verified():
    run = real_run()
    note = ("the backdated run_stop is not verified against the checkpoints' weight-update times: checked without "
            "its run directory (give it with --run-dir)")
    alone = check_log(run / "mlperf.log", auto_run_dir=False)
    assert alone.clean and note in alone.notes and f"note: {note}" in format_report(alone)
    assert note not in check_log(run / "mlperf.log").notes  # with the run directory it was verified
