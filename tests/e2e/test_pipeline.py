"""End to end: train, evaluate offline, and the official compliance checker on the log."""

import json
import shutil
import subprocess
import sys

import pytest

from mlperf_grpo.cli import main
from mlperf_grpo.logs.mllog import read_log

pytestmark = pytest.mark.slow


def official_check(log_path):
    out = subprocess.run(
        [sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training", "--ruleset", "6.1.0", str(log_path)],
        capture_output=True, text=True, cwd=log_path.parent,
    )
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "default"
    assert main(["run", "--output", str(out), "--retain-checkpoints"]) == 0
    return out


def test_default_run_log_passes_the_official_checker(default_run):
    text = official_check(default_run / "mlperf.log")
    assert "SUCCESS" in text, text


def test_default_run_backdates_run_stop_to_the_passing_checkpoint(default_run):
    log = read_log(default_run / "mlperf.log")
    stops = log.find("run_stop")
    assert len(stops) == 1 and stops[0].metadata["status"] == "success"
    evals = log.find("eval_accuracy")
    steps = [e.metadata["step"] for e in evals]
    assert steps == list(range(18, 18 + len(steps)))  # starts at S0 = 18, contiguous
    assert [e.metadata["samples_count"] for e in evals] == [s * 256 for s in steps]
    assert all(e.value <= 0.69 for e in evals[:-1]) and evals[-1].value > 0.69
    assert len(evals) >= 2, "calibration: at least one failing checkpoint before the pass"
    # unchanged by asynchronous checkpoints: README's table (steps 18..20, pass at 20)
    assert steps == [18, 19, 20] and [round(e.value, 3) for e in evals] == [0.681, 0.689, 0.697]
    passing = steps[-1]
    info = json.loads((default_run / "checkpoints" / f"step_{passing}" / "training_info.json").read_text())
    assert stops[0].time_ms == info["training_step_end_time_ms"]
    assert stops[0].line_no > evals[-1].line_no  # written last, backdated
    block_stop = [e for e in log.find("block_stop") if e.metadata["step"] == passing][0]
    assert stops[0].time_ms <= block_stop.time_ms


def test_evaluate_again_writes_nothing(default_run, capsys):
    before = (default_run / "mlperf.log").read_bytes()
    assert main(["evaluate", str(default_run)]) == 0
    assert (default_run / "mlperf.log").read_bytes() == before
    assert "status: success" in capsys.readouterr().out


def test_aborted_path_train_then_evaluate(tmp_path, capsys, monkeypatch):
    from mlperf_grpo.inference.hf import HFEngine

    closed = []  # train and evaluate each close their engine (vLLM: so the next can be built)
    monkeypatch.setattr(HFEngine, "close", lambda self: closed.append(self))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("grpo: {max_steps: 19}\n")  # steps 18 and 19 are below the target
    run = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--output", str(run)]) == 0
    assert len(closed) == 1
    assert read_log(run / "mlperf.log").find("run_stop") == []  # the trainer writes none
    final = json.loads((run / "checkpoints" / "step_19" / "training_info.json").read_text())
    assert main(["evaluate", str(run)]) == 3
    assert len(closed) == 2
    out = capsys.readouterr().out
    assert "status: aborted" in out and "time-to-train: none (an aborted run has no score)" in out
    log = read_log(run / "mlperf.log")
    stop = log.find("run_stop")
    assert len(stop) == 1 and stop[0].metadata["status"] == "aborted"
    assert stop[0].time_ms == final["training_step_end_time_ms"]
    assert [e.metadata["step"] for e in log.find("eval_accuracy")] == [18, 19]
    assert not (run / "checkpoints").exists()  # removed at teardown


def test_bad_inputs_exit_2_with_one_line(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("grpo: {max_stepz: 3}\n")
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "r")]) == 2
    assert main(["evaluate", str(tmp_path / "nowhere")]) == 2
    # A run directory whose checkpoints are gone.
    cfg.write_text("grpo: {max_steps: 18}\n")
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "short")]) == 0
    shutil.rmtree(tmp_path / "short" / "checkpoints")
    assert main(["evaluate", str(tmp_path / "short")]) == 2
    # A log path that cannot be written.
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("MLPERF_MLLOG_FILE", str(blocker / "log.txt"))
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "r2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("mlperf-grpo: error:")]
    assert len(errors) == 4 and "Traceback" not in "\n".join(err)
    assert "unknown key 'grpo.max_stepz'" in errors[0]
    assert "no step_N checkpoints" in errors[2]
    assert "cannot write MLPerf log" in errors[3]


def test_output_that_already_holds_a_run_is_refused(default_run, tmp_path, capsys):
    before = (default_run / "mlperf.log").read_bytes()
    assert main(["train", "--output", str(default_run)]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and f"'mlperf-grpo evaluate {default_run}' finishes it" in err
    assert (default_run / "mlperf.log").read_bytes() == before
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    assert main(["train", "--output", str(not_a_dir)]) == 2
    assert f"{not_a_dir} is a file, not a directory; pass a new --output directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, needle",
    [
        ("grpo: {max_steps: 2}\n", "below the first eval step 18"),
        ("grpo: {max_steps: true}\n", "field 'grpo.max_steps'"),
        ("grpo: {max_steps: '30'}\n", "field 'grpo.max_steps'"),
    ],
)
def test_configs_that_cannot_make_a_scorable_run_are_refused(tmp_path, capsys, text, needle):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "r")]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_binary_config_is_bad_input(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(bytes(range(256)))
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "r")]) == 2
    assert "not a text (UTF-8) YAML file" in capsys.readouterr().err


def test_a_moved_run_is_evaluated_from_its_new_place(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("grpo: {max_steps: 18}\n")  # step 18 is below the target
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "a")]) == 0
    (tmp_path / "a").rename(tmp_path / "b")
    assert json.loads((tmp_path / "b" / "run.json").read_text())["mllog_file"] == "mlperf.log"
    assert main(["evaluate", str(tmp_path / "b"), "--retain-checkpoints"]) == 3
    assert len(read_log(tmp_path / "b" / "mlperf.log").find("run_stop")) == 1
    # Asking a finished run again reports it and deletes nothing, even without retain.
    assert main(["evaluate", str(tmp_path / "b")]) == 3
    assert (tmp_path / "b" / "checkpoints" / "step_18").is_dir()


def test_summary_of_a_moved_run_names_its_log(default_run, tmp_path):
    moved = tmp_path / "elsewhere" / "run"
    shutil.copytree(default_run, moved)  # a copy stands for the move: the fixture is shared
    summary = json.loads((moved / "eval" / "summary.json").read_text())
    assert summary["mllog_file"] == "mlperf.log"  # relative to the run, like run.json
    assert (moved / summary["mllog_file"]).is_file()


def test_bad_retain_value_is_bad_input(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RETAIN_GRPO_CHECKPOINTS", "yes")
    assert main(["evaluate", str(tmp_path)]) == 2
    assert "RETAIN_GRPO_CHECKPOINTS must be 0" in capsys.readouterr().err


def test_missing_model_is_refused_before_anything_is_written(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{path: {tmp_path / 'no-model'}}}\n")
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "r")]) == 2
    assert "not a local Hugging Face model directory" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device is present")
def test_cuda_without_a_device_is_bad_input(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {device: cuda}\n")
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "r")]) == 2
    assert "no CUDA device is available" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
