"""Fault injection on the offline evaluator (issue 5, evaluator side), the series is checked first:
damaged, missing or changed checkpoints and model files are refused before anything is evaluated, or
never read when after the pass. The runs are copies of the default run that ``conftest.py`` makes
once (``finished``, ``trained``, ``run``).
"""

import json
import os
import shutil

import pytest
import yaml
from faults_eval_helpers import SHARD, error_lines, eval_steps, flip_byte, info_of, normalized, set_info
from safetensors.torch import load_file, save_file

from mlperf_grpo import rules
from mlperf_grpo.checkpoint import discover_checkpoints
from mlperf_grpo.cli import main
from mlperf_grpo.config.load import load_config
from mlperf_grpo.evaluate import series
from mlperf_grpo.logs.mllog import read_log
from mlperf_grpo.model.files import BUILTIN_MODEL_DIR
from mlperf_grpo.tasks import load_validation_set

pytestmark = pytest.mark.slow


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



def _rename_tensor(update_record):
    """Rename a tensor of step_19 (a consistent shard, index and hash; with
    ``update_record`` also the tensor digest of its training_info.json)."""
    def damage(run):
        from mlperf_grpo.checkpoint.format import SAFETENSORS_DTYPES, tensor_specs_digest
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
    notes, problem = series.check_series(checkpoints, config, load_validation_set(config), read_log(run / "mlperf.log"),
                                         run / "checkpoints")
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
