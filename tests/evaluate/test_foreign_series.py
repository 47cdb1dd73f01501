"""``evaluate --checkpoints``: series other trainers wrote (issue 13).

One small run of our trainer (open division, first eval step 3, a learning rate at which
the built-in model passes at step 4) is evaluated as our trainer wrote it, and as
converted by ``foreign_layouts`` into NeMo-RL (safetensors, DCP v1, DCP v2) and Hugging
Face directories plus a manifest: each gives the same accuracies, passing step and
``run_stop``, and the official compliance checker passes each log.
"""

import json
import os
import shutil
import subprocess
import sys

import foreign_layouts
import pytest
import torch
import yaml

from mlperf_grpo.checkpoint import CheckpointError, discover_checkpoints, read_weights
from mlperf_grpo.checkpoint import foreign_layouts as foreign
from mlperf_grpo.cli import main
from mlperf_grpo.config.rundir import RunLock
from mlperf_grpo.evaluate.offline import evaluate_run
from mlperf_grpo.logs.mllog import read_log

pytestmark = pytest.mark.slow

CONFIG = {"division": "open",
          "grpo": {"num_prompts_per_step": 2, "max_steps": 6, "first_eval_step": 3, "micro_batch_size": 32},
          "optimizer": {"learning_rate": 0.00003}}
"""Measured on CPU: accuracy 0.653, 0.681, 0.689, 0.713 at steps 1-4, so the series
passes at step 4 after an evaluation that does not (0.69 is the target); the official
checker needs a pass, and eval_samples 251 (the default validation) in every division."""
def _megatron(run, out):
    """The Megatron series, written once per run (megatron-core at 2 ranks takes about 15 s) and copied."""
    cache = run.parent / f"{run.name}-megatron"
    if not cache.is_dir():
        foreign_layouts.to_nemo_rl(run, cache, "megatron")
    shutil.copytree(cache, out)
    return out


LAYOUTS = {
    "nemo-rl-safetensors": lambda run, out: foreign_layouts.to_nemo_rl(run, out, "safetensors"),
    "nemo-rl-dcp": lambda run, out: foreign_layouts.to_nemo_rl(run, out, "dcp"),
    "nemo-rl-dcp-v2": lambda run, out: foreign_layouts.to_nemo_rl(run, out, "dcp-v2"),
    "nemo-rl-sharded": lambda run, out: foreign_layouts.to_nemo_rl(run, out, "sharded"),
    "nemo-rl-consolidated": lambda run, out: foreign_layouts.to_nemo_rl(run, out, "consolidated"),
    "hf-dirs": foreign_layouts.to_hf_dirs,
    "nemo-rl-megatron": _megatron,
}
DATA_FILE = {
    "nemo-rl-safetensors": "step_{step}/policy/weights/model/shard-00001-model-00001-of-00001.safetensors",
    "nemo-rl-dcp": "step_{step}/policy/weights/__0_0.distcp",
    "nemo-rl-dcp-v2": "step_{step}/policy/weights/model/__0_0.distcp",
    "nemo-rl-sharded": "step_{step}/policy/weights/model/shard-00002-model-00001-of-00001.safetensors",
    "nemo-rl-consolidated": "step_{step}/policy/weights/model/consolidated/model-00001-of-00001.safetensors",
    "hf-dirs": "models/ckpt-{step}/model-00001-of-00001.safetensors",
    "nemo-rl-megatron": "step_{step}/policy/weights/iter_0000000/__1_0.distcp",
}
"""One data file of each layout's checkpoint of a step (the file the evaluator reads)."""
FOUND_BY_THE_SERIES_CHECK = {"nemo-rl-safetensors", "nemo-rl-sharded", "nemo-rl-consolidated", "hf-dirs"}
"""Layouts whose truncated file the series check finds (safetensors headers give each
file's size) before anything is logged; a DCP file is found when it is read."""
EVALUATE_TIMEOUT_S = 300
"""A subprocess evaluation that runs longer hangs: 2 checkpoints take about 40 s here."""


def official_check(log_path):
    proc = subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                           "--ruleset", "6.1.0", str(log_path)], capture_output=True, text=True, cwd=log_path.parent)
    return proc.stdout + proc.stderr


def results(log_path):
    """``([(step, accuracy)], run_stop (time_ms, status, samples_count, step))`` of a log."""
    log = read_log(log_path)
    (stop,) = log.find("run_stop")
    evals = [(e.metadata["step"], e.value) for e in log.find("eval_accuracy")]
    return evals, (stop.time_ms, stop.metadata["status"], stop.metadata["samples_count"], stop.metadata["step"])


