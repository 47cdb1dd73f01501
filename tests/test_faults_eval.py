"""Fault injection on the offline evaluator (issue 5, evaluator side).

One default run (trained and evaluated, checkpoints retained) is made once per module;
each test copies it. The "trained" copy is that run as training left it: the log cut
before the first ``eval_start`` (the evaluator only appends) and no ``eval/``. Kills are
real ``SIGKILL``s of ``python -m mlperf_grpo.cli evaluate`` subprocesses.
"""

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import yaml

import reward_fixtures
from safetensors.torch import load_file, save_file

from mlperf_grpo import rules
from mlperf_grpo.checkpoint import discover_checkpoints, read_weights
from mlperf_grpo.model import BUILTIN_MODEL_DIR
from mlperf_grpo.check import check_log
from mlperf_grpo.cli import main
from mlperf_grpo.config import load_config
from mlperf_grpo.evaluate import series
from mlperf_grpo.evaluate.offline import evaluate_run
from mlperf_grpo.evaluate.series import RefitError, verify_refit
from mlperf_grpo.evaluate.validator import validate
from mlperf_grpo.inference.base import SamplingParams
from mlperf_grpo.inference.hf import HFEngine
from mlperf_grpo.mllog import PREFIX, read_log
from mlperf_grpo.rundir import RunLock
from mlperf_grpo.tasks import SUITES, arithmetic
from mlperf_grpo.tasks.scoring import VerifierError

pytestmark = pytest.mark.slow

EVAL_KEYS = ("eval_start", "eval_accuracy", "eval_stop", "run_stop")


# --------------------------------------------------------------------------- helpers

