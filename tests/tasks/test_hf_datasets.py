"""``task: jsonl`` reading a local Hugging Face ``datasets`` dataset (issue 13): the GSM8K-like
data saved with ``save_to_disk`` or as parquet gives the same tasks as its JSONL files, with
GSM8K's field mapping (question -> prompt, the number after ``####`` -> answer)."""

import json
import sys
from pathlib import Path

import pytest
import yaml

from mlperf_grpo.cli import main
from mlperf_grpo.config.load import load_config
from mlperf_grpo.tasks import load_suite
from mlperf_grpo.tasks.base import TaskError
from mlperf_grpo.tasks.hf_datasets import read_dataset_rows

DATA = Path(__file__).parents[1] / "data" / "gsm8k_like"


def rows(name):
    return [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines()]


def config_for(tmp_path, train, validation):
    path = tmp_path / "task.yaml"
    path.write_text(yaml.safe_dump({
        "division": "open", "grpo": {"num_prompts_per_step": 2, "max_steps": 2, "first_eval_step": 1, "micro_batch_size": 32},
        "validation": {"num_tasks": 16},
        "task": {"name": "jsonl", "train_path": str(train), "validation_path": str(validation), "id_field": None,
                 "prompt_field": "question", "answer_field": "answer", "num_train_tasks": 64}}))
    return path


def suite_tasks(config_path):
    suite = load_suite(load_config(config_path))
    return suite.validation_tasks(16), sorted(suite.train_tasks(64, 16, seed=1), key=lambda t: t.task_id)


def test_saved_dataset_and_parquet_give_the_tasks_of_the_jsonl_files(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the optional 'datasets' extra is not installed")
    splits = datasets.DatasetDict({name: datasets.Dataset.from_list(
        [{k: v for k, v in r.items() if k != "messages"} for r in rows(name)]) for name in ("train", "validation")})
    splits.save_to_disk(str(tmp_path / "saved"))
    for name, split in splits.items():
        split.to_parquet(str(tmp_path / f"{name}.parquet"))
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("train", "validation"):  # the JSONL files without chat messages, as the dataset holds them
        (plain / f"{name}.jsonl").write_text("".join(
            json.dumps({k: v for k, v in r.items() if k != "messages"}) + "\n" for r in rows(name)))
    want = suite_tasks(config_for(tmp_path, plain / "train.jsonl", plain / "validation.jsonl"))
    assert [t.answer for t in want[0]] == [r["answer"].rsplit("#### ", 1)[1] for r in rows("validation")]
    assert suite_tasks(config_for(tmp_path, tmp_path / "saved" / "train", tmp_path / "saved" / "validation")) == want
    assert suite_tasks(config_for(tmp_path, tmp_path / "train.parquet", tmp_path / "validation.parquet")) == want


def test_a_null_messages_column_is_an_absent_chat(tmp_path):
    """Only some rows of the GSM8K-like files have ``messages``; a dataset made from them
    holds null in the others, which is read as no chat (breaker finding), not refused."""
    datasets = pytest.importorskip("datasets", reason="the optional 'datasets' extra is not installed")
    assert any("messages" in r for r in rows("validation")) and any("messages" not in r for r in rows("validation"))
    for name in ("train", "validation"):
        split = datasets.Dataset.from_list(rows(name))
        assert name != "validation" or None in split["messages"]
        split.to_parquet(str(tmp_path / f"{name}.parquet"))
    want = suite_tasks(config_for(tmp_path, DATA / "train.jsonl", DATA / "validation.jsonl"))
    assert suite_tasks(config_for(tmp_path, tmp_path / "train.parquet", tmp_path / "validation.parquet")) == want


def test_a_dataset_with_several_splits_is_one_line_exit_2(tmp_path, capsys):
    datasets = pytest.importorskip("datasets", reason="the optional 'datasets' extra is not installed")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows("train")),
                          "test": datasets.Dataset.from_list(rows("validation"))}).save_to_disk(str(tmp_path / "gsm"))
    cfg = config_for(tmp_path, tmp_path / "gsm", tmp_path / "gsm" / "test")
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    (line,) = [l for l in err.splitlines() if l.startswith("mlperf-grpo:")]
    assert "holds the splits ['test', 'train']; point at one split's folder" in line and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_without_the_datasets_package_the_message_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    (tmp_path / "data").mkdir()
    with pytest.raises(TaskError, match=r"needs the 'datasets' package: pip install 'mlperf-grpo\[datasets\]'"):
        read_dataset_rows(tmp_path / "data")
