"""`mlperf-grpo report`: the timeline facts, a valid PNG of sensible size, HTML, bad input."""

import base64
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from logtools_helpers import DATA, figure_texts, find, reference_style, synth, to_text

from mlperf_grpo.cli import main
from mlperf_grpo.logs.mllog import parse_log_text
from mlperf_grpo.logs.report.png import render_png
from mlperf_grpo.logs.report.timeline import build_timeline, title_of

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_timeline_of_the_real_log():
    tl = build_timeline(parse_log_text((DATA / "mlperf.log").read_text()))
    summary = json.loads((DATA / "eval" / "summary.json").read_text())
    assert len(tl.steps) == 30 and [s for s, _, _ in tl.checkpoint_writes] == list(range(18, 31))
    assert [e.step for e in tl.evals] == [int(k) for k in summary["accuracies"]]
    assert tl.passing.step == summary["passing_step"] == tl.run_stop_step
    assert tl.time_to_train_ms == summary["time_to_train_ms"] and tl.status == "success"
    assert all(e.start_ms > tl.steps[-1][2] for e in tl.evals)  # evaluation after training
    assert "qwen35_397b_grpo" in title_of(tl) and "success" in title_of(tl) and "open division" in title_of(tl)


def test_png_report_is_a_valid_image_of_sensible_size(tmp_path, capsys):
    out = tmp_path / "timeline.png"
    assert main(["report", str(DATA / "mlperf.log"), "-o", str(out)]) == 0
    data = out.read_bytes()
    w, h = png_size(data)
    assert 1000 <= w <= 2500 and 600 <= h <= 1600 and len(data) > 30_000
    import matplotlib.image

    pixels = matplotlib.image.imread(out)
    assert pixels.shape[:2] == (h, w) and pixels.std() > 0.05  # not blank


def test_html_report_embeds_the_png(tmp_path):
    out = tmp_path / "timeline.html"
    assert main(["report", str(DATA / "mlperf.log"), "-o", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("<!doctype html>") and "status: success" in text and "<td>23</td>" in text
    b64 = text.split("data:image/png;base64,")[1].split('"')[0]
    png_size(base64.b64decode(b64))


def test_report_of_an_aborted_log(tmp_path):
    path = tmp_path / "aborted.log"
    path.write_text(to_text(synth(accs=(0.5, 0.6, 0.65), status="aborted")))
    assert main(["report", str(path), "-o", str(tmp_path / "a.png")]) == 0
    png_size((tmp_path / "a.png").read_bytes())


@pytest.mark.parametrize("content,out", [(None, "x.png"), (b"", "x.png"), (b"\x00\x01", "x.png"), (b"hello\n", "x.png"),
                                         (":::MLLOG {}".encode(), "x.png")])
def test_bad_input_exits_2(tmp_path, capsys, content, out):
    path = tmp_path / "in.log"
    if content is not None:
        path.write_bytes(content)
    assert main(["report", str(path), "-o", str(tmp_path / out)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / out).exists()


def test_unknown_output_type_exits_2(tmp_path, capsys):
    assert main(["report", str(DATA / "mlperf.log"), "-o", str(tmp_path / "x.pdf")]) == 2
    assert ".png or .html" in capsys.readouterr().err


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 10_000), st.sampled_from(["", "x", "null", "}", "-1", "1e999", "NaN"])),
                min_size=1, max_size=5))
def test_timeline_never_crashes_on_mutated_real_logs(ops):
    lines = (DATA / "mlperf.log").read_text().splitlines()
    for op, i, txt in ops:
        i %= len(lines)
        if op == 0:
            del lines[i]
        elif op == 1:
            lines.insert(0, lines[i])
        else:
            k = (i * 7) % max(len(lines[i]), 1)
            lines[i] = lines[i][:k] + txt + lines[i][k + 1:]
    build_timeline(parse_log_text("\n".join(lines)))


@settings(max_examples=5, deadline=None)
@given(st.lists(st.integers(0, 200), min_size=1, max_size=4))
def test_png_renders_after_mutation(drop):
    lines = (DATA / "mlperf.log").read_text().splitlines()
    for i in sorted(set(drop), reverse=True):
        del lines[i % len(lines)]
    png_size(render_png(build_timeline(parse_log_text("\n".join(lines)))))