def error_line(err):
    lines = [line for line in err.splitlines() if line.startswith("mlperf-grpo:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The run as training left it: checkpoints, a log with no evaluation."""
    base = tmp_path_factory.mktemp("foreign")
    (base / "c.yaml").write_text(yaml.safe_dump(CONFIG))
    run = base / "trained"
    assert main(["train", "--config", str(base / "c.yaml"), "--output", str(run)]) == 0
    return run


@pytest.fixture(scope="module")
def reference_run(trained, tmp_path_factory):
    """``evaluate`` on a copy of the run as our trainer wrote it."""
    run = tmp_path_factory.mktemp("foreign") / "reference"
    shutil.copytree(trained, run)
    (run / "run.json").write_text(json.dumps({"mllog_file": "mlperf.log"}))
    outcome = evaluate_run(run, retain_checkpoints=True, show_progress=False)
    assert outcome.status == "success", f"the fixture run must pass for the official checker; got {outcome.accuracies}"
    return run


@pytest.fixture(scope="module")
def reference(reference_run):
    return results(reference_run / "mlperf.log")


def convert(trained, tmp_path, layout):
    series = LAYOUTS[layout](trained, tmp_path / layout)
    log = tmp_path / "train.log"
    shutil.copy(trained / "mlperf.log", log)
    return series, log


@pytest.mark.parametrize("layout", ["nemo-rl-safetensors", "nemo-rl-dcp", "nemo-rl-consolidated", "hf-dirs", "nemo-rl-megatron"])  # DCP v2,
# per-rank shards: tensors test below
def test_each_layout_gives_the_results_of_the_original(trained, reference, tmp_path, capsys, monkeypatch, layout):
    monkeypatch.delenv("RETAIN_GRPO_CHECKPOINTS", raising=False)
    series, log = convert(trained, tmp_path, layout)
    assert main(["evaluate", "--checkpoints", str(series), "--mllog", str(log), "--config", str(trained / "config.yaml")]) == 0
    err = capsys.readouterr().err
    assert "not checked" in err and "weight file hashes" in err and "canary logits" in err  # reported, not invented
    assert results(log) == reference
    assert "SUCCESS" in official_check(log)
    # teardown keeps another trainer's series, saying so; the evaluator's records are there too
    assert f"note: kept the checkpoints of {series}" in err
    assert len(list(series.glob("step_*")) + list(series.glob("models/ckpt-*"))) == len(list((trained / "checkpoints").glob("step_*")))
    source = json.loads((series / "eval" / "source.json").read_text())
    assert source["format"] == ("hf-dirs" if layout == "hf-dirs" else "nemo-rl") and source["unchecked"]
    # evaluating again reports the outcome and writes nothing
    before = log.read_bytes()
    capsys.readouterr()
    assert main(["evaluate", "--checkpoints", str(series), "--mllog", str(log), "--config", str(trained / "config.yaml")]) == 0
    assert log.read_bytes() == before
    out = capsys.readouterr().out  # the folder evaluated is named as what it is: not a run directory
    assert f"\ncheckpoints: {series}\n" in out and "run directory" not in out


def test_eval_log_then_merge_gives_the_same_log(trained, reference, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RETAIN_GRPO_CHECKPOINTS", "1")
    series, log = convert(trained, tmp_path, "nemo-rl-dcp")
    training_bytes = log.read_bytes()
    eval_log = tmp_path / "eval.log"
    args = ["evaluate", "--checkpoints", str(series), "--mllog", str(log), "--config", str(trained / "config.yaml"),
            "--eval-log", str(eval_log)]
    assert main(args) == 0
    assert log.read_bytes() == training_bytes  # the training log is only read
    assert sorted(p.name for p in series.glob("step_*")) == sorted(p.name for p in (trained / "checkpoints").glob("step_*"))
    merged = tmp_path / "merged.log"
    assert main(["merge", "--train", str(log), "--eval", str(eval_log), "--output", str(merged)]) == 0
    assert results(merged) == reference
    assert "SUCCESS" in official_check(merged)
    assert main(args) == 0 and main(["merge", "--train", str(log), "--eval", str(eval_log), "--output", str(merged)]) == 0
    assert results(merged) == reference  # resumed: nothing evaluated twice


def test_an_interrupted_evaluation_resumes_after_its_logged_evaluations(trained, reference_run, reference, tmp_path,
                                                                         monkeypatch):
    """The log holds the first checkpoint's evaluation, as an evaluator killed after it
    leaves it: only the later checkpoints are evaluated, and the log ends as the original."""
    evals = reference[0]
    if len(evals) < 2:
        pytest.skip(f"the run passed at its first checkpoint ({evals}): nothing to resume after")
    monkeypatch.delenv("RETAIN_GRPO_CHECKPOINTS", raising=False)
    series, log = convert(trained, tmp_path, "hf-dirs")
    first = [line for line in (reference_run / "mlperf.log").read_text().splitlines(keepends=True)
             if '"key": "eval_' in line and f'"step": {evals[0][0]}' in line]
    assert len(first) == 3
    log.write_text(log.read_text() + "".join(first))
    assert main(["evaluate", "--checkpoints", str(series), "--mllog", str(log), "--config", str(trained / "config.yaml")]) == 0
    assert results(log) == reference
    assert not (series / "eval" / f"step_{evals[0][0]}.jsonl").exists()  # not evaluated again
    assert (series / "eval" / f"step_{evals[1][0]}.jsonl").is_file()


def test_ours_outside_a_run_directory(trained, reference, tmp_path, monkeypatch):
    """Our own layout through --checkpoints: hash-verified reads and the canary still apply."""
    monkeypatch.delenv("RETAIN_GRPO_CHECKPOINTS", raising=False)
    series = tmp_path / "ckpts"
    shutil.copytree(trained / "checkpoints", series)
    log = tmp_path / "train.log"
    shutil.copy(trained / "mlperf.log", log)
    assert main(["evaluate", "--checkpoints", str(series), "--mllog", str(log), "--config", str(trained / "config.yaml"),
                 "--format", "ours"]) == 0
    assert results(log) == reference
    assert not list(series.glob("step_*")) and (series / "eval" / "summary.json").is_file()


def test_ours_at_a_run_that_keeps_its_checkpoints_keeps_them(trained, tmp_path, capsys, monkeypatch):
    """--checkpoints RUN/checkpoints of a run trained with --retain-checkpoints: the run's
    choice holds there too (they were all deleted, those after the passing one unevaluated)."""
    monkeypatch.delenv("RETAIN_GRPO_CHECKPOINTS", raising=False)
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    (run / "run.json").write_text(json.dumps({"mllog_file": "mlperf.log", "retain_checkpoints": True}))
    steps = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert main(["evaluate", "--checkpoints", str(run / "checkpoints"), "--mllog", str(run / "mlperf.log"),
                 "--config", str(run / "config.yaml")]) == 0
    assert "records that its run keeps its checkpoints: they are kept" in capsys.readouterr().err
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == steps


def _tree(root):
    """Every file under ``root`` (relative path -> bytes)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_teardown_keeps_another_trainers_series_wherever_it_lies(trained, tmp_path, capsys, monkeypatch):
    """An hf-dirs manifest naming folders outside DIR, each with a user file, and a NeMo-RL
    results folder (step_N/ and tmp_step_N/): nothing of either is deleted."""
    monkeypatch.delenv("RETAIN_GRPO_CHECKPOINTS", raising=False)
    outside = foreign_layouts.to_hf_dirs(trained, tmp_path / "elsewhere")
    exported = tmp_path / "exported"
    exported.mkdir()
    lines = [json.loads(line) for line in (outside / "manifest.jsonl").read_text().splitlines()]
    for line in lines:
        line["path"] = str(outside / line["path"])  # absolute, outside exported/
        (outside / line["path"] / "my-notes.txt").write_text("the user's")
    (exported / "manifest.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    nemo, log = convert(trained, tmp_path, "nemo-rl-safetensors")
    before = {"outside": _tree(outside), "nemo": _tree(nemo)}
    for series in (exported, nemo):
        assert main(["evaluate", "--checkpoints", str(series), "--mllog", str(log), "--config", str(trained / "config.yaml")]) == 0
        assert f"note: kept the checkpoints of {series}" in capsys.readouterr().err
        shutil.copy(trained / "mlperf.log", log)  # the next series' training log, unevaluated
    assert _tree(outside) == before["outside"]
    after = _tree(nemo)
    assert {k: v for k, v in after.items() if not k.startswith("eval/") and k != ".lock"} == before["nemo"]
    assert (nemo / "tmp_step_7").is_dir()


def test_teardown_deletes_only_what_our_trainer_wrote(trained, tmp_path, capsys, monkeypatch):
    """Our layout outside a run directory: the writer's files go, a user's file in a
    step_N/, a folder in one and a file beside them stay; one line says which."""
    monkeypatch.delenv("RETAIN_GRPO_CHECKPOINTS", raising=False)
    series = tmp_path / "ckpts"
    shutil.copytree(trained / "checkpoints", series)
    (series / "step_4" / "my-notes.txt").write_text("the user's")
    (series / "step_3" / "extra").mkdir()
    (series / "step_3" / "extra" / "model.safetensors").write_text("a user's folder, whatever its files are called")
    (series / "README.txt").write_text("the user's")
    log = tmp_path / "train.log"
    shutil.copy(trained / "mlperf.log", log)
    assert main(["evaluate", "--checkpoints", str(series), "--mllog", str(log), "--config", str(trained / "config.yaml")]) == 0
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "teardown" in line]
    steps = ", ".join(f"step_{s}" for s in range(3, 7))
    assert line == (f"note: teardown deleted the checkpoint files of {steps} in {series}; kept what our trainer does "
                    "not write: step_3/extra, step_4/my-notes.txt")
    assert sorted(p.name for p in series.iterdir()) == [".lock", "README.txt", "eval", "step_3", "step_4", "training_end.json"]
    assert sorted(_tree(series / "step_3")) == ["extra/model.safetensors"] and sorted(_tree(series / "step_4")) == ["my-notes.txt"]


SETTINGS_EDITS = [
    ({"validation": {"temperature": 0.7}}, "validation.temperature", 0.7, 0.1),
    ({"seed": 7}, "seed", 7, 1),
    ({"validation": {"generations_per_task": 8}}, "validation.generations_per_task", 8, 4),
]


def _edited_config(trained, path, edit):
    config = yaml.safe_load((trained / "config.yaml").read_text())
    for key, value in edit.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("where", ["run-dir", "checkpoints"])
@pytest.mark.parametrize("edit, key, new, old", SETTINGS_EDITS)
def test_evaluation_settings_changed_after_training_are_refused(trained, tmp_path, capsys, where, edit, key, new, old):
    """config.yaml edited after training (or another --config for our series): exit 2
    naming the key, the new and the recorded value; nothing logged or deleted."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    (run / "run.json").write_text(json.dumps({"mllog_file": "mlperf.log"}))
    if where == "run-dir":
        _edited_config(trained, run / "config.yaml", edit)
        args = ["evaluate", str(run)]
    else:
        args = ["evaluate", "--checkpoints", str(run / "checkpoints"), "--mllog", str(run / "mlperf.log"),
                "--config", str(_edited_config(trained, tmp_path / "edited.yaml", edit))]
    before = {"log": (run / "mlperf.log").read_bytes(), "checkpoints": sorted(p.name for p in (run / "checkpoints").iterdir())}
    assert main(args) == 2
    line = error_line(capsys.readouterr().err)
    assert f"the config's {key} is {new!r}, but the" in line and f" {old!r} (" in line, line
    assert (run / "mlperf.log").read_bytes() == before["log"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name not in ("eval", ".lock")) == before["checkpoints"]


def test_another_trainers_series_is_checked_against_its_logged_settings(trained, tmp_path, capsys):
    series, log = convert(trained, tmp_path, "nemo-rl-safetensors")
    edited = _edited_config(trained, tmp_path / "edited.yaml", {"validation": {"temperature": 0.7}})
    assert main(["evaluate", "--checkpoints", str(series), "--mllog", str(log), "--config", str(edited)]) == 2
    line = error_line(capsys.readouterr().err)
    assert "validation.temperature is 0.7, but the log's generation_validation_rollout_temperature is 0.1" in line


def test_the_recorded_settings_are_the_identity_and_only_it(trained):
    """Each identity setting is compared with the checkpoint's record (also where the log
    would say it first); the engine's speed settings are not part of it; a checkpoint
    written before the record existed is evaluated with a note."""
    import dataclasses

    from mlperf_grpo.config.load import load_config
    from mlperf_grpo.evaluate.series import EvaluationError, check_evaluation_settings
    from mlperf_grpo.tasks import load_validation_set

    first = discover_checkpoints(trained / "checkpoints")[0][0]
    config = load_config(trained / "config.yaml")
    tasks = load_validation_set(config).tasks
    assert first.info.evaluation["validation.temperature"] == 0.1 and first.info.evaluation["seed"] == 1
    with pytest.raises(EvaluationError, match=r"validation.temperature is 0.7, but the checkpoints were trained with 0.1 \(step_3/"):
        check_evaluation_settings(first, config.model_copy(update={"validation": config.validation.model_copy(update={"temperature": 0.7})}),
                                  tasks)
    with pytest.raises(EvaluationError, match="grpo.max_new_tokens is 9, but the checkpoints were trained with 6"):
        check_evaluation_settings(first, config.model_copy(update={"grpo": config.grpo.model_copy(update={"max_new_tokens": 9})}), tasks)
    one_answer_edited = [dataclasses.replace(t, answer=t.answer + "0") if i == 5 else t for i, t in enumerate(tasks)]
    with pytest.raises(EvaluationError, match=r"validation tasks \(sha256 of ids, prompts, answers\) is '[0-9a-f]{64}', but"):
        check_evaluation_settings(first, config, one_answer_edited)  # as an edited task file gives
    faster = config.model_copy(update={"validation": config.validation.model_copy(update={"batch_size": 7, "workers": 3}),
                                       "inference": config.inference.model_copy(update={"engine": "vllm"})})
    assert check_evaluation_settings(first, faster, tasks) == []
    old = dataclasses.replace(first, info=dataclasses.replace(first.info, evaluation={}))
    (note,) = check_evaluation_settings(old, config, tasks)
    assert "records no evaluation settings" in note


def test_dcp_is_read_without_a_process_group_into_the_same_tensors(trained, tmp_path):
    assert not torch.distributed.is_initialized()
    first = discover_checkpoints(trained / "checkpoints")[0][0]
    want = read_weights(first)
    for weights in ("dcp", "dcp-v2", "safetensors", "sharded", "consolidated"):
        series = foreign_layouts.to_nemo_rl(trained, tmp_path / weights, weights)
        c = foreign.discover_nemo_rl(series, 32)[0][0]
        assert c.step == 3 and c.weights_kind == ("dcp" if weights.startswith("dcp") else "safetensors")
        got = foreign.read_weights(c)
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[n], want[n]) for n in want), weights
        assert foreign.tensor_specs(c) == {n: (str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in want.items()}


def test_per_rank_safetensors_are_assembled_bit_for_bit(trained, tmp_path):
    """4 ranks' files (every tensor split along dim 0, some ranks' slices empty): each
    tensor is its original, bit for bit (``torch.equal`` compares every element; the
    float32 bytes are copied, never computed)."""
    want = read_weights(discover_checkpoints(trained / "checkpoints")[0][0])
    assert any(t.dim() and t.shape[0] % foreign_layouts.RANKS for t in want.values())  # uneven slices covered
    series = foreign_layouts.to_nemo_rl(trained, tmp_path / "sharded", "sharded")
    c = foreign.discover_nemo_rl(series, 32)[0][0]
    assert len(c.weight_files) == foreign_layouts.RANKS
    got = foreign.read_weights(c)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), name


def test_per_rank_safetensors_missing_a_rank_are_refused_naming_the_tensor(trained, tmp_path):
    """Without rank 2's file the slices leave rows uninitialised: refused, not read."""
    series = foreign_layouts.to_nemo_rl(trained, tmp_path / "sharded", "sharded")
    (series / "step_3/policy/weights/model/shard-00002-model-00001-of-00001.safetensors").unlink()
    c = foreign.discover_nemo_rl(series, 32)[0][0]
    with pytest.raises(CheckpointError, match=r"cover \d+ of its \d+ elements .*a rank's file is missing"):
        foreign.read_weights(c)


def test_consolidated_config_with_every_default_key_is_accepted_with_a_note(trained, tmp_path):
    """Automodel writes ``to_json_string(use_diff=False)``: every default key; only keys
    that define the architecture are compared."""
    from mlperf_grpo.evaluate.foreign_source import config_differences

    ours = json.loads((trained / "checkpoints" / "step_3" / "config.json").read_text())
    series = foreign_layouts.to_nemo_rl(trained, tmp_path / "c", "consolidated")
    theirs = json.loads((series / "step_3/policy/weights/model/consolidated/config.json").read_text())
    assert set(theirs) - set(ours) >= {"output_attentions", "return_dict", "id2label"}  # the defaults written out
    assert config_differences(theirs, ours)[0] == {}
    changed = {**theirs, "num_hidden_layers": 3, "dtype": "bfloat16", "use_cache": False}
    architecture, other = config_differences(changed, ours)
    assert architecture == {"num_hidden_layers": (3, ours["num_hidden_layers"])}
    assert {"dtype", "use_cache"} <= set(other) and "num_hidden_layers" not in other
    nested = {"model_type": "x", "text_config": {"hidden_size": 8, "dtype": "float32"}}
    assert config_differences({**nested, "text_config": {"hidden_size": 16, "dtype": "bfloat16"}}, nested) == (
        {"text_config.hidden_size": (16, 8)}, {"text_config.dtype": ("bfloat16", "float32")})


def test_consolidated_config_of_another_architecture_is_one_line_exit_2(trained, tmp_path, capsys):
    series, log = convert(trained, tmp_path, "nemo-rl-consolidated")
    path = series / "step_3/policy/weights/model/consolidated/config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "num_attention_heads": 8}))
    assert main(["evaluate", "--checkpoints", str(series), "--mllog", str(log), "--config", str(trained / "config.yaml")]) == 2
    assert "consolidated/config.json describes another model than" in (line := error_line(capsys.readouterr().err))
    assert "num_attention_heads: 8 vs 4" in line


def evaluate_in_subprocess(series, log, config):
    """``evaluate`` in a child process, killed after :data:`EVALUATE_TIMEOUT_S` (a hang
    fails the test instead of hanging CI): ``(exit code, stderr)``."""
    args = ["evaluate", "--checkpoints", str(series), "--mllog", str(log), "--config", str(config)]
    code = "import sys; from mlperf_grpo.cli.app import main; sys.exit(main(sys.argv[1:]))"
    try:
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=EVALUATE_TIMEOUT_S,
                              env={**os.environ, "RETAIN_GRPO_CHECKPOINTS": "1"})
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"evaluate hung: no exit after {EVALUATE_TIMEOUT_S} s; stderr so far: {err.stderr}")
    return proc.returncode, proc.stderr


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_byte_of_the_largest_tensor(path):
    """One bit of the middle of the largest tensor's bytes (inside its ``torch.save`` record)."""
    from torch.distributed.checkpoint import FileSystemReader

    info = max(FileSystemReader(str(path.parent)).read_metadata().storage_data.values(), key=lambda i: i.length)
    data = bytearray(path.read_bytes())
    data[info.offset + info.length // 2] ^= 0x10
    path.write_bytes(bytes(data))


DATA_FILE_DAMAGE = [(layout, "truncated", _truncate) for layout in LAYOUTS] + [
    ("nemo-rl-dcp", "deleted", lambda path: path.unlink()),
    ("nemo-rl-dcp-v2", "deleted", lambda path: path.unlink()),
    ("nemo-rl-dcp", "flipped", _flip_a_byte_of_the_largest_tensor),
    ("nemo-rl-megatron", "flipped", _flip_a_byte_of_the_largest_tensor),
]


@pytest.mark.parametrize("layout, how, damage", DATA_FILE_DAMAGE, ids=[f"{a}-{b}" for a, b, _ in DATA_FILE_DAMAGE])
def test_a_damaged_data_file_is_one_line_naming_it_exit_2_no_hang(trained, reference, tmp_path, layout, how, damage):
    """Step 4's data file damaged: one line names the file, exit 2, nothing is logged for
    step 4 and nothing is deleted. Found when read (DCP), step 3 (evaluated first, no
    pass) stays logged; found by the series check (safetensors headers), nothing is
    logged (step 3 cannot be scored past the fault: the README's "a fault blocks only a
    result that needs it")."""
    series, log = convert(trained, tmp_path, layout)
    path = series / DATA_FILE[layout].format(step=4)
    assert path.is_file()
    damage(path)
    before = set(series.rglob("*"))
    code, err = evaluate_in_subprocess(series, log, trained / "config.yaml")
    assert code == 2, err
    line = error_line(err)
    assert str(path) in line, line
    found_by_check = layout in FOUND_BY_THE_SERIES_CHECK and how == "truncated"
    assert results_without_stop(log) == ([] if found_by_check else reference[0][:1])
    assert before <= set(series.rglob("*"))  # nothing deleted (the evaluator adds its lock and eval/)


def results_without_stop(log_path):
    log = read_log(log_path)
    assert not log.find("run_stop")
    return [(e.metadata["step"], e.value) for e in log.find("eval_accuracy")]


# --------------------------------------------------------------------------- bad inputs: one line, exit 2

def _drop_field(step, field):
    def damage(series, log):
        path = series / f"step_{step}" / "training_info.json"
        info = json.loads(path.read_text())
        del info[field]
        path.write_text(json.dumps(info))
    return damage


def _set_field(step, field, value):
    def damage(series, log):
        path = series / f"step_{step}" / "training_info.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
    return damage


def _manifest_without(field):
    def damage(series, log):
        path = series / "manifest.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        del rows[0][field]
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return damage


def _log_lines(keep):
    def damage(series, log):
        log.write_text("".join(line for line in log.read_text().splitlines(keepends=True) if keep(line)))
    return damage


def _gbs(series, log):
    log.write_text(log.read_text().replace('"key": "global_batch_size", "value": 32', '"key": "global_batch_size", "value": 64'))
    assert '"value": 64' in log.read_text()


def _truncate_log_after_step(step):
    def damage(series, log):
        out = []
        for line in log.read_text().splitlines(keepends=True):
            out.append(line)
            if '"block_stop"' in line and f'"step": {step}' in line:
                break
        log.write_text("".join(out))
    return damage


def _hf_shard(step):
    return f"models/ckpt-{step}/model-00001-of-00001.safetensors"


def _hf_stale_copy(series, log):
    """ckpt-4 gets step 3's tensors as a second shard the index names for one tensor (a
    re-save cut short): read by name order, every tensor would be step 3's."""
    folder = series / "models" / "ckpt-4"
    shutil.copy(series / _hf_shard(3), folder / "model-00002-of-00002.safetensors")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    first = sorted(index["weight_map"])[0]
    index["weight_map"][first] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _hf_left_over(series, log):
    shutil.copy(series / _hf_shard(3), series / "models" / "ckpt-4" / "model.safetensors")


def _hf_missing_shard(series, log):
    folder = series / "models" / "ckpt-4"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"][sorted(index["weight_map"])[0]] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _shift_manifest_times(ms):
    """The series as if trained later than the log (another run's log: issue 44)."""
    def damage(series, log):
        path = series / "manifest.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**r, "training_step_end_time_ms": r["training_step_end_time_ms"] + ms}) + "\n"
                                for r in rows))
    return damage


