"""The agent section: closed values are the reference agent's, plan prints them, they
are part of a swe evaluation's identity."""

from __future__ import annotations

from mlperf_grpo import rules
from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.config.sections import AgentConfig


def test_the_defaults_are_the_reference_agents_values():
    assert {key: getattr(AgentConfig(), key) for key in rules.REFERENCE_AGENT} == rules.REFERENCE_AGENT


def test_a_swe_config_that_departs_from_the_reference_agent_is_a_closed_violation():
    config = RunConfig.model_validate({"task": {"name": "swe", "suite": "tiny"},
                                       "agent": {"max_turns": 3, "test_timeout_s": 120}})
    found = {v.field: (v.given, v.required) for v in config.closed_violations()}
    assert found["agent.max_turns"] == (3, 30) and found["agent.test_timeout_s"] == (120, 60.0)
    assert "agent.trajectory_timeout_s" not in found
    arithmetic = RunConfig.model_validate({"agent": {"max_turns": 3}})  # the agent is not used there
    assert not any(v.field.startswith("agent.") for v in arithmetic.closed_violations())


def test_plan_lists_the_reference_agent():
    plan = rules.closed_plan(256)
    assert plan["agent_max_turns"] == 30 and plan["agent_max_context_tokens"] == 65536
    assert plan["agent_trajectory_timeout_s"] == 1800.0 and plan["agent_command_timeout_s"] == 60.0



def test_the_agents_limits_are_part_of_a_swe_evaluations_identity():
    from mlperf_grpo.evaluate.settings import evaluation_settings, settings_difference

    trained = RunConfig.model_validate({"task": {"name": "swe", "suite": "tiny"}})
    changed = RunConfig.model_validate({"task": {"name": "swe", "suite": "tiny"}, "agent": {"max_turns": 5}})
    faster = RunConfig.model_validate({"task": {"name": "swe", "suite": "tiny"}, "agent": {"tool_threads": 32}})
    recorded = evaluation_settings(trained, [])
    assert "agent.max_turns is 5" in settings_difference(recorded, evaluation_settings(changed, []))
    assert settings_difference(recorded, evaluation_settings(faster, [])) is None
    assert not any(k.startswith("agent.") for k in evaluation_settings(RunConfig(), []))  # other tasks: unchanged


def test_prompt_files_are_read_from_the_config_files_folder_and_rendered(tmp_path):
    from mlperf_grpo.agent.suite import AgentRunner
    from mlperf_grpo.config.load import load_config
    from mlperf_grpo.tasks.swe import tiny_suite

    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "system.j2").write_text("You fix bugs in {{ workspace_path }}. {% include 'rules.j2' %}")
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "rules.j2").write_text("Never ask for help.")
    (tmp_path / "prompts" / "user.j2").write_text("Issue {{ instance.instance_id }}: {{ instance.problem_statement }}")
    path = tmp_path / "run.yaml"
    path.write_text("task: {name: swe, suite: tiny, num_train_tasks: 24}\nvalidation: {num_tasks: 12}\n"
                    "agent: {prompt_files: [prompts/system.j2, prompts/user.j2, shared], "
                    f"sandbox_root: {tmp_path / 'sandboxes'}}}\n")
    config = load_config(path)
    assert config.agent.prompt_files[0] == str(tmp_path / "prompts" / "system.j2")
    runner = AgentRunner(config.agent)
    task = tiny_suite("validation")[0]
    system, user = runner._messages(task)
    assert system == {"role": "system", "content": "You fix bugs in /testbed. Never ask for help."}
    assert user["content"] == f"Issue {task.task_id}: {task.problem_statement}".strip()


def test_a_sandbox_root_that_cannot_be_a_folder_is_a_one_line_error(tmp_path):
    import pytest

    from mlperf_grpo.agent.suite import AgentRunner
    from mlperf_grpo.errors import ConfigError

    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match=r"agent.sandbox_root .*a_file.* cannot be made a folder"):
        AgentRunner(AgentConfig(sandbox_root=str(tmp_path / "a_file")))