def copy_run(src, dst):
    """Copy a run directory and point its run.json at the copy's own log."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock"))
    (dst / "run.json").write_text(json.dumps({"mllog_file": str(dst / "mlperf.log")}) + "\n")
    return dst


def normalized(log_path):
    """Every line of the log, MLLOG lines parsed with time_ms dropped (all else kept)."""
    out = []
    for line in log_path.read_text().splitlines():
        if PREFIX in line:
            d = json.loads(line.split(PREFIX, 1)[1])
            d.pop("time_ms")
            out.append(d)
        else:
            out.append(line)
    return out


def eval_steps(log_path):
    return [e.metadata["step"] for e in read_log(log_path).find("eval_accuracy")]


def has_eval_events(log_path):
    return any(e.key in EVAL_KEYS for e in read_log(log_path).events)


def error_lines(err):
    """The CLI's error lines; asserts there is exactly one and no traceback."""
    lines = [l for l in err.splitlines() if l.startswith("mlperf-grpo:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def spawn_evaluate(run, out_name):
    out = open(run.parent / f"{out_name}.out", "w")
    err = open(run.parent / f"{out_name}.err", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlperf_grpo.cli", "evaluate", str(run), "--retain-checkpoints"],
        stdout=out, stderr=err,
        # Ctrl-C's default, as in a terminal's foreground job: a test runner started in the
        # background of a shell inherits SIGINT ignored, and Python then keeps ignoring it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    out.close()
    err.close()
    return proc


def wait_for(predicate, proc, timeout_s=600.0):
    """Poll every 10 ms until ``predicate()``; False if ``proc`` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.01)
    raise AssertionError("timed out waiting for the evaluator")


def lock_held_by(run, pid):
    lock = run / ".lock"
    return lock.is_file() and f"pid {pid})" in lock.read_text()


def count_evals(run):
    log = run / "mlperf.log"
    return log.read_text().count('"key": "eval_stop"')


def read_results(path):
    lines = path.read_text().splitlines()
    return json.loads(lines[0]), [json.loads(l) for l in lines[1:]]


def set_info(run, step, **fields):
    path = run / "checkpoints" / f"step_{step}" / "training_info.json"
    info = json.loads(path.read_text())
    info.update(fields)
    path.write_text(json.dumps(info, indent=2))


def info_of(run, step):
    return json.loads((run / "checkpoints" / f"step_{step}" / "training_info.json").read_text())


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """An uninterrupted default run: train, then evaluate, checkpoints retained."""
    run = tmp_path_factory.mktemp("faults_eval") / "finished"
    assert main(["run", "--output", str(run), "--retain-checkpoints"]) == 0
    assert eval_steps(run / "mlperf.log") == [18, 19, 20]
    return run


@pytest.fixture(scope="module")
def trained(finished, tmp_path_factory):
    """The same run as training left it (log up to the first eval_start, no eval/)."""
    run = copy_run(finished, tmp_path_factory.mktemp("faults_eval") / "trained")
    shutil.rmtree(run / "eval")
    lines = (run / "mlperf.log").read_text().splitlines(keepends=True)
    cut = next(i for i, l in enumerate(lines) if '"key": "eval_start"' in l)
    (run / "mlperf.log").write_text("".join(lines[:cut]))
    assert not has_eval_events(run / "mlperf.log")
    return run


@pytest.fixture
def run(trained, tmp_path):
    return copy_run(trained, tmp_path / "run")


@pytest.fixture(scope="module")
def engine_results(trained):
    """Library-level evaluation: steps 18 then 19 in one engine, and 19 in a fresh one."""
    config = load_config(trained / "config.yaml")
    checkpoints = {c.step: c for c in discover_checkpoints(trained / "checkpoints")[0]}
    v = config.validation
    tasks = arithmetic.validation_tasks(v.num_tasks)
    params = SamplingParams(v.temperature, v.top_p, config.grpo.max_new_tokens)

    def new_engine():
        return HFEngine(config.model.path, config.model.dtype, batch_size=v.batch_size)

    def evaluate(engine, step):
        weights = read_weights(checkpoints[step])
        engine.load_weights(weights)
        assert verify_refit(engine, checkpoints[step], list(weights)) == "fingerprint+canary"
        return validate(engine, tasks, arithmetic.reward, v.generations_per_task, params, seed=config.seed)

    shared = new_engine()
    results = {"shared_18": evaluate(shared, 18), "shared_19": evaluate(shared, 19)}
    results["fresh_19"] = evaluate(new_engine(), 19)
    results["refit_only_19"] = evaluate(HFEngine.for_refit(config.model.path, config.model.dtype, batch_size=v.batch_size), 19)
    return types.SimpleNamespace(shared=shared, checkpoints=checkpoints, config=config, **results)


# --------------------------------------------------------------------------- 1. resumable, idempotent

def test_sigkilled_evaluator_resumes_to_the_uninterrupted_log(run, finished):
    """SIGKILL at two startup delays, once the lock is held (0 evals logged), and right
    after the 1st and 2nd eval triples; then run to completion. A leftover tmp_step_31/
    is ignored with a note each time."""
    shutil.copytree(run / "checkpoints" / "step_30", run / "checkpoints" / "tmp_step_31")
    (run / "checkpoints" / "tmp_step_31" / SHARD).write_bytes(b"half-written")
    kill_points = [
        ("0.5 s after start", lambda proc, t0: time.monotonic() - t0 >= 0.5),
        ("1.5 s after start", lambda proc, t0: time.monotonic() - t0 >= 1.5),
        ("lock taken, no eval logged", lambda proc, t0: lock_held_by(run, proc.pid)),
        ("after the 1st eval triple", lambda proc, t0: count_evals(run) >= 1),
        ("after the 2nd eval triple", lambda proc, t0: count_evals(run) >= 2),
    ]
    logged, spawned = [], {}  # pid -> Unix time it was spawned
    for i, (name, ready) in enumerate(kill_points):
        t0 = time.monotonic()
        spawned_unix_s = time.time()
        proc = spawn_evaluate(run, f"killed{i}")
        spawned[proc.pid] = spawned_unix_s
        assert wait_for(lambda: ready(proc, t0), proc), f"{name}: evaluator exited before the kill point"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL, name
        log = read_log(run / "mlperf.log")
        assert not log.bad_lines and not log.find("run_stop"), name
        steps = eval_steps(run / "mlperf.log")
        assert steps == list(range(18, 18 + len(steps))), name  # a contiguous prefix, no duplicates
        logged.append(len(steps))
    # 0.5 s is still in start-up; each later kill point is at or past the previous one
    assert logged[0] == 0 and logged == sorted(logged) and logged[3] >= 1 and logged[4] >= 2, logged

    spawned_unix_s = time.time()
    proc = spawn_evaluate(run, "final")
    spawned[proc.pid] = spawned_unix_s
    assert proc.wait() == 0
    assert "note: ignoring unfinished checkpoint" in (run.parent / "final.err").read_text()
    assert "status: success" in (run.parent / "final.out").read_text()
    assert normalized(run / "mlperf.log") == normalized(finished / "mlperf.log")
    log = read_log(run / "mlperf.log")
    assert len(log.find("run_stop")) == 1
    assert log.find("run_stop")[0].time_ms == read_log(finished / "mlperf.log").find("run_stop")[0].time_ms
    for key in ("eval_start", "eval_accuracy", "eval_stop"):
        assert [e.metadata["step"] for e in log.find(key)] == [18, 19, 20]
    for step in (18, 19, 20):  # per-task results too, whichever process wrote them
        assert read_results(run / "eval" / f"step_{step}.jsonl") == read_results(finished / "eval" / f"step_{step}.jsonl")
    # eval/startup.jsonl and eval/timing.jsonl grew across the attempts; each line names its process
    for name in ("startup.jsonl", "timing.jsonl"):
        for line in map(json.loads, (run / "eval" / name).read_text().splitlines()):
            assert line["pid"] in spawned, (name, line)
            assert abs(line["process_start_unix_s"] - spawned[line["pid"]]) < 5.0, (name, line)
    startups = [json.loads(l) for l in (run / "eval" / "startup.jsonl").read_text().splitlines()]
    assert startups[-1]["pid"] == proc.pid and len({(s["pid"], s["process_start_unix_s"]) for s in startups}) == len(startups)


def test_evaluate_on_a_finished_run_reports_and_writes_nothing(finished, tmp_path, capsys):
    run = copy_run(finished, tmp_path / "run")
    before = (run / "mlperf.log").read_bytes()
    assert main(["evaluate", str(run)]) == 0
    out = capsys.readouterr().out
    assert "status: success" in out and "passing step: 20" in out
    assert (run / "mlperf.log").read_bytes() == before


@pytest.mark.parametrize("signum, code, name", [(signal.SIGTERM, 143, "stopped by SIGTERM"), (signal.SIGINT, 130, "interrupted (Ctrl-C)")])
def test_signal_during_evaluate_stops_cleanly_and_resumes(run, finished, signum, code, name):
    """SIGTERM (like Ctrl-C) after the first eval triple: a documented exit code, one
    line, only whole evaluations in the log, no run_stop, nothing deleted; then resumable."""
    proc = spawn_evaluate(run, "stopped")
    assert wait_for(lambda: count_evals(run) >= 1, proc)
    proc.send_signal(signum)
    assert proc.wait() == code
    line = error_lines((run.parent / "stopped.err").read_text())
    assert line == (f"mlperf-grpo: evaluation {name}; the log holds only whole evaluations (no partial one, "
                    f"no run_stop): 'mlperf-grpo evaluate {run}' resumes it")
    log = read_log(run / "mlperf.log")
    assert not log.bad_lines and not log.find("run_stop")
    steps = eval_steps(run / "mlperf.log")
    assert steps and [e.metadata["step"] for e in log.find("eval_stop")] == steps == list(range(18, 18 + len(steps)))
    assert (run / "checkpoints" / "step_30").is_dir()
    assert spawn_evaluate(run, "resumed").wait() == 0
    assert normalized(run / "mlperf.log") == normalized(finished / "mlperf.log")


def test_teardown_keeps_checkpoints_an_aborted_run_stop_left_unevaluated(run, capsys):
    """A log closed with run_stop aborted before its checkpoints were evaluated (as the
    trainer used to write on SIGTERM): evaluate reports it and deletes none of them."""
    log = read_log(run / "mlperf.log")
    last = log.find("block_stop")[-1]
    with open(run / "mlperf.log", "a") as f:
        f.write(PREFIX + json.dumps({"namespace": "", "time_ms": last.time_ms, "event_type": "INTERVAL_END", "key": "run_stop",
                                     "value": None, "metadata": {"status": "aborted", "samples_count": 30 * 256, "step": 30}}) + "\n")
    assert main(["evaluate", str(run)]) == 3
    captured = capsys.readouterr()
    assert "time-to-train: none" in captured.out and "were never evaluated" in captured.err
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [f"step_{s}" for s in sorted(range(18, 31), key=str)]


# --------------------------------------------------------------------------- 2. one writer

def test_second_evaluator_is_refused_while_one_runs(run, capsys):
    holder = spawn_evaluate(run, "holder")
    try:
        assert wait_for(lambda: lock_held_by(run, holder.pid), holder)
        assert main(["evaluate", str(run), "--retain-checkpoints"]) == 2
        line = error_lines(capsys.readouterr().err)
        assert f"the evaluator (pid {holder.pid})" in line and "being written" in line
    finally:
        holder.kill()
        holder.wait()


def test_evaluator_is_refused_while_the_trainer_holds_the_run(run, capsys):
    before = (run / "mlperf.log").read_bytes()
    with RunLock(run, "trainer"):
        assert main(["evaluate", str(run)]) == 2
    line = error_lines(capsys.readouterr().err)
    assert f"the trainer (pid {os.getpid()})" in line
    assert (run / "mlperf.log").read_bytes() == before
    assert (run / "checkpoints" / "step_18").is_dir()  # no teardown either


# --------------------------------------------------------------------------- 3. the series is checked first

def _drop(step):
    def damage(run):
        shutil.rmtree(run / "checkpoints" / f"step_{step}")
    return damage


def _tmp_instead_of_step_18(run):
    os.rename(run / "checkpoints" / "step_18", run / "checkpoints" / "tmp_step_18")


def _wrong_current_step(run):
    set_info(run, 19, current_step=20)


def _time_not_increasing(run):
    set_info(run, 20, training_step_end_time_ms=info_of(run, 19)["training_step_end_time_ms"])


def _time_before_run_start(run):
    run_start = read_log(run / "mlperf.log").find("run_start")[0].time_ms
    set_info(run, 18, training_step_end_time_ms=int(run_start) - 1)


SHARD = "model-00001-of-00001.safetensors"


def flip_byte(run, step):
    """Flip one weight byte (the safetensors header stays valid)."""
    path = run / "checkpoints" / f"step_{step}" / SHARD
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _rename_tensor(update_record):
    """Rename a tensor of step_19 (a consistent shard, index and hash; with
    ``update_record`` also the tensor digest of its training_info.json)."""
    def damage(run):
        from mlperf_grpo.checkpoint.format import tensor_specs_digest, SAFETENSORS_DTYPES
        step = run / "checkpoints" / "step_19"
        tensors = load_file(step / SHARD)
        tensors["model.norm.weight_renamed"] = tensors.pop("model.norm.weight")
        save_file(tensors, step / SHARD, metadata={"format": "pt"})
        index = json.loads((step / "model.safetensors.index.json").read_text())
        index["weight_map"] = {n: SHARD for n in tensors}
        (step / "model.safetensors.index.json").write_text(json.dumps(index))
        info = info_of(run, 19)
        data = (step / SHARD).read_bytes()
        info["weights"]["shards"][SHARD] = {"hash": __import__("xxhash").xxh3_128_hexdigest(data), "bytes": len(data)}
        if update_record:
            info["weights"]["tensors"] = tensor_specs_digest({n: (SAFETENSORS_DTYPES[t.dtype], list(t.shape)) for n, t in tensors.items()})
        (step / "training_info.json").write_text(json.dumps(info))
    return damage


def _edit_checkpoint_tokenizer(run):
    path = run / "checkpoints" / "step_20" / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["eos_token"] = config.get("bos_token") or "<s>"
    path.write_text(json.dumps(config))


def _drop_last_two(run):
    for step in (29, 30):
        shutil.rmtree(run / "checkpoints" / f"step_{step}")


def _hard_kill_then_drop(run):
    """No training_end.json (a SIGKILL) and more checkpoints gone than can be in flight."""
    (run / "checkpoints" / "training_end.json").unlink()
    for step in (27, 28, 29, 30):
        shutil.rmtree(run / "checkpoints" / f"step_{step}")


def _info_missing(run):
    (run / "checkpoints" / "step_19" / "training_info.json").unlink()


def _info_malformed(run):
    path = run / "checkpoints" / "step_19" / "training_info.json"
    path.write_text(path.read_text()[:-40])


SERIES_FAULTS = {
    "first-not-at-s0": (_drop(18), "first checkpoint is step_19, but the first eval step is 18"),
    "gap": (_drop(20), "gap: missing step_20"),
    "tmp-dir-is-not-a-checkpoint": (_tmp_instead_of_step_18, "first checkpoint is step_19"),
    "current-step": (_wrong_current_step, "step_19: training_info.json says current_step 20"),
    "time-not-increasing": (_time_not_increasing, "step_20: weight-update time"),
    "time-before-run-start": (_time_before_run_start, "step_18: weight-update time"),
    "renamed-tensor": (_rename_tensor(False), "step_19: tensor names, shapes or dtypes differ from those recorded in training_info.json"),
    "renamed-tensor-and-record": (_rename_tensor(True), "step_19: tensor names, shapes or dtypes differ from step_18"),
    "checkpoint-tokenizer-changed": (_edit_checkpoint_tokenizer, "step_20: " ),
    "info-missing": (_info_missing, "step_19/training_info.json is missing"),
    "info-malformed": (_info_malformed, "step_19/training_info.json is not readable JSON"),
}


def _info_malformed_at_25(run):
    (run / "checkpoints" / "step_25" / "training_info.json").write_text("{")


def _shard_missing_at_25(run):
    for shard in (run / "checkpoints" / "step_25").glob("model-*.safetensors"):
        shard.unlink()


def _config_changed_at_25(run):
    path = run / "checkpoints" / "step_25" / "config.json"
    path.write_text(path.read_text().replace("silu", "gelu"))


FAULTS_AFTER_THE_PASS = {  # the fixture run passes at step 20
    "last-checkpoints-deleted": _drop_last_two,
    "hard-kill-then-deleted": _hard_kill_then_drop,
    "info-malformed": _info_malformed_at_25,
    "shard-missing": _shard_missing_at_25,
    "config-changed": _config_changed_at_25,
}


@pytest.mark.parametrize("fault", list(FAULTS_AFTER_THE_PASS))
def test_faults_after_the_pass_never_block_the_result(run, finished, fault):
    """Any damage after the first passing checkpoint (found by the series check, never
    read) leaves the result as it is: the run is scored by its checkpoints up to the pass."""
    FAULTS_AFTER_THE_PASS[fault](run)
    assert main(["evaluate", str(run), "--retain-checkpoints"]) == 0
    assert normalized(run / "mlperf.log") == normalized(finished / "mlperf.log")


def test_deleted_final_checkpoints_without_a_pass_are_refused(run, capsys, monkeypatch):
    """With no pass before the fault, the deleted checkpoints are needed: refused, nothing logged."""
    monkeypatch.setattr(rules, "TARGET_ACCURACY", 0.99)  # configs accept only the rules' target
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["validation"]["target_accuracy"] = 0.99
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    _drop_last_two(run)
    before = (run / "mlperf.log").read_bytes()
    assert main(["evaluate", str(run)]) == 2
    assert "the last checkpoint is step_28, but training published up to step_30" in error_lines(capsys.readouterr().err)
    assert (run / "mlperf.log").read_bytes() == before and not (run / "eval").exists()


@pytest.mark.parametrize("fault", list(SERIES_FAULTS))
def test_bad_series_is_refused_before_anything_is_evaluated(run, fault, capsys):
    damage, message = SERIES_FAULTS[fault]
    damage(run)
    before = (run / "mlperf.log").read_bytes()
    assert main(["evaluate", str(run)]) == 2
    err = capsys.readouterr().err
    assert message in error_lines(err)
    assert (run / "mlperf.log").read_bytes() == before
    assert not (run / "eval").exists()
    assert (run / "checkpoints").is_dir()  # refused before teardown
    if fault == "tmp-dir-is-not-a-checkpoint":
        assert "note: ignoring unfinished checkpoint" in err and "tmp_step_18" in err
    if fault == "checkpoint-tokenizer-changed":
        assert "tokenizer_config.json differs from the file the checkpoints were trained with" in err


def _with_model_copy(run, tmp_path):
    """Point the run's config at a copy of the built-in model (same files, same bytes)."""
    model = tmp_path / "model"
    shutil.copytree(BUILTIN_MODEL_DIR, model)
    config = yaml.safe_load((run / "config.yaml").read_text()) or {}
    config.setdefault("model", {})["path"] = str(model)
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    return model


def _set_eos_to_bos(model):
    path = model / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["eos_token"] = config.get("bos_token") or "<s>"
    path.write_text(json.dumps(config))


def _swap_two_ids(model):
    path = model / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[3:5]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(tok))


@pytest.mark.parametrize("change, file", [(_set_eos_to_bos, "tokenizer_config.json"), (_swap_two_ids, "tokenizer.json"),
                                          (lambda m: (m / "chat_template.jinja").write_text("{{ messages }}"), "chat_template.jinja")])
def test_model_files_changed_after_training_are_refused(run, tmp_path, capsys, change, file):
    """Issue 8.2: the tokenizer (or any non-weight file) the engine would load differs from
    the one the checkpoints were trained with: refused (exit 2) naming the file."""
    model = _with_model_copy(run, tmp_path)
    before = (run / "mlperf.log").read_bytes()
    change(model)
    assert main(["evaluate", str(run), "--retain-checkpoints"]) == 2
    line = error_lines(capsys.readouterr().err)
    assert f"model.path: {model / file}" in line
    assert (run / "mlperf.log").read_bytes() == before and not (run / "eval").exists()


def test_series_cut_by_a_hard_kill_within_the_in_flight_bound_is_accepted_with_a_note(run):
    """After a SIGKILL (no training_end.json) up to max_in_flight trained steps may have no
    checkpoint; the final checkpoint is then the last published one."""
    (run / "checkpoints" / "training_end.json").unlink()
    for step in (29, 30):
        shutil.rmtree(run / "checkpoints" / f"step_{step}")
    config = load_config(run / "config.yaml")
    checkpoints = discover_checkpoints(run / "checkpoints")[0]
    notes, problem = series.check_series(checkpoints, config, read_log(run / "mlperf.log"), run / "checkpoints")
    assert problem is None
    assert notes == ["note: training was killed before recording its end; the checkpoint(s) of steps 29..30 "
                     "were in flight and never published; the final checkpoint is step_28"]


def test_corrupt_checkpoint_after_the_pass_never_blocks_the_result(run, finished):
    flip_byte(run, 21)  # the pass is at 20: step_21 is never read
    assert main(["evaluate", str(run), "--retain-checkpoints"]) == 0
    assert normalized(run / "mlperf.log") == normalized(finished / "mlperf.log")


def test_corrupt_checkpoint_before_any_pass_stops_with_exit_2_naming_it(run, capsys):
    flip_byte(run, 19)  # the pass is at 20
    assert main(["evaluate", str(run), "--retain-checkpoints"]) == 2
    line = error_lines(capsys.readouterr().err)
    assert f"step_19/{SHARD}: xxh3_128 differs from training_info.json; the checkpoint is corrupt" in line
    assert "restore step_19/ from a copy and run evaluate again" in line
    assert eval_steps(run / "mlperf.log") == [18]  # evaluated up to it, resumable
    assert not read_log(run / "mlperf.log").find("run_stop")
    assert (run / "checkpoints" / "step_19").is_dir()


# --------------------------------------------------------------------------- 4. the engine holds the weights it claims

def test_one_engine_across_checkpoints_equals_fresh_engines(engine_results):
    assert engine_results.shared_19 == engine_results.fresh_19
    assert engine_results.shared_18 != engine_results.shared_19  # the refit changed something


def test_refit_only_engine_evaluates_as_one_that_loaded_the_model(engine_results):
    """The evaluators' engine (built from the config, no weights read or initialised)
    gives, after one refit, the results of an engine built from the model's files."""
    assert engine_results.refit_only_19 == engine_results.fresh_19


def test_evaluator_reads_no_initial_weights_and_is_warm_before_the_first_checkpoint(run, finished, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the evaluator loaded the initial model's weights")

    monkeypatch.setattr("mlperf_grpo.inference.hf.load_model", no_load)
    evaluate_run(run, retain_checkpoints=True, show_progress=False, workers=1)
    assert normalized(run / "mlperf.log") == normalized(finished / "mlperf.log")
    [startup] = [json.loads(l) for l in (run / "eval" / "startup.jsonl").read_text().splitlines()]
    assert startup["rank"] == 0 and startup["launch_unix_s"] is None and startup["pid"] == os.getpid()
    assert startup["engine_s"] > 0 and startup["warm_up_s"] > 0
    first_eval_start_ms = read_log(run / "mlperf.log").find("eval_start")[0].time_ms
    ready_ms = 1000 * (startup["start_unix_s"] + startup["engine_s"] + startup["warm_up_s"])
    assert ready_ms <= first_eval_start_ms + 5  # warmed up before the first checkpoint's clock (rounding)


def test_verify_refit_catches_stale_weights_and_a_wrong_canary(engine_results):
    engine, checkpoints = engine_results.shared, engine_results.checkpoints
    w18, w19 = read_weights(checkpoints[18]), read_weights(checkpoints[19])
    engine.load_weights(w18)
    with pytest.raises(RefitError, match="step_19: the engine's weights differ"):
        verify_refit(engine, checkpoints[19], list(w19))  # the refit to step 19 "did not happen"
    engine.load_weights(w19)
    verify_refit(engine, checkpoints[19], list(w19))
    info = checkpoints[19].info
    bad = dataclasses.replace(checkpoints[19], info=dataclasses.replace(info, canary_logits=[x + 0.01 for x in info.canary_logits]))
    with pytest.raises(RefitError, match="canary logits differ"):
        verify_refit(engine, bad, list(w19))


def test_wrong_canary_in_training_info_stops_evaluation(run, capsys):
    logits = info_of(run, 19)["canary_logits"]
    set_info(run, 19, canary_logits=[logits[0] + 0.5] + logits[1:])
    assert main(["evaluate", str(run), "--retain-checkpoints"]) == 1
    assert "step_19: the engine's canary logits differ" in error_lines(capsys.readouterr().err)
    assert eval_steps(run / "mlperf.log") == [18]  # step 18 committed, nothing for step 19
    log = read_log(run / "mlperf.log")
    assert [e.metadata["step"] for e in log.find("eval_start")] == [18] and not log.find("run_stop")


# --------------------------------------------------------------------------- 5. verifier errors are not wrong answers

def test_reward_that_raises_fails_the_checkpoint(run, monkeypatch):
    bad_task = reward_fixtures.BAD_TASK
    suite = types.SimpleNamespace(validation_tasks=arithmetic.validation_tasks, train_tasks=arithmetic.train_tasks,
                                  reward=reward_fixtures.crashing_reward)
    monkeypatch.setitem(SUITES, "arithmetic", suite)
    before = (run / "mlperf.log").read_bytes()
    with pytest.raises(VerifierError, match=f"failed on 4 of 1004 completions \\(0 timeouts\\).*sandbox crashed on task {bad_task}"):
        evaluate_run(run, retain_checkpoints=True, show_progress=False)
    assert (run / "mlperf.log").read_bytes() == before
    assert not (run / "eval" / "step_18.jsonl").exists()


# --------------------------------------------------------------------------- 6. deterministic

def test_reevaluation_in_a_fresh_engine_is_identical(engine_results, finished):
    """The module's fresh engine on step 18 vs the `run` command's own evaluation."""
    header, rows = read_results(finished / "eval" / "step_18.jsonl")
    accuracy, results = engine_results.shared_18
    assert [(r["task_id"], r["completions"], r["rewards"]) for r in rows] == [
        (r.task_id, r.completions, r.rewards) for r in results
    ]
    assert accuracy == read_log(finished / "mlperf.log").find("eval_accuracy")[0].value
    config = engine_results.config
    assert header["seed"] == config.seed
    assert header["sampling"] == {"temperature": 0.1, "top_p": 0.95, "max_new_tokens": config.grpo.max_new_tokens}
    assert header["engine"] == engine_results.shared.describe()
    assert {"model", "dtype", "batch_size", "torch", "transformers", "sampler"} <= set(header["engine"])


# --------------------------------------------------------------------------- 7. strict target

def test_accuracy_equal_to_the_target_is_not_a_pass(run, finished, monkeypatch):
    step18 = read_log(finished / "mlperf.log").find("eval_accuracy")[0].value
    assert step18 == 171 / 251  # README calibration table: 0.681
    monkeypatch.setattr(rules, "TARGET_ACCURACY", step18)  # configs accept only the rules' target
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["validation"]["target_accuracy"] = step18
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    assert load_config(run / "config.yaml").validation.target_accuracy == step18
    outcome = evaluate_run(run, retain_checkpoints=True, show_progress=False)
    assert outcome.accuracies[18] == step18
    assert outcome.status == "success" and outcome.passing_step == 19
    assert eval_steps(run / "mlperf.log") == [18, 19]


# --------------------------------------------------------------------------- 8. N workers, committed in step order

def never_passing(trained, dst):
    """The trained run cut after step_19 (as if training had published up to it): no
    checkpoint passes (step 20 is the first that does)."""
    run = copy_run(trained, dst)
    for step in range(20, 31):
        shutil.rmtree(run / "checkpoints" / f"step_{step}")
    end = json.loads((run / "checkpoints" / "training_end.json").read_text())
    (run / "checkpoints" / "training_end.json").write_text(json.dumps({**end, "last_published_step": 19}))
    return run


def descendants(pid):
    """Every live process below ``pid`` (Linux /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def evaluate_with(run, workers):
    assert main(["evaluate", str(run), "--retain-checkpoints", "--workers", str(workers)]) in (0, 3)
    return normalized(run / "mlperf.log")


def test_two_workers_log_equals_one_workers_pass_at_the_3rd_checkpoint(trained, finished, tmp_path):
    run = copy_run(trained, tmp_path / "two")
    assert evaluate_with(run, 2) == normalized(finished / "mlperf.log")
    assert eval_steps(run / "mlperf.log") == [18, 19, 20]
    for step in (18, 19, 20):  # the logged results moved out of eval/unlogged/, the same bytes as serial
        assert read_results(run / "eval" / f"step_{step}.jsonl") == read_results(finished / "eval" / f"step_{step}.jsonl")
    assert sorted(p.name for p in (run / "eval").glob("step_*.jsonl")) == [f"step_{s}.jsonl" for s in (18, 19, 20)]
    assert all(int(p.stem.split("_")[1]) > 20 for p in (run / "eval" / "unlogged").glob("*.jsonl"))
    startups = [json.loads(l) for l in (run / "eval" / "startup.jsonl").read_text().splitlines()]
    assert sorted(s["rank"] for s in startups) == [0, 1]  # each rank warmed up its engine, launched by the evaluator
    assert all(s["launch_unix_s"] <= s["start_unix_s"] and s["warm_up_s"] > 0 for s in startups)


def test_more_workers_than_pending_checkpoints_start_one_per_checkpoint(trained, tmp_path, monkeypatch, capsys):
    """``--workers 64`` with one checkpoint to evaluate evaluates it with one worker here
    and launches no ranks (a worker beyond the pending checkpoints would claim nothing;
    64 engines would exhaust the machine), says so in one note, and logs what one worker
    logs."""
    from mlperf_grpo.evaluate import offline

    def only_step_18(dst):
        run = never_passing(trained, dst)
        shutil.rmtree(run / "checkpoints" / "step_19")
        end = json.loads((run / "checkpoints" / "training_end.json").read_text())
        (run / "checkpoints" / "training_end.json").write_text(json.dumps({**end, "last_published_step": 18}))
        return run

    one, many = only_step_18(tmp_path / "one"), only_step_18(tmp_path / "many")
    launched = []
    monkeypatch.setattr(offline, "launch", lambda entrypoint, args, nprocs: launched.append(nprocs) or {})
    assert evaluate_with(many, 64) == evaluate_with(one, 1)
    assert launched == []
    assert "note: 1 checkpoint(s) to evaluate: 1 worker(s), not 64" in capsys.readouterr().err
    assert eval_steps(many / "mlperf.log") == [18]


def test_two_workers_log_equals_one_workers_when_nothing_passes(trained, tmp_path):
    one, two = never_passing(trained, tmp_path / "one"), never_passing(trained, tmp_path / "two")
    assert evaluate_with(one, 1) == evaluate_with(two, 2)
    log = read_log(two / "mlperf.log")
    assert eval_steps(two / "mlperf.log") == [18, 19]
    assert [(e.metadata["status"], e.metadata["step"]) for e in log.find("run_stop")] == [("aborted", 19)]


def spawn_two_worker_evaluate(run, err_path):
    """``evaluate RUN --workers 2`` in its own process group (as a terminal's foreground
    job: Ctrl-C reaches the whole group), stderr to ``err_path``."""
    with open(err_path, "w") as err:
        return subprocess.Popen([sys.executable, "-m", "mlperf_grpo.cli", "evaluate", str(run), "--retain-checkpoints",
                                 "--workers", "2"], stdout=subprocess.DEVNULL, stderr=err,
                                preexec_fn=lambda: (signal.signal(signal.SIGINT, signal.SIG_DFL), os.setpgrp()))


def running(pid):
    """``pid`` exists and is not a zombie."""
    try:
        return "Z" not in open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1][:3]
    except OSError:
        return False


def seconds_until_gone(pids, since, timeout_s=60.0):
    """Seconds from ``since`` (monotonic) until none of ``pids`` runs (zombies count as gone)."""
    while any(running(pid) for pid in pids):
        assert time.monotonic() - since < timeout_s, "a process outlived the evaluator by a minute"
        time.sleep(0.01)
    return time.monotonic() - since


def stderr_lines(path):
    """stderr's lines without the progress bar's redraws."""
    lines = path.read_text().replace("\r", "\n").splitlines()
    return [line.split("]", 1)[1] if line.startswith("evaluate:") and "]" in line else line
            for line in lines if line.strip() and not (line.startswith("evaluate:") and line.rstrip().endswith("]"))]


def test_killed_two_worker_evaluation_resumes_with_one_worker_to_the_same_log(trained, finished, tmp_path):
    """SIGKILL of the evaluator after its first commit: its ranks (forked from the fork
    server, which is not the evaluator), their reward workers and the fork server stop
    within a second, before printing anything (no store error, no traceback); only the
    resource tracker's note on the killed evaluator's own semaphores (torch's launcher)
    follows; resumed with one worker, the log is the serial one."""
    run = copy_run(trained, tmp_path / "run")
    proc = spawn_two_worker_evaluate(run, tmp_path / "killed.err")
    assert wait_for(lambda: count_evals(run) >= 1, proc), "the evaluator exited before its first commit"
    processes = descendants(proc.pid)
    assert len(processes) >= 4, "no worker ranks were started"  # fork server, resource tracker, 2 ranks, reward workers
    killed = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    tracker = {pid for pid in processes if "resource_tracker" in open(f"/proc/{pid}/cmdline").read()}
    assert seconds_until_gone(processes - tracker, killed) < 1.0
    seconds_until_gone(tracker, killed)
    after_kill = stderr_lines(tmp_path / "killed.err")
    assert not [line for line in after_kill if "leaked semaphore" not in line and "warnings.warn(" not in line], after_kill
    cut = (run / "mlperf.log").read_text()
    assert not read_log(run / "mlperf.log").find("run_stop")
    assert evaluate_with(run, 1) == normalized(finished / "mlperf.log")
    assert (run / "mlperf.log").read_text().startswith(cut)


@pytest.mark.parametrize("signum, code, name", [(signal.SIGTERM, 143, "stopped by SIGTERM"),
                                                (signal.SIGINT, 130, "interrupted (Ctrl-C)")])
def test_signal_during_two_worker_evaluate_prints_one_line_and_leaves_nothing_running(trained, finished, tmp_path,
                                                                                      signum, code, name):
    """SIGTERM to the evaluator, or Ctrl-C to its whole process group (as a terminal
    sends it: the ranks get it too), after its first commit: our one line and nothing
    else (no launcher warning, no leaked-semaphore warning: a rank's progress-bar lock is
    a thread lock), the fork server and the ranks gone within a second of the
    evaluator's exit, and the run resumes to the uninterrupted log."""
    run = copy_run(trained, tmp_path / "run")
    proc = spawn_two_worker_evaluate(run, tmp_path / "stopped.err")
    assert wait_for(lambda: count_evals(run) >= 1, proc), "the evaluator exited before its first commit"
    processes = descendants(proc.pid)
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    assert proc.wait(timeout=60) == code
    assert seconds_until_gone(processes, time.monotonic()) < 1.0
    assert stderr_lines(tmp_path / "stopped.err") == [
        f"mlperf-grpo: evaluation {name}; the log holds only whole evaluations (no partial one, no run_stop): "
        f"'mlperf-grpo evaluate {run}' resumes it"]
    log = read_log(run / "mlperf.log")
    assert not log.bad_lines and not log.find("run_stop") and (run / "checkpoints" / "step_30").is_dir()
    assert evaluate_with(run, 2) == normalized(finished / "mlperf.log")


# --------------------------------------------------------------------------- 9. the ranks of a torchrun, any nodes

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
MLPERF_GRPO = str(Path(sys.executable).parent / "mlperf-grpo")


def torchrun_evaluate(run, launcher_args, *evaluate_args, timeout_s=300):
    """``torchrun LAUNCHER_ARGS --no-python mlperf-grpo evaluate RUN --retain-checkpoints
    ARGS``; a hang fails the test (timeout)."""
    return subprocess.run([*TORCHRUN, *launcher_args, "--no-python", MLPERF_GRPO, "evaluate", str(run),
                           "--retain-checkpoints", *evaluate_args],
                          capture_output=True, text=True, timeout=timeout_s, cwd=run.parent)


def two_node_evaluate(run, out_dir, timeout_s=300):
    """Two torchrun agents, as on two nodes (``--nnodes 2 --nproc-per-node 1``, c10d
    rendezvous on a local port), each running ``evaluate RUN``; returns their
    ``(returncode, stdout, stderr)``. A hang fails the test (timeout); both are killed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    try:
        for node in range(2):
            with open(out_dir / f"node{node}.out", "w") as out, open(out_dir / f"node{node}.err", "w") as err:
                procs.append(subprocess.Popen(
                    [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"eval-{port}", "--no-python", MLPERF_GRPO,
                     "evaluate", str(run), "--retain-checkpoints"], stdout=out, stderr=err, cwd=run.parent))
        deadline = time.monotonic() + timeout_s
        codes = [proc.wait(timeout=max(1.0, deadline - time.monotonic())) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [(code, (out_dir / f"node{n}.out").read_text(), (out_dir / f"node{n}.err").read_text())
            for n, code in enumerate(codes)]


def ranks_that_evaluated(run):
    return {json.loads(line)["rank"] for line in (run / "eval" / "timing.jsonl").read_text().splitlines()}


def test_torchrun_ranks_log_equals_the_serial_log_and_passes_the_checker(trained, finished, tmp_path):
    run = copy_run(trained, tmp_path / "run")
    proc = torchrun_evaluate(run, ["--standalone", "--nproc-per-node", "2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert normalized(run / "mlperf.log") == normalized(finished / "mlperf.log")  # pass at the 3rd checkpoint
    assert proc.stdout.count("status: success") == 1 and "passing step: 20" in proc.stdout  # rank 0 alone prints
    assert ranks_that_evaluated(run) == {0, 1}
    for step in (18, 19, 20):
        assert read_results(run / "eval" / f"step_{step}.jsonl") == read_results(finished / "eval" / f"step_{step}.jsonl")
    report = check_log(run / "mlperf.log")
    assert report.official.verdict == "SUCCESS" and report.clean, (report.official.messages, report.findings)


def test_two_torchrun_nodes_log_equals_the_serial_log(trained, finished, tmp_path):
    run = copy_run(trained, tmp_path / "run")
    nodes = two_node_evaluate(run, tmp_path)
    assert [code for code, _, _ in nodes] == [0, 0], [err[-3000:] for _, _, err in nodes]
    assert normalized(run / "mlperf.log") == normalized(finished / "mlperf.log")
    assert sorted(out.count("status: success") for _, out, _ in nodes) == [0, 1]  # global rank 0, on one of them
    assert ranks_that_evaluated(run) == {0, 1}  # each node's rank evaluated checkpoints
    assert check_log(run / "mlperf.log").official.verdict == "SUCCESS"


def test_two_torchrun_nodes_stop_at_rank_0s_error_without_a_hang(trained, tmp_path):
    """Rank 0 refuses the run at a corrupt checkpoint: it exits 2 with its line; the rank
    on the other node exits 1 with that line (so its torchrun does not wait out the 300 s
    exit barrier for a node that failed); both torchruns end within the timeout."""
    run = copy_run(trained, tmp_path / "run")
    flip_byte(run, 19)  # no pass before it: rank 0's committer refuses the run there
    nodes = two_node_evaluate(run, tmp_path, timeout_s=240)
    refusal = (f"step_19/{SHARD}: xxh3_128 differs from training_info.json; the checkpoint is corrupt; no earlier "
               "checkpoint passed, so the run cannot be scored past it: restore step_19/ from a copy and run evaluate "
               "again (it resumes there), or train again")
    ours = sorted(line for _, _, err in nodes for line in err.splitlines() if line.startswith("mlperf-grpo:"))
    assert ours == [f"mlperf-grpo: error: {refusal}", f"mlperf-grpo: rank 1: error: rank 0 failed: {refusal}"], ours
    stderr = "".join(err for _, _, err in nodes)
    assert "exitcode  : 2" in stderr and "exitcode  : 1" in stderr and "mlperf_grpo/" not in stderr
    assert all(code != 0 for code, _, _ in nodes)
    assert eval_steps(run / "mlperf.log") == [18] and not read_log(run / "mlperf.log").find("run_stop")


def test_torchrun_refuses_more_workers_than_ranks_with_one_line(trained, tmp_path):
    run = copy_run(trained, tmp_path / "run")
    before = (run / "mlperf.log").read_bytes()
    refusal = "under torchrun the evaluation workers are its 2 rank(s) (WORLD_SIZE 2): leave out --workers, or give --workers 2"
    proc = torchrun_evaluate(run, ["--standalone", "--nproc-per-node", "2"], "--workers", "3", timeout_s=120)
    ours = [line for line in proc.stderr.splitlines() if line.startswith("mlperf-grpo:")]
    assert ours[0] == f"mlperf-grpo: error: {refusal}", proc.stderr[-3000:]  # rank 0's line; rank 1 exits 0 ...
    assert all(line == "mlperf-grpo: rank 1: stopped by SIGTERM" for line in ours[1:]), ours  # ... unless torchrun stopped it first
    assert "exitcode  : 2" in proc.stderr and proc.returncode != 0
    assert "mlperf_grpo/" not in proc.stderr  # no traceback of ours (torchrun prints its own)
    assert (run / "mlperf.log").read_bytes() == before and not (run / "eval").exists()


def test_other_ranks_stop_within_the_silence_limit_when_rank_0_is_killed(trained, finished, tmp_path):
    """Two ranks of a torchrun on two nodes, the store hosted elsewhere (here, as by the
    agent that hosts the rendezvous): rank 0 SIGKILLed after its first commit. Rank 1
    sees its heartbeat stand still and exits 1 with one line within RANK0_SILENCE_S (plus
    the checkpoint it is evaluating), instead of waiting on the store for 24 h; the run
    resumes to the uninterrupted log."""
    from torch.distributed import TCPStore

    from mlperf_grpo.evaluate.launch import RANK0_SILENCE_S

    run = copy_run(trained, tmp_path / "run")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841  (the agent's store)
    procs = []
    try:
        for rank in (0, 1):
            env = {**os.environ, "TORCHELASTIC_RUN_ID": "test", "RANK": str(rank), "LOCAL_RANK": "0",
                   "GROUP_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
            with open(tmp_path / f"rank{rank}.err", "w") as err:
                procs.append(subprocess.Popen([sys.executable, "-m", "mlperf_grpo.cli", "evaluate", str(run),
                                               "--retain-checkpoints"], env=env, stdout=subprocess.DEVNULL, stderr=err))
        assert wait_for(lambda: count_evals(run) >= 1, procs[0]), "rank 0 exited before its first commit"
        killed = time.monotonic()
        procs[0].send_signal(signal.SIGKILL)
        assert procs[1].wait(timeout=RANK0_SILENCE_S + 60) == 1
        assert time.monotonic() - killed < RANK0_SILENCE_S + 30
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    err = (tmp_path / "rank1.err").read_text()
    assert error_lines(err) == (
        f"mlperf-grpo: rank 1: error: rank 0 is gone (its heartbeat in the store stood still for {RANK0_SILENCE_S:g} s: "
        "killed, or its node lost); this rank stops. Nothing partial was logged: run the same evaluate command again "
        "to resume the run")
    assert not read_log(run / "mlperf.log").find("run_stop")
    assert evaluate_with(run, 1) == normalized(finished / "mlperf.log")


@pytest.mark.parametrize("evaluate_args, refusal", [
    (["RUN", "--follow"], "--follow evaluates with one worker, not torchrun's 2 ranks: run it without torchrun (or with "
                          "one rank)"),
    (["--checkpoints", "CKPT", "--mllog", "LOG", "--config", "C"],
     "under torchrun (2 ranks) evaluate takes RUN_DIR alone (a run our trainer wrote); another trainer's series "
     "(--checkpoints/--mllog/--config) is evaluated by one worker: run it without torchrun"),
])
def test_rank_0_of_two_refuses_what_one_worker_does(tmp_path, monkeypatch, capsys, evaluate_args, refusal):
    """Rank 0 of a 2-rank torchrun (its environment, serving the store itself: no agent)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"TORCHELASTIC_RUN_ID": "test", "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "WORLD_SIZE": "2",
                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "TORCHELASTIC_USE_AGENT_STORE": "False"}.items():
        monkeypatch.setenv(name, value)
    assert main(["evaluate", *[str(tmp_path / a) if a.isupper() else a for a in evaluate_args]]) == 2
    assert error_lines(capsys.readouterr().err) == f"mlperf-grpo: error: {refusal}"
    assert list(tmp_path.iterdir()) == []


def test_a_finished_run_under_torchrun_exits_0_on_every_rank(finished, tmp_path):
    run = copy_run(finished, tmp_path / "run")
    log, summary = (run / "mlperf.log").read_bytes(), (run / "eval" / "summary.json").read_bytes()
    proc = torchrun_evaluate(run, ["--standalone", "--nproc-per-node", "2"], timeout_s=120)
    assert proc.returncode == 0, proc.stderr[-3000:]  # torchrun exits 0 only when every rank did
    assert proc.stdout.count("status: success") == 1
    assert (run / "mlperf.log").read_bytes() == log and (run / "eval" / "summary.json").read_bytes() == summary


def test_old_checkpoint_without_a_fingerprint_is_reported_unchecked(engine_results):
    engine, checkpoints = engine_results.shared, engine_results.checkpoints
    weights = read_weights(checkpoints[19])
    engine.load_weights(weights)
    info = checkpoints[19].info
    old = dataclasses.replace(checkpoints[19], info=dataclasses.replace(
        info, weights={k: v for k, v in info.weights.items() if k != "fingerprint"}))
    assert verify_refit(engine, old, list(weights)) == "canary (fingerprint unchecked: none recorded)"
    engine.load_weights(read_weights(checkpoints[18]))
    with pytest.raises(RefitError, match="canary logits differ"):  # the canary is still checked
        verify_refit(engine, old, list(weights))


# --------------------------------------------------------------------------- tensor-parallel workers (issue 28)

def _set_tensor_parallel_size(run, t):
    config = yaml.safe_load((run / "config.yaml").read_text())
    config.setdefault("inference", {})["tensor_parallel_size"] = t
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


@pytest.mark.parametrize("world, t, refusal", [
    (None, 2, "inference.tensor_parallel_size 2 splits each evaluation worker's hf engine over 2 ranks: run evaluate RUN_DIR "
              "under torchrun with a multiple of 2 ranks (e.g. torchrun --nproc-per-node 2 ...), or set "
              "inference.tensor_parallel_size 1"),
    ("2", 4, "inference.tensor_parallel_size 4 does not divide the world size 2: set inference.tensor_parallel_size to "
             "a common divisor of the world size and the heads, or launch a multiple of 4 ranks"),
])
def test_a_tensor_parallel_evaluation_that_cannot_form_its_groups_is_refused(run, monkeypatch, capsys, world, t, refusal):
    _set_tensor_parallel_size(run, t)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    if world is not None:  # rank 0 of a torchrun world (serving the store itself)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for name, value in {"TORCHELASTIC_RUN_ID": "test", "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0",
                            "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "False"}.items():
            monkeypatch.setenv(name, value)
    assert main(["evaluate", str(run)]) == 2
    assert error_lines(capsys.readouterr().err) == f"mlperf-grpo: error: {refusal}"
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