BAD = [
    ("hf-dirs", _shift_manifest_times(86_400_000), "manifest.jsonl: weight-update time"),
    ("nemo-rl-dcp", lambda series, log: [_set_field(s, "training_step_end_time_ms", json.loads(
        (series / f"step_{s}" / "training_info.json").read_text())["training_step_end_time_ms"] + 3_600_000)(series, log)
        for s in (3, 4, 5, 6)], "step_3/training_info.json: weight-update time"),
    ("hf-dirs", _hf_stale_copy, "model-00001-of-00001.safetensors holds tensor"),
    ("hf-dirs", _hf_left_over, "ckpt-4/model.safetensors is not named by"),
    ("hf-dirs", _hf_missing_shard, "ckpt-4/model-00002-of-00002.safetensors is missing (model.safetensors.index.json names it)"),
    ("nemo-rl-dcp", _drop_field(3, "training_step_end_time_ms"), "step_3/training_info.json: field 'training_step_end_time_ms' is missing"),
    ("nemo-rl-dcp", _drop_field(3, "current_step"), "step_3/training_info.json: field 'current_step' is missing"),
    ("nemo-rl-dcp", _set_field(3, "training_step_end_time_ms", 0), "step_3/training_info.json: weight-update time 0 is not after"),
    ("nemo-rl-dcp", _set_field(3, "consumed_samples", 7), "consumed_samples 7 != step 3 x num_prompts_per_step 2 = 6"),
    ("hf-dirs", _manifest_without("training_step_end_time_ms"), "manifest.jsonl:1: field 'training_step_end_time_ms' is missing"),
    ("hf-dirs", _manifest_without("step"), "manifest.jsonl:1: field 'step' is missing"),
    ("nemo-rl-dcp", _log_lines(lambda line: '"run_start"' not in line), "run_start: no run_start (run-stop-order"),
    ("nemo-rl-dcp", _gbs, "global_batch_size 64 differs from the config's 32"),
    ("nemo-rl-safetensors", _truncate_log_after_step(4), "the log trained to step 4 (samples_count 128), but the series has a checkpoint of step 6"),
    ("nemo-rl-dcp", lambda series, log: (series / "step_3" / "policy" / "weights" / ".metadata").write_bytes(b"junk"),
     "not a readable torch distributed checkpoint"),
    ("nemo-rl-dcp", lambda series, log: shutil.rmtree(series / "step_3" / "policy" / "weights"),
     "no model weights (neither a torch distributed checkpoint's .metadata nor *.safetensors"),
]


