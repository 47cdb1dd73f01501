"""The run lifecycle (issue 8, part 1) and the CLI around it (part 5).

A run that stops early never loses a checkpoint: training killed before its first
checkpoint is closed by ``evaluate``; setup failures leave no half-made run; SIGTERM in
the evaluation phase stops like Ctrl-C. Faults are real signals sent to real
``python -m mlperf_grpo.cli`` subprocesses, with the smallest configs that show them.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mlperf_grpo import __version__
from mlperf_grpo.cli.app import build_parser, main
from mlperf_grpo.logs.mllog import read_log
from mlperf_grpo.model.files import BUILTIN_MODEL_DIR

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
TINY_OPEN = {"grpo": {"num_prompts_per_step": 4, "max_steps": 2, "first_eval_step": 1}, "validation": {"num_tasks": 20}}


def _cli(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mlperf_grpo.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=ENV, text=True, **popen)


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def _wait_for(predicate, proc, timeout_s=600.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.005)


def _log_text(run: Path) -> str:
    return (run / "mlperf.log").read_text() if (run / "mlperf.log").is_file() else ""


def _errors(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("mlperf-grpo:")]


# --------------------------------------------------------------------------- killed before the first checkpoint

@pytest.mark.slow
def test_trainer_killed_before_its_first_checkpoint_is_closed_by_evaluate(tmp_path, capsys):
    run = tmp_path / "run"
    proc = _cli("train", "--config", str(_write(tmp_path / "c.yaml", {"grpo": {"max_steps": 30}})), "--output", str(run))
    _wait_for(lambda: '"step": 3' in _log_text(run) and '"block_stop"' in _log_text(run), proc)
    proc.kill()
    proc.communicate()
    before = read_log(run / "mlperf.log")
    assert not before.find("run_stop") and not (run / "checkpoints").exists()
    last = before.find("block_stop")[-1]

    # train refuses the directory and names the way out
    assert main(["train", "--output", str(run)]) == 2
    (line,) = _errors(capsys.readouterr().err)
    assert "already holds a run" in line and f"'mlperf-grpo evaluate {run}'" in line

    assert main(["evaluate", str(run)]) == 3
    captured = capsys.readouterr()
    assert "status: aborted" in captured.out and "time-to-train: none (an aborted run has no score)" in captured.out
    assert f"stopped after step {last.metadata['step']}, before its first checkpoint (step 18)" in captured.err
    log = read_log(run / "mlperf.log")
    (stop,) = log.find("run_stop")
    assert {k: stop.metadata[k] for k in ("status", "samples_count", "step")} == {
        "status": "aborted", "samples_count": last.metadata["step"] * 256, "step": last.metadata["step"]}
    assert stop.time_ms == last.time_ms and log.events[-1] == stop and not log.find("eval_accuracy")
    summary = json.loads((run / "eval" / "summary.json").read_text())
    assert summary["status"] == "aborted" and summary["run_stop_time_ms"] == last.time_ms
    # asked again: the same answer, nothing written
    text = (run / "mlperf.log").read_bytes()
    assert main(["evaluate", str(run)]) == 3
    assert (run / "mlperf.log").read_bytes() == text


def test_checkpoints_deleted_after_the_first_eval_step_are_not_closed_as_aborted(tmp_path, capsys):
    """The way out is only for training that ended before its first checkpoint: a run
    trained past it whose checkpoints are gone is an error, not an aborted run."""
    cfg = _write(tmp_path / "c.yaml", TINY_OPEN)
    run = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--output", str(run)]) == 0
    shutil.rmtree(run / "checkpoints")
    before = (run / "mlperf.log").read_bytes()
    assert main(["evaluate", str(run)]) == 2
    assert "no step_N checkpoints" in _errors(capsys.readouterr().err)[0]
    assert (run / "mlperf.log").read_bytes() == before


# --------------------------------------------------------------------------- setup failures leave nothing

def _no_weights(model: Path) -> None:
    (model / "model.safetensors").unlink()


def _no_tokenizer(model: Path) -> None:
    (model / "tokenizer.json").unlink()


def _config_vocab_not_the_weights(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    config["vocab_size"] += 5
    (model / "config.json").write_text(json.dumps(config))


def _tokenizer_ids_beyond_the_embedding(model: Path) -> None:
    tok = json.loads((model / "tokenizer.json").read_text())
    tok["model"]["vocab"].update({"X": 15, "Y": 16})  # the embedding has 15 rows
    (model / "tokenizer.json").write_text(json.dumps(tok))


def _eos_beyond_the_embedding(model: Path) -> None:
    tok = json.loads((model / "tokenizer.json").read_text())
    tok["added_tokens"].append({"id": 40, "content": "<end>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    (model / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["eos_token"] = "<end>"
    (model / "tokenizer_config.json").write_text(json.dumps(config))


def _corrupt_header(model: Path) -> None:
    (model / "model.safetensors").write_bytes(b"\xff" * 64)


def _truncate_weights(model: Path) -> None:
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[: len(data) // 2])


def _random_weights(model: Path) -> None:
    (model / "model.safetensors").write_bytes(os.urandom(4096))


def _config_value_of_the_wrong_type(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    config["hidden_size"] = "sixty-four"
    (model / "config.json").write_text(json.dumps(config))


def _config_not_json(model: Path) -> None:
    (model / "config.json").write_text("{not json")


def _unknown_architecture(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "no_such_model"
    (model / "config.json").write_text(json.dumps(config))


SETUP_FAULTS = {
    "truncated-weights": (_truncate_weights, "model.safetensors: Error while deserializing header"),
    "random-bytes-weights": (_random_weights, "model.safetensors: Error while deserializing header"),
    "config-value-of-the-wrong-type": (_config_value_of_the_wrong_type, "config.json: Validation error for field 'hidden_size'"),
    "config-not-json": (_config_not_json, "config.json: It looks like the config file"),
    "unknown-architecture": (_unknown_architecture, "config.json: The checkpoint you are trying to load has model type `no_such_model`"),
    "no-weights": (_no_weights, "has no weights (model.safetensors"),
    "no-tokenizer": (_no_tokenizer, "has no tokenizer files"),
    "vocab-size-not-the-weights": (_config_vocab_not_the_weights, "tensor 'model.embed_tokens.weight' has shape [15, 64] in the weight files but config.json needs [20, 64]"),
    "tokenizer-ids-beyond-embedding": (_tokenizer_ids_beyond_the_embedding, "the largest vocabulary id is 16 ('Y', tokenizer loaded as TokenizersBackend) but the embedding 'model.embed_tokens.weight' has 15 rows"),
    "eos-beyond-embedding": (_eos_beyond_the_embedding, "has 15 rows"),
    "unreadable-header": (_corrupt_header, "cannot read the safetensors header"),
}


@pytest.mark.parametrize("command", ["run", "train"])
@pytest.mark.parametrize("fault", list(SETUP_FAULTS))
def test_setup_failure_leaves_no_run_behind(tmp_path, capsys, fault, command):
    damage, message = SETUP_FAULTS[fault]
    model = tmp_path / "model"
    shutil.copytree(BUILTIN_MODEL_DIR, model)
    damage(model)
    cfg = _write(tmp_path / "c.yaml", {"model": {"path": str(model)}})
    assert main([command, "--config", str(cfg), "--output", str(tmp_path / "r")]) == 2
    captured = capsys.readouterr()
    (line,) = _errors(captured.err)
    assert message in line, line
    assert not (tmp_path / "r").exists()
    assert "note:" not in captured.out  # the open-division note comes only once every check passed


def test_failure_while_loading_the_model_removes_the_run_directory(tmp_path, capsys, monkeypatch):
    """A failure after the checks (out of memory, Ctrl-C while loading) writes nothing:
    the model is loaded before the run directory's files, and the directory is removed."""
    from mlperf_grpo.errors import ModelLoadError
    from mlperf_grpo.train import trainer

    def fail(*args, **kwargs):
        raise ModelLoadError("cannot load model: injected failure")

    monkeypatch.setattr(trainer, "load_model", fail)
    cfg = _write(tmp_path / "c.yaml", TINY_OPEN)
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "r")]) == 2
    assert "injected failure" in _errors(capsys.readouterr().err)[0]
    assert not (tmp_path / "r").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    assert main(["train", "--config", str(cfg), "--output", str(existing)]) == 2
    assert [p.name for p in existing.iterdir()] == [".lock"]  # a directory given empty stays an empty run


