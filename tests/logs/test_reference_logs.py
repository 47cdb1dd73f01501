"""Issue 16: the log tools on logs in the reference implementation's shape (inline
evaluation, one long block with tracked_stats, eval_accuracy without step), written with
our own helpers: no false lint finding, the official verdict in one actionable line, and
report labels true to the run."""

import pytest
from logtools_helpers import figure_texts, find, reference_style, synth, to_text

from mlperf_grpo.cli import main
from mlperf_grpo.logs.check import check_log, lint_text
from mlperf_grpo.logs.check.shape import evaluation_mode
from mlperf_grpo.logs.mllog import parse_log_text
from mlperf_grpo.logs.report.timeline import build_timeline

SHAPES = {
    "inline-pass": dict(accs=(0.72,)),
    "inline-pass-later": dict(accs=(0.5, 0.6, 0.7)),
    "inline-aborted": dict(accs=(0.5, 0.6, 0.65)),
    "deferred": dict(accs=(0.5, 0.72), inline=False, max_steps=22),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_no_lint_finding_on_reference_style_logs(shape):
    _, findings, notes = lint_text(to_text(reference_style(**SHAPES[shape])))
    assert findings == []  # old: eval-pairing 'step None differs', run-stop-time '1.0e6 ms after the block_stop'


@pytest.mark.parametrize("shape,mode", [("inline-pass", "inline"), ("inline-pass-later", "inline"),
                                        ("inline-aborted", "inline"), ("deferred", "deferred")])
def test_evaluation_mode_from_the_log(shape, mode):
    assert evaluation_mode(parse_log_text(to_text(reference_style(**SHAPES[shape])))).mode == mode
    assert evaluation_mode(parse_log_text(to_text(synth()))).mode == "deferred"


def test_a_present_step_that_disagrees_is_still_a_mismatch():
    events = reference_style()
    events[find(events, "eval_accuracy")]["metadata"]["step"] = 17
    _, findings, _ = lint_text(to_text(events))
    assert any(f.rule == "eval-pairing" and "step 17 differs" in f.problem for f in findings)


def test_inline_run_stop_before_its_evaluation_is_still_flagged():
    events = synth()  # deferred: backdated run_stop is right
    assert lint_text(to_text(events))[1] == []
    late = synth()
    late[-1]["time_ms"] = late[find(late, "eval_stop", 20)]["time_ms"] + 5  # not backdated: adds eval time
    _, findings, _ = lint_text(to_text(late))
    assert any(f.rule == "run-stop-time" for f in findings)


def test_check_shows_the_official_verdict_in_one_actionable_line(tmp_path, capsys):
    path = tmp_path / "reference.log"
    path.write_text(to_text(reference_style()))
    report = check_log(path, auto_run_dir=False)
    assert report.findings == [] and report.official.verdict == "FAILED"
    summary = report.official_summary()
    assert summary.startswith("FAILED: ") and "\n" not in summary
    assert "31 required key(s) missing (submission_platform, " in summary  # the 6.1 keys the reference predates
    # file line 5, the 5th event (the checker's own message counts from 0: "line 4")
    assert "eval_samples (line 5) fails v['value'] == 251" in summary and "-> log the missing keys" in summary
    code = main(["check", "--no-run-dir", str(path)])
    out = capsys.readouterr().out
    assert code == 1  # follows the official verdict: the lint has nothing
    assert f"official compliance (training 6.1.0, division closed): {summary}" in out
    assert "lint: no findings" in out and "evaluation: inline" in out


def test_report_labels_an_inline_passing_run_as_inline():
    tl = build_timeline(parse_log_text(to_text(reference_style())))
    texts, _ = figure_texts(tl)
    joined = "\n".join(texts)
    assert "timeline: evaluation runs inline, on the clock (training waits for it)" in texts
    assert "evaluation (inline)" in texts and "evaluation (offline)" not in joined
    assert "backdated" not in joined and "weight update" not in joined
    assert " run_stop (success) = end of the passing evaluation (step 18)" in texts
    assert any(t.startswith("time-to-train ") and t.endswith("(evaluation included)") for t in texts)
    assert "steps 1-18" in texts  # the long block is drawn, with its tracked_stats steps
    assert len(tl.steps) == 1 and [s for s, _ in tl.step_ticks] == list(range(1, 19))
    assert tl.checkpoint_writes == []


def test_report_labels_an_aborted_inline_run_without_a_score():
    tl = build_timeline(parse_log_text(to_text(reference_style(accs=(0.5, 0.6, 0.65)))))
    texts, _ = figure_texts(tl)
    joined = "\n".join(texts)
    assert " run_stop (aborted) = end of the last evaluation (step 20)" in texts
    assert not any(t.startswith("time-to-train ") for t in texts)
    assert "aborted: no time-to-train (no evaluation passed; the run has no score)" in texts
    assert "time-to-train: none (aborted: no score)" in joined


def test_report_labels_a_deferred_run_as_deferred():
    tl = build_timeline(parse_log_text(to_text(synth())))
    texts, _ = figure_texts(tl)
    assert "timeline: evaluation runs after training and is taken off the clock" in texts
    assert "evaluation (offline)" in texts and "pass: backdated" in texts
    assert " run_stop (success) = weight update of step 20" in texts
    assert any(t.endswith("(evaluation excluded)") for t in texts)


def test_report_of_a_killed_run_has_no_empty_accuracy_panel():
    events = [e for e in synth(accs=()) if e["key"] != "run_stop"]
    _, fig = figure_texts(build_timeline(parse_log_text(to_text(events))))
    assert len(fig.axes) == 1  # old: a second, empty panel


def test_first_pass_label_is_clear_of_the_target_line():
    """The samples_count label sits above the passing point, so the target line never crosses it."""
    tl = build_timeline(parse_log_text(to_text(synth(accs=(0.5, 0.6, 0.7)))))
    _, fig = figure_texts(tl)
    ax2 = fig.axes[1]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    label = next(t for t in ax2.texts if t.get_text().startswith("first pass"))
    box = label.get_window_extent(renderer)
    target_y = ax2.transData.transform((0, tl.target))[1]
    assert not box.y0 <= target_y <= box.y1


def test_checkpoint_writes_are_visible_in_short_runs():
    """Each write is at least 0.4% of the axis wide, however short the run."""
    events = synth(accs=(0.5, 0.72), steps=19)
    for e in events:  # writes of 1 ms in a run of seconds
        if e["key"] == "block_start" and e["metadata"]["step"] in (19,):
            e["time_ms"] = events[find(events, "block_stop", 18)]["time_ms"] + 1
    tl = build_timeline(parse_log_text(to_text(events)))
    _, fig = figure_texts(tl)
    ax = fig.axes[0]
    span = ax.get_xlim()[1] - ax.get_xlim()[0]
    ckpt_bars = [c for c in ax.collections if tuple(round(v, 3) for v in c.get_facecolor()[0][:3]) == (0.867, 0.518, 0.322)]
    widths = [p.get_extents().width for c in ckpt_bars for p in c.get_paths()]
    assert len(ckpt_bars) == 2 and min(widths) >= 0.003 * span
