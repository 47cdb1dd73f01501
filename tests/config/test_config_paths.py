"""One rule for every path in a config (issue 44): relative to the config file's folder,
whatever the working directory; the run's ``config.yaml`` records the absolute paths."""

import shutil

import yaml

from mlperf_grpo.cli import main
from mlperf_grpo.config.load import load_config
from mlperf_grpo.model.files import BUILTIN_MODEL_DIR

SMALL = {"division": "open", "validation": {"num_tasks": 8},
         "grpo": {"num_prompts_per_step": 2, "max_steps": 1, "first_eval_step": 1, "micro_batch_size": 32}}


def test_relative_paths_are_read_from_the_configs_folder(tmp_path):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "c.yaml").write_text(yaml.safe_dump({
        **SMALL, "model": {"path": "models/m"},
        "task": {"name": "jsonl", "train_path": "data/t.jsonl", "validation_path": "/abs/v.jsonl"}}))
    config = load_config(tmp_path / "cfg" / "c.yaml")
    assert config.model.path == str(tmp_path / "cfg" / "models" / "m")
    assert config.task.train_path == str(tmp_path / "cfg" / "data" / "t.jsonl")
    assert config.task.validation_path == "/abs/v.jsonl"
    (tmp_path / "cfg" / "s.yaml").write_text(yaml.safe_dump({**SMALL, "agent": {"sandbox_root": "sandboxes"}}))
    assert load_config(tmp_path / "cfg" / "s.yaml").agent.sandbox_root == str(tmp_path / "cfg" / "sandboxes")  # was the cwd's
    assert load_config(None).model.path.startswith("builtin:")  # a built-in name is not a path


def test_a_relative_model_path_trains_and_evaluates_from_any_folder(tmp_path, monkeypatch):
    """model.path was resolved against the working directory and stored as given: the
    config's own folder did not find it, and `evaluate RUN` from elsewhere failed."""
    cfg = tmp_path / "cfg"
    shutil.copytree(BUILTIN_MODEL_DIR, cfg / "my-model")
    (cfg / "c.yaml").write_text(yaml.safe_dump({**SMALL, "model": {"path": "my-model"}}))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["train", "--config", "../cfg/c.yaml", "--output", "../run"]) == 0
    recorded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]["path"]
    assert recorded == str(cfg / "my-model")  # what the run resolved, recorded
    (tmp_path / "third").mkdir()
    monkeypatch.chdir(tmp_path / "third")
    assert main(["evaluate", "../run", "--retain-checkpoints"]) in (0, 3)
