"""Tasks from elsewhere (issue 13): ``task: jsonl`` and ``task: python``, end to end, and
their one-line errors. The data is ``tests/data/gsm8k_like`` (``scripts/make_gsm8k_like.py``)."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from mlperf_grpo.cli import main
from mlperf_grpo.config.load import load_config
from mlperf_grpo.logs.mllog import read_log
from mlperf_grpo.model.files import BUILTIN_MODEL_DIR
from mlperf_grpo.tasks import load_suite, validation_tasks
from mlperf_grpo.tasks.scoring import score
from mlperf_grpo.tasks.verify import final_answer

DATA = Path(__file__).parents[1] / "data" / "gsm8k_like"
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}A: {% endif %}"
SMALL = {"division": "open", "grpo": {"num_prompts_per_step": 2, "max_steps": 2, "first_eval_step": 1, "micro_batch_size": 32}}


def rows(name):
    return [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines()]


def jsonl_config(tmp_path, train=DATA / "train.jsonl", validation=DATA / "validation.jsonl", num_tasks=16, **task):
    config = {**SMALL, "validation": {"num_tasks": num_tasks},
              "task": {"name": "jsonl", "train_path": str(train), "validation_path": str(validation), "id_field": None,
                       "prompt_field": "question", "num_train_tasks": 64, **task}}
    path = tmp_path / "jsonl.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def chat_model(tmp_path):
    """The built-in model with a chat template in its tokenizer config."""
    model = tmp_path / "chat-model"
    shutil.copytree(BUILTIN_MODEL_DIR, model)
    tok = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**tok, "chat_template": TEMPLATE}))
    return model


def test_the_data_script_is_reproducible(tmp_path):
    import runpy
    import sys

    argv = sys.argv
    sys.argv = ["make_gsm8k_like.py", "--output", str(tmp_path)]
    try:
        runpy.run_path(str(Path(__file__).parents[2] / "scripts" / "make_gsm8k_like.py"), run_name="__main__")
    finally:
        sys.argv = argv
    for name in ("train", "validation"):
        assert (tmp_path / f"{name}.jsonl").read_text() == (DATA / f"{name}.jsonl").read_text()


def test_jsonl_suite_reads_gsm8k_rows_and_applies_the_chat_template(tmp_path):
    config = load_config(jsonl_config(tmp_path))
    config = config.model_copy(update={"model": config.model.model_copy(update={"path": str(chat_model(tmp_path))})})
    suite = load_suite(config)
    validation = suite.validation_tasks(16)
    raw = rows("validation")
    assert [t.task_id for t in validation] == [f"validation-{i}" for i in range(1, 17)]
    assert [t.answer for t in validation] == [r["answer"].rsplit("#### ", 1)[1] for r in raw]
    for task, row in zip(validation, raw):
        if "messages" in row:  # built by the template, generation prompt on
            system, user = row["messages"]
            assert task.prompt == f"[system] {system['content']}\n[user] {user['content']}\nA: "
        else:
            assert task.prompt == row["question"]
    assert sum("messages" in r for r in raw) == 4
    # Without a chat template the row's prompt is used.
    plain = load_suite(load_config(jsonl_config(tmp_path))).validation_tasks(16)
    assert [t.prompt for t in plain] == [r["question"] for r in raw]
    train = suite.train_tasks(64, 16, seed=1)
    assert sorted(t.task_id for t in train) == sorted(f"train-{i}" for i in range(1, 65))
    assert suite.reward == "mlperf_grpo.tasks.verify:math_reward"


def test_jsonl_task_trains_and_evaluates_end_to_end(tmp_path, capsys):
    cfg = jsonl_config(tmp_path)
    config = yaml.safe_load(cfg.read_text())
    config["model"] = {"path": str(chat_model(tmp_path))}
    cfg.write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    assert main(["run", "--config", str(cfg), "--output", str(run), "--retain-checkpoints"]) in (0, 3)
    log = read_log(run / "mlperf.log")
    assert [e.metadata["step"] for e in log.find("eval_accuracy")] in ([1], [1, 2])
    header, *results = [json.loads(line) for line in (run / "eval" / "step_1.jsonl").read_text().splitlines()]
    raw = rows("validation")
    assert [r["answer"] for r in results] == [final_answer(r["answer"]) for r in raw]
    assert results[0]["prompt"].startswith("[system] Answer with the number only.\n[user] ")
    assert results[5]["prompt"] == raw[5]["question"]
    assert all(len(r["rewards"]) == 4 for r in results)
    assert len(log.find("run_stop")) == 1


def test_python_task_trains_and_evaluates_end_to_end(tmp_path):
    cfg = tmp_path / "python.yaml"
    cfg.write_text(yaml.safe_dump({**SMALL, "validation": {"num_tasks": 8},
                                   "task": {"name": "python", "entry_point": "reward_fixtures:arithmetic_subset",
                                            "num_train_tasks": 64}}))
    run = tmp_path / "run"
    assert main(["run", "--config", str(cfg), "--output", str(run), "--retain-checkpoints"]) in (0, 3)
    log = read_log(run / "mlperf.log")
    assert log.find("eval_accuracy") and len(log.find("run_stop")) == 1
    header, *results = [json.loads(line) for line in (run / "eval" / "step_1.jsonl").read_text().splitlines()]
    assert [r["task_id"] for r in results][:2] == ["add-68-86", "add-22-26"]  # the arithmetic validation draw


def _bad_jsonl(tmp_path, lines):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(line + "\n" for line in lines))
    return bad


VALID = [json.dumps(r) for r in rows("validation")]


@pytest.mark.parametrize("case, lines, num_tasks, needle", [
    ("malformed row", VALID[:3] + ["{not json"] + VALID[4:], 16, "bad.jsonl:4: not valid JSON"),
    ("not an object", VALID[:1] + ["[1, 2]"] + VALID[2:], 16, "bad.jsonl:2: a row must be a JSON object, got list"),
    ("missing field", VALID[:2] + [json.dumps({"question": "q?"})] + VALID[3:], 16,
     "bad.jsonl:3: missing field 'answer' (set task.answer_field if the data names it differently)"),
    ("no final answer", VALID[:1] + [json.dumps({"question": "q?", "answer": "no idea"})] + VALID[2:], 16,
     "bad.jsonl:2: field 'answer' has no final answer"),
    ("wrong row count", VALID, 15, "bad.jsonl has 16 rows; validation.num_tasks is 15"),
    ("bad messages", VALID[:1] + [json.dumps({**rows("validation")[1], "messages": "hi"})] + VALID[2:], 16,
     "bad.jsonl:2: 'messages' must be a non-empty list"),
    ("chat ending with the answer", VALID[:2] + [json.dumps({**rows("validation")[2], "messages": [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "#### 4"}]})] + VALID[3:], 16,
     "bad.jsonl:3: 'messages' ends with a message of role 'assistant'; the last must be the user's"),
])
def test_bad_jsonl_rows_exit_2_with_one_line(tmp_path, capsys, case, lines, num_tasks, needle):
    cfg = jsonl_config(tmp_path, validation=_bad_jsonl(tmp_path, lines), num_tasks=num_tasks)
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_jsonl_overlap_and_missing_file_are_refused(tmp_path, capsys):
    cfg = jsonl_config(tmp_path, train=DATA / "validation.jsonl", num_train_tasks=16)
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "run")]) == 2
    assert "training and validation tasks must not overlap" in capsys.readouterr().err
    cfg = jsonl_config(tmp_path, train=tmp_path / "nope.jsonl")
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "run")]) == 2
    assert "cannot read task file" in capsys.readouterr().err
    cfg.write_text("task: {name: jsonl, train_path: t.jsonl}\n")
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "run")]) == 2
    assert "task.name jsonl needs task.validation_path" in capsys.readouterr().err


@pytest.mark.parametrize("section, key, count, most", [
    ("validation", "num_tasks", 100_000, 8100),
    ("task", "num_train_tasks", 100_000_000, 8100 - 251),
])
def test_more_arithmetic_tasks_than_exist_exit_2_with_one_line(tmp_path, capsys, section, key, count, most):
    """The built-in arithmetic task has 90 x 90 = 8,100 problems (the default 251 held out
    for validation): asking for more is one line naming the key and its largest value,
    exit 2, nothing made (it was exit 1, without the key)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({section: {key: count}}))
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "run")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines()[-1].endswith(f"{section}.{key} is {count}: set {section}.{key} to at most {most}")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("entry_point, needle", [
    ("no_such_package.tasks:factory", "task.entry_point: entry point no_such_package.tasks:factory: cannot import no_such_package"),
    ("reward_fixtures:nope", "has no attribute nope"),
    ("reward_fixtures", "must be 'module:function'"),
    ("reward_fixtures:not_a_suite", "factory() returned list, not a task suite"),
    ("reward_fixtures:failing_factory", "factory() raised OSError: sandbox image missing"),
    ("reward_fixtures:closure_reward_suite", "is not importable by name; define it at module level"),
    ("reward_fixtures:short_suite", "validation_tasks() returned 7 tasks; validation.num_tasks is 8"),
])
def test_bad_entry_points_exit_2_with_one_line(tmp_path, capsys, entry_point, needle):
    cfg = tmp_path / "python.yaml"
    cfg.write_text(yaml.safe_dump({**SMALL, "validation": {"num_tasks": 8},
                                   "task": {"name": "python", "entry_point": entry_point, "num_train_tasks": 64}}))
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "run").exists()


def test_the_docs_python_task_example_works(tmp_path, monkeypatch):
    readme = (Path(__file__).parents[2] / "docs" / "bring-your-own.md").read_text()
    code = readme.split("# pkg/mod.py\n", 1)[1].split("```", 1)[0]
    (tmp_path / "readme_task_pkg").mkdir()
    (tmp_path / "readme_task_pkg" / "__init__.py").write_text("")
    (tmp_path / "readme_task_pkg" / "mod.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(None).model_copy()
    config.task = config.task.model_copy(update={"name": "python", "entry_point": "readme_task_pkg.mod:factory"})
    suite = load_suite(config)
    tasks = validation_tasks(suite, 6)
    assert score(suite.reward, [(t.answer, t) for t in tasks] + [("99=" + t.answer, t) for t in tasks]) == [1.0] * 6 + [0.0] * 6