@pytest.mark.parametrize("layout, damage, needle", BAD)
def test_bad_series_or_log_is_one_line_exit_2(trained, tmp_path, capsys, layout, damage, needle):
    series, log = convert(trained, tmp_path, layout)
    damage(series, log)
    before = log.read_bytes()
    assert main(["evaluate", "--checkpoints", str(series), "--mllog", str(log), "--config", str(trained / "config.yaml")]) == 2
    assert needle in error_line(capsys.readouterr().err)
    assert log.read_bytes() == before and not (series / "eval" / "summary.json").exists()
    # the series folder is left as it was found: no eval/source.json, no lock (issue 44)
    assert not (series / "eval").exists() and not (series / ".lock").exists()


def test_a_refused_evaluation_leaves_no_eval_log_it_created(trained, tmp_path, capsys):
    """A series refused mid-evaluation (a stale shard found at ckpt-4's refit) with a new
    --eval-log: the path is left as given, not an empty file (breaker finding, issue 44)."""
    series, log = convert(trained, tmp_path, "hf-dirs")
    _hf_stale_copy(series, log)
    eval_log = tmp_path / "eval.log"
    assert main(["evaluate", "--checkpoints", str(series), "--mllog", str(log), "--config", str(trained / "config.yaml"),
                 "--eval-log", str(eval_log)]) == 2
    assert "holds tensor" in error_line(capsys.readouterr().err)
    assert not eval_log.exists() and not (series / "eval").exists()