# --------------------------------------------------------------------------- SIGTERM in run's evaluation phase

@pytest.mark.slow
def test_sigterm_during_runs_evaluation_stops_cleanly_and_evaluate_resumes(tmp_path, capsys):
    run = tmp_path / "run"
    proc = _cli("run", "--config", str(_write(tmp_path / "c.yaml", {"grpo": {"max_steps": 19}})), "--output", str(run))
    lock = run / ".lock"
    _wait_for(lambda: lock.is_file() and "the evaluator" in lock.read_text(), proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 143, err
    (line,) = _errors(err)
    assert line.startswith("mlperf-grpo: evaluation stopped by SIGTERM") and f"'mlperf-grpo evaluate {run}' resumes" in line
    log = read_log(run / "mlperf.log")
    assert not log.find("run_stop") and len(log.find("eval_start")) == len(log.find("eval_stop"))
    assert [c.name for c in sorted((run / "checkpoints").glob("step_*"))] == ["step_18", "step_19"]  # nothing deleted
    assert main(["evaluate", str(run)]) == 3
    log = read_log(run / "mlperf.log")
    assert [e.metadata["step"] for e in log.find("eval_accuracy")] == [18, 19] and len(log.find("run_stop")) == 1


def test_the_choice_to_retain_checkpoints_is_recorded_in_run_json(tmp_path):
    from mlperf_grpo.config.run import RunConfig
    from mlperf_grpo.config.rundir import RunDir, RunDirError

    kept, default = RunDir(tmp_path / "kept"), RunDir(tmp_path / "default")
    kept.create(RunConfig(), retain_checkpoints=True)
    default.create(RunConfig())
    assert json.loads(kept.info_file.read_text())["retain_checkpoints"] is True and kept.retain_recorded()
    assert "retain_checkpoints" not in json.loads(default.info_file.read_text()) and not default.retain_recorded()
    kept.info_file.write_text(json.dumps({"mllog_file": "mlperf.log", "retain_checkpoints": "yes"}))
    with pytest.raises(RunDirError, match="retain_checkpoints must be true or false, got 'yes'"):
        kept.retain_recorded()


@pytest.mark.slow
def test_retain_checkpoints_survives_a_sigterm_and_the_printed_resume_command(tmp_path):
    """`run --retain-checkpoints`, SIGTERM during training, then the command the note
    prints (`mlperf-grpo evaluate RUN`, no flag): the checkpoints are kept (run.json)."""
    run = tmp_path / "run"
    proc = _cli("run", "--config", str(_write(tmp_path / "c.yaml", {"grpo": {"max_steps": 30}})), "--output", str(run),
                "--retain-checkpoints")
    _wait_for(lambda: (run / "checkpoints" / "step_19").is_dir(), proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 143, err
    (note,) = [line for line in err.splitlines() if line.startswith("note:")]
    assert f"'mlperf-grpo evaluate {run}'" in note and "keeps them" in note
    assert json.loads((run / "run.json").read_text())["retain_checkpoints"] is True
    published = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert main(["evaluate", str(run)]) in (0, 3)
    assert read_log(run / "mlperf.log").find("run_stop")
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == published  # kept


# --------------------------------------------------------------------------- CLI

def test_default_output_never_collides(tmp_path, monkeypatch, capsys):
    """The README's first command, twice in one folder: two runs, both finished."""
    monkeypatch.chdir(tmp_path)
    cfg = str(_write(tmp_path / "c.yaml", {**TINY_OPEN, "validation": {"num_tasks": 4}}))
    assert main(["train", "--config", cfg]) == 0
    assert main(["train", "--config", cfg]) == 0
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2 and all((r / "run.json").is_file() for r in runs)
    out = capsys.readouterr().out
    assert all(f"run directory: runs/{r.name}" in out for r in runs)


def test_default_outputs_reserved_in_the_same_second_are_distinct(tmp_path, monkeypatch):
    """Runs started in the same second (8 threads released together, the clock fixed)
    each get their own new directory: the name, then -2, -3, ... (one atomic mkdir each)."""
    import threading

    from mlperf_grpo.cli import commands

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(commands.time, "strftime", lambda fmt: "20261202-004236")
    start, names = threading.Barrier(8), []

    def reserve() -> None:
        start.wait()
        names.append(commands.new_run_dir())

    threads = [threading.Thread(target=reserve) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = ["20261202-004236"] + [f"20261202-004236-{n}" for n in range(2, 9)]
    assert sorted(p.name for p in names) == sorted(expected)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(expected)


def test_a_default_output_is_removed_when_setup_fails(tmp_path, capsys, monkeypatch):
    from mlperf_grpo.errors import ModelLoadError
    from mlperf_grpo.train import trainer

    def fail(*args, **kwargs):
        raise ModelLoadError("cannot load model: injected failure")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(trainer, "load_model", fail)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "user-file").write_text("kept")
    assert main(["train", "--config", str(_write(tmp_path / "c.yaml", TINY_OPEN))]) == 2
    assert "injected failure" in _errors(capsys.readouterr().err)[0]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["user-file"]


def test_help_describes_the_tool_and_every_argument(capsys):
    parser = build_parser()
    text = parser.format_help()
    assert "GRPO training with deferred offline evaluation" in text
    assert "one short function per subcommand" not in text  # no code docstring
    assert "143 SIGTERM" in text
    for command, positional in [("evaluate", "RUN_DIR"), ("check", "LOG"), ("report", "LOG"), ("package", "RUN_DIR")]:
        sub = parser._subparsers._group_actions[0].choices[command]
        actions = [a for a in sub._actions if a.metavar == positional]
        assert actions and actions[0].help, (command, positional)
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"mlperf-grpo {__version__}"


def test_open_division_note_comes_after_the_checks(tmp_path, capsys):
    cfg = _write(tmp_path / "c.yaml", {"model": {"path": str(tmp_path / "no-model")}})
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "r")]) == 2
    captured = capsys.readouterr()
    assert "note:" not in captured.out and "not a local Hugging Face model directory" in captured.err
    used = tmp_path / "used"
    used.mkdir()
    (used / "run.json").write_text("{}")
    assert main(["train", "--output", str(used)]) == 2
    assert "note:" not in capsys.readouterr().out


