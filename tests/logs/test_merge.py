"""`mlperf-grpo merge`: eval events after the training lines in step order, no re-sorting,
idempotent, atomic, and refusing two run_stops or a gap."""

import random

import pytest
from logtools_helpers import DATA, real_run

from mlperf_grpo.cli import main
from mlperf_grpo.logs.check import check_log
from mlperf_grpo.logs.merge import MergeError, merge_logs

REAL = (DATA / "mlperf.log").read_text()


def split(text=REAL):
    """(training lines, [eval triples], run_stop line) of a real log."""
    lines = text.splitlines()
    first = next(i for i, ln in enumerate(lines) if '"eval_start"' in ln)
    train, rest = lines[:first], lines[first:]
    stop = [ln for ln in rest if '"run_stop"' in ln]
    evals = [ln for ln in rest if '"run_stop"' not in ln]
    return train, [evals[i:i + 3] for i in range(0, len(evals), 3)], stop


def write(path, lines):
    path.write_text("".join(ln + "\n" for ln in lines))
    return path


def test_merge_of_a_shuffled_evaluator_log_rebuilds_the_real_log(tmp_path):
    train, triples, stop = split()
    random.Random(0).shuffle(triples)  # evaluated in parallel, logged in completion order
    ev_lines = [ln for t in triples for ln in (t[2], t[0], t[1])] + stop  # even the triple's lines out of order
    result = merge_logs(write(tmp_path / "train.log", train), write(tmp_path / "eval.log", ev_lines), tmp_path / "out.log")
    assert result.changed and result.appended == len(triples) * 3 + 1
    assert (tmp_path / "out.log").read_text() == REAL  # step order; the backdated run_stop stays last
    report = check_log(tmp_path / "out.log", auto_run_dir=False)
    assert report.official.verdict == "SUCCESS" and report.findings == [] and report.clean


def test_merge_is_idempotent(tmp_path):
    train, triples, stop = split()
    t, e, out = write(tmp_path / "train.log", train), write(tmp_path / "eval.log", [ln for x in triples for ln in x] + stop), tmp_path / "out.log"
    merge_logs(t, e, out)
    first = out.read_bytes()
    assert not merge_logs(t, e, out).changed and out.read_bytes() == first
    again = merge_logs(out, e, out)  # merging the merged log with the same evaluator log
    assert not again.changed and again.already_present == len(triples) * 3 + 1 and out.read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.log", "out.log", "train.log"]  # no temp files left


def test_refuses_two_run_stops(tmp_path):
    train, triples, stop = split()
    e = [ln for x in triples for ln in x] + stop
    with pytest.raises(MergeError, match="2 run_stops"):
        aborted = stop[0].replace('"success"', '"aborted"')  # e.g. training crashed and logged its own run_stop
        merge_logs(write(tmp_path / "t.log", train + [aborted]), write(tmp_path / "e.log", e), tmp_path / "o.log")
    with pytest.raises(MergeError, match="2 run_stops"):
        merge_logs(write(tmp_path / "t.log", train), write(tmp_path / "e.log", e + [stop[0].replace('"lineno": 130', '"lineno": 131')]), tmp_path / "o.log")
    with pytest.raises(MergeError, match="already has a run_stop"):
        merge_logs(write(tmp_path / "t.log", train + stop), write(tmp_path / "e.log", e), tmp_path / "o.log")
    assert not (tmp_path / "o.log").exists()