def test_a_sandbox_root_below_a_world_writable_folder_is_one_line_and_exit_2(tmp_path, capsys):
    from sandbox_helpers import require_bwrap

    from mlperf_grpo.cli import app as cli

    require_bwrap()
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    path = tmp_path / "run.yaml"
    path.write_text("task: {name: swe, suite: tiny, num_train_tasks: 24}\n"
                    f"validation: {{num_tasks: 12}}\nagent: {{sandbox_root: {shared / 'sandboxes'}}}\n")
    assert cli.main(["run", "--config", str(path), "--output", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and f"other users may write the folder {shared} above it" in error[0], error
    assert f"chmod go-w {shared}" in error[0] and not (tmp_path / "out").exists()


def test_a_leftover_sandbox_that_cannot_be_removed_is_skipped_with_one_warning_line(tmp_path, capsys, monkeypatch):
    """A killed run's leftover sandbox whose removal failed (OSError) raised out of
    AgentRunner and ended the run: it is left, named in one warning line, and the next
    leftover is still removed. The removal primitive (``os.rmdir``) fails for one folder."""
    import errno
    import json
    import os

    from sandbox_helpers import require_bwrap

    from mlperf_grpo.agent.suite import AgentRunner
    from mlperf_grpo.sandbox import leftovers

    require_bwrap()
    root = tmp_path / "sandboxes"
    for name, held in (("sbx-1-stuck", "held"), ("sbx-2-dead", "free")):
        (root / name / "testbed" / held).mkdir(parents=True)
        # this process's pid with another start time: the run that made it is dead
        (root / name / leftovers.MARKER).write_text(json.dumps({"pid": os.getpid(), "start_time": -1}))
    rmdir = os.rmdir

    def refusing_rmdir(path, *, dir_fd=None):
        if path == "held":
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), path)
        rmdir(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "rmdir", refusing_rmdir)
    AgentRunner(AgentConfig(sandbox_root=str(root)))
    assert capsys.readouterr().err.splitlines() == [
        f"warning: leftover sandbox {root / 'sbx-1-stuck'} of a killed run not removed (Operation not permitted); "
        "remove it by hand"]
    assert [p.name for p in root.iterdir()] == ["sbx-1-stuck"]


def test_a_leftover_whose_container_runtime_hangs_is_skipped_with_one_warning_line(tmp_path, capsys, monkeypatch):
    """A container runtime that did not answer ``rm -f`` in time raised TimeoutExpired out of
    AgentRunner: the folder is kept (its container may still use it) and named in one line."""
    import json
    import os

    from sandbox_helpers import require_bwrap

    from mlperf_grpo.agent.suite import AgentRunner
    from mlperf_grpo.sandbox import leftovers

    require_bwrap()
    runtime = tmp_path / "bin" / "hung-runtime"
    runtime.parent.mkdir()
    runtime.write_text("#!/bin/sh\nexec sleep 30\n")
    runtime.chmod(0o755)
    monkeypatch.setenv("PATH", f"{runtime.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(leftovers, "CONTAINER_RM_TIMEOUT_S", 0.5)
    root = tmp_path / "sandboxes"
    (root / "sbx-1-hung" / "testbed").mkdir(parents=True)
    (root / "sbx-1-hung" / leftovers.MARKER).write_text(json.dumps(
        {"pid": os.getpid(), "start_time": -1, "container": "c1", "runtime": "hung-runtime"}))
    AgentRunner(AgentConfig(sandbox_root=str(root)))
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"warning: leftover sandbox {root / 'sbx-1-hung'} of a killed run not removed (")
    assert "timed out" in line and line.endswith("remove it by hand")
    assert [p.name for p in root.iterdir()] == ["sbx-1-hung"]


def test_a_model_without_a_chat_tokenizer_is_refused_before_the_run_directory(tmp_path, capsys):
    from sandbox_helpers import require_bwrap

    from mlperf_grpo.cli import app as cli

    require_bwrap()
    path = tmp_path / "run.yaml"
    path.write_text("model: {path: 'builtin:arithmetic-tiny'}\ntask: {name: swe, suite: tiny, num_train_tasks: 24}\n"
                    f"validation: {{num_tasks: 12}}\nagent: {{sandbox_root: {tmp_path / 'sandboxes'}}}\n")
    assert cli.main(["run", "--config", str(path), "--output", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "model.path 'builtin:arithmetic-tiny' cannot run task swe" in error[0], error
    assert "chat template" in error[0] and not (tmp_path / "out").exists()


def test_an_agent_without_tools_is_refused():
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="agent|tools|at least 1"):
        AgentConfig(tools=[])
    assert AgentConfig(tools=["execute_bash"]).tools == ["execute_bash"]


def test_an_agent_context_that_no_prompt_fits_is_refused_before_the_run_directory(tmp_path, capsys):
    from sandbox_helpers import require_bwrap

    from mlperf_grpo.cli import app as cli

    require_bwrap()
    path = tmp_path / "run.yaml"
    path.write_text("model: {path: 'builtin:swe-tiny'}\ntask: {name: swe, suite: tiny, num_train_tasks: 24}\n"
                    "validation: {num_tasks: 12}\n"
                    f"agent: {{max_context_tokens: 1000, prompt_style: compact, sandbox_root: {tmp_path / 'sbx'}}}\n")
    assert cli.main(["run", "--config", str(path), "--output", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "no room left in agent.max_context_tokens 1000 (24 of 24 training" in error[0], error
    assert not (tmp_path / "out").exists()