@pytest.mark.parametrize("args, needle", [
    (["--format", "hf-dirs"], "--format hf-dirs, but"),
    (["RUNDIR"], "give RUN_DIR (a run our trainer wrote) or --checkpoints"),
    (["--eval-log", "LOG"], "--eval-log names the training log"),
])
def test_contradicting_arguments_are_one_line_exit_2(trained, tmp_path, capsys, args, needle):
    series, log = convert(trained, tmp_path, "nemo-rl-safetensors")
    args = [str(trained) if a == "RUNDIR" else str(log) if a == "LOG" else a for a in args]
    assert main(["evaluate", "--checkpoints", str(series), "--mllog", str(log), "--config", str(trained / "config.yaml"), *args]) == 2
    assert needle in error_line(capsys.readouterr().err)


@pytest.mark.parametrize("content, needle", [
    ("OTHER_RUN_LOG", "holds"),  # another run's whole log (breaker finding)
    ('FAKE_EVAL', "no results in"),  # eval lines this evaluator never wrote (accuracy 0.99)
    ("existing notes\n", "it is not an MLPerf log"),
    (None, "does not exist"),  # a directory that does not exist
])
def test_an_eval_log_this_evaluator_did_not_write_is_refused(trained, tmp_path, capsys, content, needle):
    series, log = convert(trained, tmp_path, "nemo-rl-safetensors")
    eval_log = tmp_path / "eval.log" if content is not None else tmp_path / "missing" / "eval.log"
    fake = ':::MLLOG {"namespace": "", "time_ms": 1, "event_type": "POINT_IN_TIME", "key": "eval_accuracy", ' \
           '"value": 0.99, "metadata": {"samples_count": 96, "step": 3}}\n'
    if content is not None:
        eval_log.write_text({"OTHER_RUN_LOG": (trained / "mlperf.log").read_text(), "FAKE_EVAL": fake}.get(content, content))
    before = sorted(p.name for p in series.iterdir())
    assert main(["evaluate", "--checkpoints", str(series), "--mllog", str(log), "--config", str(trained / "config.yaml"),
                 "--eval-log", str(eval_log)]) == 2
    assert needle in error_line(capsys.readouterr().err)
    assert sorted(p.name for p in series.iterdir()) == before  # nothing evaluated, nothing deleted
    assert not (tmp_path / "missing").exists()