@pytest.mark.parametrize("command", ["run", "train"])
@pytest.mark.parametrize("output", ["a-file", "a-file/run"])
def test_output_that_is_a_file_is_one_error_line_and_nothing_is_made(tmp_path, capsys, command, output):
    """``--output`` naming a regular file (or a path under one): exactly one error line,
    exit 2, no note before it, nothing created or changed."""
    (tmp_path / "a-file").write_text("mine\n")
    cfg = _write(tmp_path / "c.yaml", TINY_OPEN)
    assert main([command, "--config", str(cfg), "--output", str(tmp_path / output)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"mlperf-grpo: error: output {tmp_path / output}: {tmp_path / 'a-file'} is a "
                                         "file, not a directory; pass a new --output directory"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "c.yaml"]
    assert (tmp_path / "a-file").read_text() == "mine\n"


@pytest.mark.parametrize("command", ["run", "train"])
@pytest.mark.parametrize("output, needle", [
    ("", "argument --output: must not be empty"),  # trained into the working directory (issue 44)
    ("n" * 300, "is 300 bytes, more than the file system's 255; pass a shorter --output"),  # raw errno 36, exit 1
    ("/".join(["d" * 200] * 25), "the path is longer than the file system's 4096 bytes"),
])
def test_an_empty_or_too_long_output_is_one_error_line_and_nothing_is_made(tmp_path, capsys, monkeypatch, command,
                                                                          output, needle):
    monkeypatch.chdir(tmp_path)
    cfg = _write(tmp_path / "c.yaml", TINY_OPEN)
    assert main([command, "--config", str(cfg), "--output", output]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert captured.out == "" and line.startswith("mlperf-grpo: ") and needle in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


@pytest.mark.parametrize("command", ["run", "train"])
def test_output_whose_lock_cannot_be_written_is_one_error_line_and_nothing_is_made(tmp_path, capsys, command):
    """An existing ``--output`` where the run's ``.lock`` cannot be made (here a folder
    stands in its place, which refuses even root): one error line naming it, exit 2,
    nothing on stdout (no open-division note, no run directory line), nothing written."""
    out = tmp_path / "out"
    (out / ".lock").mkdir(parents=True)
    cfg = _write(tmp_path / "c.yaml", TINY_OPEN)
    assert main([command, "--config", str(cfg), "--output", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"mlperf-grpo: error: output {out}: {out / '.lock'} is not a file; "
                                         "pass an --output this user may write"]
    assert [p.name for p in out.iterdir()] == [".lock"] and not any((out / ".lock").iterdir())


def test_a_lock_that_cannot_be_opened_is_a_run_dir_error(tmp_path):
    """``RunLock`` on a directory whose ``.lock`` cannot be opened raises RunDirError
    (exit 2 at the CLI) naming the lock file, not a bare OSError (exit 1)."""
    from mlperf_grpo.config.rundir import RunLock
    from mlperf_grpo.errors import RunDirError

    (tmp_path / ".lock").mkdir()
    with pytest.raises(RunDirError, match=r"cannot write the run's lock file .*\.lock: Is a directory"):
        with RunLock(tmp_path, "evaluator"):
            pass


@pytest.mark.parametrize("output", ["r", None], ids=["--output", "default-output"])
@pytest.mark.parametrize("log", ["a-folder", "a-file/log.txt", "used.log"])
def test_a_log_path_that_cannot_take_the_run_is_refused_before_anything_is_printed(tmp_path, capsys, monkeypatch,
                                                                                   log, output):
    """``MLPERF_MLLOG_FILE`` naming a folder, a path under a file, or a log holding
    another run's lines: one error line, exit 2, nothing on stdout (the open-division note
    and the run directory line used to come first), no run directory made."""
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "a-file").write_text("")
    (tmp_path / "used.log").write_text(':::MLLOG {"key": "run_start"}\n')
    monkeypatch.setenv("MLPERF_MLLOG_FILE", str(tmp_path / log))
    cfg = _write(tmp_path / "c.yaml", TINY_OPEN)
    monkeypatch.chdir(tmp_path)  # the default output is runs/YYYYMMDD-HHMMSS under it
    assert main(["train", "--config", str(cfg)] + (["--output", output] if output else [])) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("mlperf-grpo: error: ") and ("cannot write MLPerf log" in line or "already holds" in line)
    assert not (tmp_path / "r").exists() and not any((tmp_path / "runs").glob("*"))


@pytest.mark.parametrize("output", ["ro", "ro/run"])
def test_output_on_a_read_only_file_system_is_one_error_line(tmp_path, capsys, output):
    """``--output`` on a read-only mount (refused to root too): one line, exit 2,
    nothing on stdout. Skipped where a tmpfs cannot be mounted."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        cfg = _write(tmp_path / "c.yaml", TINY_OPEN)
        assert main(["train", "--config", str(cfg), "--output", str(tmp_path / output)]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.splitlines() == [f"mlperf-grpo: error: output {tmp_path / output}: {ro} is not writable; "
                                             "pass an --output this user may write"]
    finally:
        subprocess.run(["umount", str(ro)])