def test_refuses_a_gap(tmp_path, capsys):
    train, triples, stop = split()
    e = [ln for x in triples[:1] + triples[2:] for ln in x] + stop
    args = ["merge", "--train", str(write(tmp_path / "t.log", train)), "--eval", str(write(tmp_path / "e.log", e)), "--output", str(tmp_path / "o.log")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "gap" in err and err.count("\n") == 1
    assert not (tmp_path / "o.log").exists()


def test_refuses_two_evaluations_of_one_checkpoint(tmp_path):
    train, triples, stop = split()
    dup = [ln.replace("0.66135", "0.66") for ln in triples[0]]
    e = [ln for x in triples for ln in x] + dup + stop
    with pytest.raises(MergeError, match="one evaluation"):
        merge_logs(write(tmp_path / "t.log", train), write(tmp_path / "e.log", e), tmp_path / "o.log")


def test_drops_evaluations_after_the_first_pass(tmp_path):
    train, triples, stop = split()
    extra = [ln.replace('"samples_count": 5888, "step": 23', '"samples_count": 6144, "step": 24') for ln in triples[-1]]
    e = [ln for x in triples for ln in x] + extra + stop
    result = merge_logs(write(tmp_path / "t.log", train), write(tmp_path / "e.log", e), tmp_path / "o.log")
    assert result.dropped_steps == [24]
    assert (tmp_path / "o.log").read_text() == REAL


def test_merge_cli_and_check_pass_on_output(tmp_path, capsys):
    train, triples, stop = split()
    t, e = write(tmp_path / "t.log", train), write(tmp_path / "e.log", [ln for x in triples for ln in x] + stop)
    assert main(["merge", "--train", str(t), "--eval", str(e), "--output", str(tmp_path / "o.log")]) == 0
    assert "written" in capsys.readouterr().out
    assert main(["check", "--no-run-dir", str(tmp_path / "o.log")]) == 0


def test_missing_input_exits_2(tmp_path, capsys):
    assert main(["merge", "--train", str(tmp_path / "nope.log"), "--eval", str(tmp_path / "nope2.log"), "-o", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


# --- issue 8 part 5 ----------------------------------------------------------------------


def _inputs(tmp_path):
    train, triples, stop = split()
    return write(tmp_path / "t.log", train), write(tmp_path / "e.log", [ln for x in triples for ln in x] + stop)


def test_same_file_as_train_and_eval_is_refused(tmp_path, capsys):
    t, _ = _inputs(tmp_path)
    assert main(["merge", "--train", str(t), "--eval", str(t), "--output", str(tmp_path / "o.log")]) == 2
    assert "same file" in capsys.readouterr().err
    assert not (tmp_path / "o.log").exists()


def test_an_unrelated_existing_output_is_not_overwritten(tmp_path, capsys):
    t, e = _inputs(tmp_path)
    out = tmp_path / "notes.txt"
    out.write_text("my notes\n")
    assert main(["merge", "--train", str(t), "--eval", str(e), "--output", str(out)]) == 2
    assert "exists and is not this merge's result" in capsys.readouterr().err
    assert out.read_text() == "my notes\n"
    out.unlink()
    assert main(["merge", "--train", str(t), "--eval", str(e), "--output", str(out)]) == 0
    assert main(["merge", "--train", str(t), "--eval", str(e), "--output", str(out)]) == 0  # idempotent
    assert "unchanged (already merged)" in capsys.readouterr().out
    assert merge_logs(t, e, t).changed and t.read_text() == REAL  # in place: output is the training log


def test_missing_output_folder_is_refused_not_created(tmp_path, capsys):
    t, e = _inputs(tmp_path)
    out = tmp_path / "no" / "such" / "o.log"
    assert main(["merge", "--train", str(t), "--eval", str(e), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"folder {out.parent} does not exist; create it first" in err and err.count("\n") == 1
    assert not (tmp_path / "no").exists()
    assert main(["report", str(DATA / "mlperf.log"), "-o", str(out.with_suffix(".png"))]) == 2
    assert "does not exist; create it first" in capsys.readouterr().err and not (tmp_path / "no").exists()


def test_eval_log_without_run_stop_is_refused(tmp_path, capsys):
    train, triples, _ = split()
    t, e = write(tmp_path / "t.log", train), write(tmp_path / "e.log", [ln for x in triples for ln in x])
    assert main(["merge", "--train", str(t), "--eval", str(e), "--output", str(tmp_path / "o.log")]) == 2
    assert "has no run_stop: the evaluation is unfinished" in capsys.readouterr().err
    assert not (tmp_path / "o.log").exists()


def test_gbs_mismatch_names_the_global_batch_size_not_a_fractional_step(tmp_path):
    train, triples, stop = split()
    other = [ln.replace('"samples_count": 4608, "step": 18', '"samples_count": 192, "step": 1') for ln in triples[0]]
    e = write(tmp_path / "e.log", other + [ln for x in triples[1:] for ln in x] + stop)
    with pytest.raises(MergeError) as err:
        merge_logs(write(tmp_path / "t.log", train), e, tmp_path / "o.log")
    assert "samples_count 192 is not a whole step at the training log's global batch size 256" in str(err.value)
    assert "0.75" not in str(err.value)


def _shifted(lines, ms):
    """The same log as another run would write it ``ms`` milliseconds earlier."""
    import json

    out = []
    for ln in lines:
        prefix, _, body = ln.partition(":::MLLOG ")
        event = json.loads(body)
        event["time_ms"] -= ms
        out.append(prefix + ":::MLLOG " + json.dumps(event))
    return out


def test_another_runs_full_log_as_eval_is_refused(tmp_path):
    """Breaker F2: another run's whole log (its own run_start) merged as --eval gave a log
    with a negative time-to-train, exit 0."""
    train, triples, stop = split()
    other = _shifted(train + [ln for t in triples for ln in t] + stop, 6 * 60_000)
    with pytest.raises(MergeError, match="an? (init|run)_start of another run"):
        merge_logs(write(tmp_path / "train.log", train), write(tmp_path / "other.log", other), tmp_path / "out.log")
    assert not (tmp_path / "out.log").exists()


def test_evaluations_timed_before_the_run_started_are_refused(tmp_path):
    train, triples, stop = split()
    ev = _shifted([ln for t in triples for ln in t] + stop, 10 ** 9)  # an evaluator log of an earlier run
    with pytest.raises(MergeError, match="before the training log's run_start"):
        merge_logs(write(tmp_path / "train.log", train), write(tmp_path / "eval.log", ev), tmp_path / "out.log")


def test_merging_the_merged_log_again_is_still_accepted(tmp_path):
    train, triples, stop = split()
    merged = tmp_path / "merged.log"
    write(merged, train + [ln for t in triples for ln in t] + stop)
    result = merge_logs(write(tmp_path / "train.log", train), merged, tmp_path / "out.log")
    assert (tmp_path / "out.log").read_text() == merged.read_text() and result.appended == len(triples) * 3 + 1


# --- issue 26 item 8: an evaluation log of another run ------------------------------------


def _eval_lines():
    _, triples, stop = split()
    return [ln for t in triples for ln in t] + stop


def _edit(lines, key, step, **changes):
    """``lines`` with the ``key`` line of ``step`` (run_stop: the only one) changed."""
    import json

    out = []
    for ln in lines:
        event = json.loads(ln.partition(":::MLLOG ")[2])
        if event["key"] == key and (key == "run_stop" or event["metadata"].get("step") == step):
            event.update({k: v for k, v in changes.items() if k != "metadata"})
            event["metadata"].update(changes.get("metadata", {}))
        out.append(":::MLLOG " + json.dumps(event))
    return out


def test_another_runs_evaluation_of_the_same_batch_size_is_refused(tmp_path, capsys):
    """The issue's case: another run of GBS 256, started later (its times 40 min after this
    one's), evaluated to a pass at the same step: its run_stop is no weight-update time here."""
    train, _, _ = split()
    t = write(tmp_path / "train.log", train)
    e = write(tmp_path / "other-eval.log", _shifted(_eval_lines(), -40 * 60_000))
    assert main(["merge", "--train", str(t), "--eval", str(e), "-o", str(tmp_path / "out.log")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{e} line" in err
    assert ("run_stop at 1796000824706 ms is not a weight-update time of step 23 in the training log "
            "(after 1795998424620 ms (line 85) and no later than 1795998424706 ms, its block_stop at line 87)") in err
    assert not (tmp_path / "out.log").exists()


def test_the_run_directory_ties_run_stop_to_the_checkpoint_exactly(tmp_path, capsys):
    """Beside the run's checkpoints the tie is training_info.json's time, to the ms: a run_stop
    1 ms early (inside step 23's block, so the log alone would accept it) is refused."""
    run = real_run()
    train, _, _ = split()
    t = write(run / "train.log", train)
    early = write(tmp_path / "early.log", _edit(_eval_lines(), "run_stop", None, time_ms=1795998424705))
    with pytest.raises(MergeError) as err:
        merge_logs(t, early, tmp_path / "out.log")
    assert "run_stop at 1795998424705 ms is not step 23's weight-update time 1795998424706 ms" in str(err.value)
    assert main(["merge", "--train", str(t), "--eval", str(write(tmp_path / "e.log", _eval_lines())), "-o", str(tmp_path / "o.log")]) == 0
    out = capsys.readouterr().out
    assert f"tied to the training: run_stop equals step 23's weight-update time in {run / 'checkpoints/step_23/training_info.json'}" in out


def test_a_run_stop_after_the_passing_steps_block_stop_is_refused(tmp_path, capsys):
    train, _, _ = split()
    t = write(tmp_path / "train.log", train)
    late = write(tmp_path / "late.log", _edit(_eval_lines(), "run_stop", None, time_ms=1795998424707))
    with pytest.raises(MergeError, match="no later than 1795998424706 ms, its block_stop at line 87"):
        merge_logs(t, late, tmp_path / "out.log")
    ok = write(tmp_path / "ok.log", _eval_lines())
    assert main(["merge", "--train", str(t), "--eval", str(ok), "-o", str(tmp_path / "o.log")]) == 0
    assert "tied to the training: run_stop lies within step 23's training in the training log (lines 85-87" in capsys.readouterr().out


def test_evaluations_of_steps_this_training_never_reached_are_refused(tmp_path):
    train, _, _ = split()
    short = train[: next(i for i, ln in enumerate(train) if '"block_start"' in ln and '"step": 21}' in ln)]  # trained to step 20
    with pytest.raises(MergeError, match="an evaluation of step 21, but the training log trained to step 20"):
        merge_logs(write(tmp_path / "train.log", short), write(tmp_path / "e.log", _eval_lines()), tmp_path / "out.log")


def test_an_evaluation_begun_before_its_step_was_trained_is_refused(tmp_path):
    train, _, _ = split()
    ev = _edit(_eval_lines(), "eval_start", 20, time_ms=1795998424300)  # step 19 still training then
    with pytest.raises(MergeError, match="the evaluation of step 20 began at 1795998424300 ms, before that step was trained"):
        merge_logs(write(tmp_path / "train.log", train), write(tmp_path / "e.log", ev), tmp_path / "out.log")


def test_swapped_logs_are_refused_saying_which_is_which(tmp_path, capsys):
    """``merge --train EVAL --eval TRAIN`` (a new-user trial): the refusal says which file
    is the training log and which the evaluator's, and how to give them."""
    train, triples, stop = split()
    t = write(tmp_path / "train.log", train)
    e = write(tmp_path / "eval.log", [ln for x in triples for ln in x] + stop)
    assert main(["merge", "--train", str(e), "--eval", str(t), "-o", str(tmp_path / "out.log")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"mlperf-grpo: error: training log {e} has no run_start; ")
    assert f"the training log is {t} and the evaluator's is {e}" in err and f"--train {t} --eval {e}" in err
    assert not (tmp_path / "out.log").exists()
    with pytest.raises(MergeError, match=r"has no run_start$"):  # no hint when --eval is no training log either
        merge_logs(e, write(tmp_path / "e2.log", stop), tmp_path / "o.log")