def test_missing_mllog_is_one_line_exit_2(trained, tmp_path, capsys):
    series, _ = convert(trained, tmp_path, "hf-dirs")
    assert main(["evaluate", "--checkpoints", str(series), "--config", str(trained / "config.yaml")]) == 2
    assert "missing --mllog" in error_line(capsys.readouterr().err)


def test_a_second_evaluator_is_refused(trained, tmp_path, capsys):
    series, log = convert(trained, tmp_path, "hf-dirs")
    with RunLock(series, "evaluator"):
        assert main(["evaluate", "--checkpoints", str(series), "--mllog", str(log), "--config", str(trained / "config.yaml")]) == 2
    assert "is being written by the evaluator" in error_line(capsys.readouterr().err)


def test_a_layout_that_is_none_of_the_three_is_refused(tmp_path):
    (tmp_path / "step_1").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint layout recognised"):
        foreign.detect_format(tmp_path)


def _metadata_of(step):
    def copy(series):
        iteration = "policy/weights/iter_0000000/.metadata"
        shutil.copy(series / f"step_{step}" / iteration, series / "step_4" / iteration)
        return series / "step_4" / iteration
    return copy


@pytest.mark.parametrize("damage, needle", [
    (lambda s: (s / "step_4/policy/weights/iter_0000000/common.pt").unlink() or s / "step_4/policy/weights/iter_0000000/common.pt",
     "common.pt is missing and the DCP holds no common_state object"),
    (_metadata_of(3), "was written for step_3"),
], ids=["no-common-pt", "metadata-of-step-3"])
def test_a_megatron_checkpoint_missing_its_common_state_or_with_another_steps_metadata_is_one_line_exit_2(
        trained, reference, tmp_path, damage, needle):
    """Found by the series check (``--format auto`` picks the layout) before anything is
    logged, as a truncated safetensors file is: one line naming step 4's file, exit 2."""
    series, log = convert(trained, tmp_path, "nemo-rl-megatron")
    path = damage(series)
    code, err = evaluate_in_subprocess(series, log, trained / "config.yaml")
    assert code == 2, err
    line = error_line(err)
    assert needle in line and str(path.parent) in line, line
    assert results_without_stop(log) == []
