"""The shipped tiny swe suite (tasks/swe/tiny.py), its prompts (prompt.py) and its config."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from mlperf_grpo.config_sections import TaskConfig
from mlperf_grpo.eval_settings import tasks_digest
from mlperf_grpo.tasks.base import TaskError
from mlperf_grpo.tasks.swe import PromptTemplates, agent_messages, known_fix, load_templates, tiny_suite
from mlperf_grpo.tasks.swe.prompt import STYLES
from mlperf_grpo.tasks.swe.tiny import parse_source, read_sources


def test_24_training_and_12_validation_tasks_in_file_order(tmp_path):
    train, validation = tiny_suite("train", tmp_path), tiny_suite("validation", tmp_path)
    assert (len(train), len(validation)) == (24, 12)
    ids = [t.task_id for t in train + validation]
    assert len(set(ids)) == 36
    assert [t.task_id for t in train] == sorted(t.task_id for t in train)
    assert ids[0] == "swe-tiny__01_clamp" and validation[0].task_id == "swe-tiny__01_binary_search"
    for task in train + validation:
        assert not (task.repo_dir / "r2e_tests").exists()  # the hidden tests are not in the repository
        assert all(path.startswith("r2e_tests/") for path, _ in task.grading.test_files)
        assert task.grading.expected and all(status == "PASSED" for _, status in task.grading.expected)
        for edit in known_fix(task.task_id):
            assert (task.repo_dir / edit.path).read_text().count(edit.old) == 1, task.task_id


def test_materialised_repositories_are_the_same_everywhere(tmp_path):
    first, second = tiny_suite("validation", tmp_path / "a"), tiny_suite("validation", tmp_path / "b")
    for a, b in zip(first, second):
        assert a.repo_dir != b.repo_dir and replace(a, repo_dir=None) == replace(b, repo_dir=None)
        assert sorted(p.name for p in a.repo_dir.rglob("*.py")) == sorted(p.name for p in b.repo_dir.rglob("*.py"))
        if shutil.which("git"):
            assert a.metadata["base_commit"] == b.metadata["base_commit"] and len(a.metadata["base_commit"]) == 40
    assert tiny_suite("validation", tmp_path / "a")[0].repo_dir == first[0].repo_dir  # made once, then reused
    assert tasks_digest(first) == tasks_digest(second)


def test_concurrent_first_uses_share_one_materialised_suite(tmp_path):
    with ThreadPoolExecutor(4) as pool:
        suites = list(pool.map(lambda _: tiny_suite("validation", tmp_path), range(4)))
    assert all(suite == suites[0] for suite in suites)
    made = [p.name for p in next(tmp_path.iterdir()).iterdir()]
    assert made == ["validation"]  # the losers' staging folders are gone


def test_a_malformed_task_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.task"
    bad.write_text("=== issue\nbroken\n=== file a.py\nx = 1\n=== test r2e_tests/test_a.py\n")
    with pytest.raises(TaskError, match="needs an issue, files, hidden tests and a fix"):
        parse_source(bad)
    bad.write_text("=== issue\nx\n=== patch a.py\n")
    with pytest.raises(TaskError, match="bad section '=== patch a.py'"):
        parse_source(bad)
    bad.write_text("=== issue\nx\n=== file ../a.py\n")
    with pytest.raises(TaskError, match="must stay inside the repository"):
        parse_source(bad)
    with pytest.raises(TaskError, match="splits train, validation"):
        read_sources("test")


def test_prompts_carry_the_issue_and_the_workspace(tmp_path):
    task = tiny_suite("validation", tmp_path)[0]
    for style in ("reference", "compact"):
        system, user = agent_messages(task, "/work", style)
        assert system["role"] == "system" and user["role"] == "user"
        assert f"<issue_description>\n{task.problem_statement}\n</issue_description>" in user["content"]
        assert "/work" in user["content"] and "{{" not in user["content"] + system["content"]
    reference = agent_messages(task)[1]["content"]
    assert "a Python code repository" in reference and f"base commit {task.metadata['base_commit']}" in reference
    assert not STYLES["reference"].is_reference  # our wording, not the reference's bytes
    with pytest.raises(TaskError, match="unknown swe prompt style"):
        agent_messages(task, templates="long")


def test_template_files_render_unchanged_with_their_includes(tmp_path):
    task = tiny_suite("validation", tmp_path / "s")[0]
    (tmp_path / "prompts").mkdir()
    (tmp_path / "includes").mkdir()
    (tmp_path / "prompts" / "system_prompt.j2").write_text(
        "You are an agent.\n<RISK>\n{% include 'security_risk_assessment.j2' %}\n</RISK>\n")
    (tmp_path / "includes" / "security_risk_assessment.j2").write_text("Rate each action's risk.")
    (tmp_path / "prompts" / "user_prompt.j2").write_text(
        "{% set language = instance.repo_language | default('python') %}I've uploaded a {{ language }} code "
        "repository in {{ workspace_path }}.\n"
        "<issue_description>\n{{ instance.problem_statement }}\n</issue_description>\n")
    system_path, user_path = tmp_path / "prompts" / "system_prompt.j2", tmp_path / "prompts" / "user_prompt.j2"
    templates = load_templates(system_path, user_path, (tmp_path / "includes",))
    system, user = agent_messages(task, templates=templates)
    assert system["content"] == "You are an agent.\n<RISK>\nRate each action's risk.\n</RISK>"
    assert user["content"].startswith("I've uploaded a Python code repository in /testbed.\n<issue_description>\n")
    assert not templates.is_reference
    with pytest.raises(TaskError, match="TemplateNotFound"):
        agent_messages(task, templates=load_templates(system_path, user_path))  # the include's folder is missing
    with pytest.raises(TaskError, match="does not render"):
        agent_messages(task, templates=PromptTemplates("{{ x", "y"))
    with pytest.raises(TaskError, match="cannot read swe prompt template"):
        load_templates(tmp_path / "missing.j2", user_path)


@pytest.mark.parametrize(("keys", "message"), [
    ({}, "task.name swe needs task.train_path (or task.suite: tiny)"),
    ({"suite": "tiny", "train_path": "x.jsonl"}, "task.train_path is not used by task.name swe"),
    ({"suite": "big"}, "suite"),
])
def test_task_config_of_swe(keys, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TaskConfig(name="swe", **keys)
    assert TaskConfig(name="swe", suite="tiny").suite == "tiny"