def test_unwritable_output_is_bad_input_naming_the_file(capsys):
    from pathlib import Path

    from mlperf_grpo.cli import main

    log = Path(__file__).parents[1] / "data" / "real_run" / "mlperf.log"
    assert main(["report", str(log), "-o", "/proc/no/such/dir/r.png"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mlperf-grpo: error: cannot write /proc/no/such/dir/r.png") and "\n" not in err


def _stats_after_the_evaluation(events):
    """As the reference logs a step: its ``tracked_stats`` after that step's evaluation (so
    after the training block's ``block_stop``)."""
    out = list(events)
    for s in sorted({e["metadata"]["step"] for e in out if e["key"] == "eval_start"}):
        stats = out.pop(find(out, "tracked_stats", s))
        stop = next(i for i, e in enumerate(out) if e["key"] == "eval_stop" and e["metadata"]["samples_count"] == stats["metadata"]["samples_count"])
        out.insert(stop + 1, {**stats, "time_ms": out[stop]["time_ms"] + 1})
    return out


@pytest.mark.parametrize("gbs, s0", [(256, 18), (1024, 7)])
def test_a_long_block_is_labelled_with_all_its_steps(gbs, s0):
    events = _stats_after_the_evaluation(reference_style(accs=(0.5, 0.72), gbs=gbs))
    tl = build_timeline(parse_log_text(to_text(events)))
    texts, _ = figure_texts(tl)
    assert f"steps 1-{s0}" in texts and f"steps 1-{s0 - 1}" not in texts
    assert str(s0 + 1) in texts  # the one-step block after it


def test_no_checkpoint_writes_row_without_checkpoints():
    _, fig = figure_texts(build_timeline(parse_log_text(to_text(reference_style()))))  # inline: none written
    rows = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert rows == ["training steps", "evaluation (inline)"] and "checkpoint write" not in legend
    _, fig = figure_texts(build_timeline(parse_log_text((DATA / "mlperf.log").read_text())))  # deferred: 13 written
    assert "checkpoint writes" in [t.get_text() for t in fig.axes[0].get_yticklabels()]


def test_step_labels_do_not_overlap():
    """300 steps, 41 evaluations: S0's label and the passing evaluation's stay; no two drawn labels overlap."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    tl = build_timeline(parse_log_text(to_text(synth(accs=(0.5,) * 40 + (0.7,), steps=300))))
    _, fig = figure_texts(tl)
    renderer = FigureCanvasAgg(fig).get_renderer()
    labels = [t for t in fig.axes[0].texts if t.get_visible() and t.get_text().isdigit()]
    lanes = {}
    for t in labels:
        lanes.setdefault(t.get_position()[1], []).append(t)
    assert len(lanes) == 2  # the training lane's labels and the evaluation lane's
    for lane in lanes.values():
        boxes = [t.get_window_extent(renderer) for t in lane]
        assert len(boxes) > 1
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), [t.get_text() for t in lane]
    texts = {t.get_text() for t in labels}
    assert "18" in texts and "58" in texts  # S0, and the passing evaluation


def _open_run(eval_times):
    """An open run at GBS 32 with its own first eval step 3: 6 steps (100 ms each), then
    the evaluations of steps 3 and 4 logged after training, begun at ``eval_times``."""
    from logtools_helpers import ev

    gbs = 32
    events = [ev("submission_benchmark", "qwen35_397b_grpo"), ev("submission_division", "open"),
              ev("global_batch_size", gbs), ev("run_start", t=1000, et="INTERVAL_START")]
    for s in range(1, 7):
        md = {"samples_count": s * gbs, "step": s}
        events += [ev("block_start", t=1000 + 100 * (s - 1), md={**md, "samples_count": (s - 1) * gbs}, et="INTERVAL_START"),
                   ev("block_stop", t=1000 + 100 * s - 10, md=md, et="INTERVAL_END")]
    for s, acc, t in zip((3, 4), (0.5, 0.72), eval_times):
        md = {"samples_count": s * gbs, "step": s}
        events += [ev("eval_start", t=t, md=md, et="INTERVAL_START"), ev("eval_accuracy", acc, t=t + 5, md=md),
                   ev("eval_stop", t=t + 5, md=md, et="INTERVAL_END")]
    events.append(ev("run_stop", t=1390, md={"status": "success", "samples_count": 4 * gbs, "step": 4}, et="INTERVAL_END"))
    return build_timeline(parse_log_text(to_text(events)))


def test_an_open_run_with_its_own_first_eval_step_draws_its_checkpoints():
    """Issue 44: the closed formula (S0 = 123 at GBS 32) hid every checkpoint write."""
    tl = _open_run((1700, 1720))
    assert tl.first_eval_step == 3
    assert [step for step, _, _ in tl.checkpoint_writes] == [3, 4, 5, 6]
    texts, _ = figure_texts(tl)
    assert any("first eval step S0=3" in t for t in texts), texts


def test_the_subtitle_says_when_evaluation_ran_beside_training():
    """Issue 44: a followed run (evaluations begun during training, merged after it) was
    titled as evaluated after training."""
    from mlperf_grpo.logs.report.png import FOLLOW_TEXT, MODE_TEXT

    after = MODE_TEXT["deferred"][1]
    texts, _ = figure_texts(_open_run((1420, 1530)))  # steps 3 and 4 evaluated while steps 5-6 trained
    assert FOLLOW_TEXT in texts and after not in texts
    texts, _ = figure_texts(_open_run((1700, 1720)))
    assert after in texts and FOLLOW_TEXT not in texts


def test_the_default_pictures_labels_stay_inside_their_axes():
    """Issue 44: run_start's label sat across the timeline's left axis; "pass: backdated"
    ran past the last evaluation bar toward the right one."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    _, fig = figure_texts(build_timeline(parse_log_text((DATA / "mlperf.log").read_text())))
    renderer = FigureCanvasAgg(fig).get_renderer()
    ax = fig.axes[0]
    box = ax.get_window_extent(renderer)
    outside = [t.get_text() for t in ax.texts if t.get_visible() and t.get_text().strip()
               and not (box.x0 <= t.get_window_extent(renderer).x0 and t.get_window_extent(renderer).x1 <= box.x1)]
    assert not outside, outside
