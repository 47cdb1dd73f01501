"""The agent loop on the tiny suite with scripted policies (a double for the model only:
bubblewrap sandboxes, tools, hidden tests and grading are real)."""

from __future__ import annotations

import shutil

import pytest

from mlperf_grpo.agent.chat import ChatTokens
from mlperf_grpo.agent.loop import AgentSettings, run_trajectories
from mlperf_grpo.agent.scripted import LOGPROB, ScriptedEngine, call_text, do_nothing_script, known_fix_script, sleeper_script
from mlperf_grpo.agent.swe_session import SweSession, SweSessionSettings
from mlperf_grpo.agent.tools import TOOL_SCHEMAS
from mlperf_grpo.inference.base import SamplingParams
from mlperf_grpo.model.load import load_tokenizer
from mlperf_grpo.sandbox import SandboxLimits
from mlperf_grpo.tasks.swe import tiny_suite

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (apt-get install bubblewrap)")
PARAMS = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=1)


def messages(task):
    return [{"role": "system", "content": "You are a software engineer."}, {"role": "user", "content": task.problem_statement}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("MLPERF_GRPO_CACHE", str(tmp_path_factory.mktemp("cache")))
    tok = load_tokenizer("builtin:swe-tiny")
    mp.undo()
    chat = ChatTokens(tok, TOOL_SCHEMAS, template_kwargs={"enable_thinking": False})
    return tok, chat, tiny_suite("validation", root=tmp_path_factory.mktemp("suite"))


def run(setup, tmp_path, script, settings=AgentSettings(max_context_tokens=8192, tool_threads=2), tasks=None):
    tok, chat, suite = setup
    tasks = suite if tasks is None else tasks
    session = SweSessionSettings(SandboxLimits(command_timeout_s=20), 60.0, tmp_path / "sandboxes")
    jobs = [(t.task_id, i, (lambda t=t: SweSession(t, session, messages))) for i, t in enumerate(tasks)]
    trajectories, stats = run_trajectories(ScriptedEngine(tok, tasks, script), chat, jobs, PARAMS, settings)
    assert not any((tmp_path / "sandboxes").iterdir())  # every sandbox removed
    return trajectories, stats


def test_the_known_fix_gets_reward_1_on_every_validation_task(setup, tmp_path):
    trajectories, stats = run(setup, tmp_path, known_fix_script)
    assert [t.end_reason for t in trajectories] == ["finish"] * len(trajectories)
    assert [t.reward for t in trajectories] == [1.0] * len(trajectories), [t.grade_reason for t in trajectories]
    assert not any(t.invalid for t in trajectories)
    assert len(stats.session_start_s) == len(trajectories)


def test_doing_nothing_gets_reward_0_on_every_validation_task(setup, tmp_path):
    trajectories, _ = run(setup, tmp_path, do_nothing_script)
    assert [(t.end_reason, t.reward, t.invalid) for t in trajectories] == [("finish", 0.0, False)] * len(trajectories)


def test_a_trajectory_past_its_timeout_is_an_invalid_sample_not_graded(setup, tmp_path):
    settings = AgentSettings(max_context_tokens=8192, trajectory_timeout_s=1.0, tool_threads=2)
    trajectories, _ = run(setup, tmp_path, sleeper_script(0.6), settings, tasks=setup[2][:2])
    assert [(t.end_reason, t.invalid, t.reward) for t in trajectories] == [("timeout", True, 0.0)] * 2
    assert all(2 <= len(t.turns) <= 3 for t in trajectories)


def test_a_turn_of_many_slow_calls_stops_at_the_trajectory_s_timeout(setup, tmp_path):
    """The timeout was checked only between turns: one turn of 40 ``sleep 0.25`` calls ran them all."""
    many = "\n".join([call_text("execute_bash", command="sleep 0.25")] * 40)
    settings = AgentSettings(max_context_tokens=8192, trajectory_timeout_s=1.0, tool_threads=2)
    (traj,), stats = run(setup, tmp_path, lambda task_id, turn, text: many, settings, tasks=setup[2][:1])
    assert (traj.end_reason, traj.invalid, len(traj.turns)) == ("timeout", True, 1)
    assert 1 <= len(traj.turns[0].observations) < 10 and stats.wall_s < 6.0, (traj.turns[0].observations, stats.wall_s)


def test_a_turn_of_many_large_observations_stops_once_they_fill_the_context(setup, tmp_path):
    """Each observation was bounded, a turn's total not: a turn of 20 calls each printing
    4,000 characters ran them all, held them and tokenised them together, to end at the
    context limit anyway."""
    many = "\n".join([call_text("execute_bash", command="seq 100000 101000")] * 20)
    settings = AgentSettings(max_context_tokens=8192, tool_threads=2, max_observation_chars=4000)
    (traj,), _ = run(setup, tmp_path, lambda task_id, turn, text: many, settings, tasks=setup[2][:1])
    assert (traj.end_reason, len(traj.turns), traj.invalid) == ("context", 1, False)
    tokens = [setup[1].count(o) for o in traj.turns[0].observations]
    room = 8192 - len(traj.prompt_token_ids) - len(traj.token_ids)
    assert sum(tokens[:-1]) < room <= sum(tokens) and len(tokens) < 20, (len(tokens), room)


def test_the_token_ids_are_the_sampled_turns_and_the_templates_environment_text(setup, tmp_path):
    tok, chat, suite = setup
    (traj,), _ = run(setup, tmp_path, known_fix_script, tasks=suite[:1])
    sampled = [i for i, m in zip(traj.token_ids, traj.sampled_mask) if m]
    turns = [known_fix_script(traj.task_id, k, "") for k in range(3)]
    assert sampled == tok("<|im_end|>".join(turns) + "<|im_end|>", add_special_tokens=False)["input_ids"]
    assert [lp for lp, m in zip(traj.logprobs, traj.sampled_mask) if m] == [LOGPROB] * len(sampled)
    assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.sampled_mask) if not m)
    # the whole conversation is what the chat template renders for these messages
    conversation = messages(suite[0]) + [
        {"role": "assistant", "content": turns[0]}, {"role": "tool", "content": traj.turns[0].observations[0]},
        {"role": "assistant", "content": turns[1]}, {"role": "tool", "content": traj.turns[1].observations[0]},
        {"role": "assistant", "content": turns[2]}]
    rendered = tok.apply_chat_template(conversation, tools=TOOL_SCHEMAS, tokenize=False, enable_thinking=False)
    # the template writes the empty <think></think> only in the generation prompt, which each turn followed
    expected = rendered.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.decode(traj.prompt_token_ids + traj.token_ids) == expected.removesuffix("\n")
    assert "/testbed/" in traj.turns[1].observations[0]


def test_max_turns_and_the_context_limit_end_a_trajectory_and_are_graded(setup, tmp_path):
    def looker(task_id, turn, text):
        return call_text("execute_bash", command="echo " + "x" * 50)
    (traj,), _ = run(setup, tmp_path, looker, AgentSettings(max_turns=3, max_context_tokens=8192), tasks=setup[2][:1])
    assert (traj.end_reason, len(traj.turns), traj.invalid, traj.reward) == ("max_turns", 3, False, 0.0)
    limit = len(traj.prompt_token_ids) + 200
    (traj,), _ = run(setup, tmp_path, looker, AgentSettings(max_turns=30, max_context_tokens=limit), tasks=setup[2][:1])
    assert traj.end_reason == "context" and traj.overlong and traj.num_tokens <= limit and not traj.invalid


def test_a_turn_without_a_call_gets_the_continue_message_and_a_malformed_call_an_error(setup, tmp_path):
    def script(task_id, turn, text):
        return ["I am thinking.", "<tool_call>\n<function=execute_bash>\n</function>\n</tool_call>",
                call_text("finish")][min(turn, 2)]
    (traj,), _ = run(setup, tmp_path, script, tasks=setup[2][:1])
    text = setup[0].decode(traj.prompt_token_ids + traj.token_ids)
    assert "<|im_start|>user\nPlease continue working on the task" in text
    assert traj.turns[1].calls == [{"name": "execute_bash", "arguments": {}}]
    assert "missing required argument 'command'" in traj.turns[1].observations[0]
    assert traj.end_reason == "finish"


def test_malformed_calls_that_echo_a_huge_argument_are_clipped_like_any_observation(setup, tmp_path):
    """The parser's error for an unknown tool or a mistyped argument repeats what the model
    wrote; it came back unclipped (5,000 characters past max_observation_chars)."""
    turns = ["<tool_call>\n<function=" + "x" * 5000 + ">\n</function>\n</tool_call>",
             call_text("str_replace_editor", command="view", path="/testbed", view_range="[" * 5000),
             call_text("finish")]
    settings = AgentSettings(max_context_tokens=30000, tool_threads=2, max_observation_chars=300)
    (traj,), _ = run(setup, tmp_path, lambda task_id, turn, text: turns[turn], settings, tasks=setup[2][:1])
    observations = [turn.observations[0] for turn in traj.turns[:2]]
    assert [len(text) for text in observations] == [300, 300], observations
    assert observations[0].startswith("unknown tool 'xxx") and "response clipped" in observations[1]
    assert traj.end_reason == "finish"


def test_pass_at_k_over_tasks_follows_the_scripted_policies_and_excludes_invalid_samples(setup, tmp_path):
    from mlperf_grpo.agent.suite import AgentRunner
    from mlperf_grpo.config.sections import AgentConfig
    from mlperf_grpo.evaluate.validator import validate_agent

    tok, _, suite = setup
    tasks = suite[:3]
    agent = AgentConfig(max_context_tokens=8192, tool_threads=2, prompt_style="compact",
                        sandbox_root=str(tmp_path / "sandboxes"))

    def accuracy(script, agent=agent):
        engine = ScriptedEngine(tok, tasks, script)
        acc, results = validate_agent(engine, AgentRunner(agent), tasks, 2, PARAMS, seed=1)
        assert [r.task_id for r in results] == [t.task_id for t in tasks] and all(len(r.rewards) == 2 for r in results)
        return acc, results

    assert accuracy(known_fix_script)[0] == 1.0
    assert accuracy(do_nothing_script)[0] == 0.0

    def first_task_fixed(task_id, turn, text):  # one of three tasks passes
        return known_fix_script(task_id, turn, text) if task_id == tasks[0].task_id else do_nothing_script(task_id, turn, text)
    acc, results = accuracy(first_task_fixed)
    assert acc == pytest.approx(1 / 3, abs=1e-12) and [r.passed for r in results] == [True, False, False]
    record = results[0].trajectories[0]
    assert record["end_reason"] == "finish" and record["reward"] == 1.0 and len(record["turns"]) == 3
    assert record["turns"][1]["calls"][0]["name"] == "str_replace_editor" and record["sampled_tokens"] > 0

    slow = agent.model_copy(update={"trajectory_timeout_s": 0.5})
    acc, results = accuracy(sleeper_script(0.4), slow)
    assert acc == 0.0 and all(r.invalid == [True, True] and not r.passed for r in results)


def test_tests_that_pass_after_the_turn_limit_are_an_invalid_sample(setup, tmp_path):
    def fix_then_keep_looking(task_id, turn, text):  # fixes at turn 1, never calls finish
        return known_fix_script(task_id, turn, text) if turn < 2 else call_text("execute_bash", command="true")
    (traj,), _ = run(setup, tmp_path, fix_then_keep_looking, AgentSettings(max_turns=3, max_context_tokens=8192),
                     tasks=setup[2][:1])
    assert (traj.end_reason, traj.reward, traj.invalid) == ("max_turns", 0.0, True)
    assert "stopped at its max_turns limit" in traj.grade_reason


def test_sandboxes_are_removed_on_the_tool_threads_not_the_loop_s(setup, tmp_path):
    """close() ran on the loop's thread after grading: removing a large repository held up
    every other trajectory's next engine call."""
    import threading

    tok, chat, suite = setup
    closed_on = []

    class Recording(SweSession):
        def close(self):
            closed_on.append(threading.current_thread().name)
            super().close()
    session = SweSessionSettings(SandboxLimits(command_timeout_s=20), 60.0, tmp_path / "sandboxes")
    for script, settings in ((known_fix_script, AgentSettings(max_context_tokens=8192, tool_threads=2)),
                             (sleeper_script(0.6), AgentSettings(max_context_tokens=8192, trajectory_timeout_s=1.0,
                                                                 tool_threads=2))):
        jobs = [(t.task_id, i, (lambda t=t: Recording(t, session, messages))) for i, t in enumerate(suite[:2])]
        trajectories, _ = run_trajectories(ScriptedEngine(tok, suite, script), chat, jobs, PARAMS, settings)
        assert {t.end_reason for t in trajectories} == {"finish" if script is known_fix_script else "timeout"}
        assert not any((tmp_path / "sandboxes").iterdir())
    assert len(closed_on) >= 4 and all(name.startswith("agent-tools") for name in closed_on), closed_on


def test_a_failing_sandbox_start_stops_the_rollout_and_leaves_no_sandbox(setup, tmp_path):
    tok, chat, suite = setup
    session = SweSessionSettings(SandboxLimits(command_timeout_s=20), 60.0, tmp_path / "sandboxes")

    def broken():
        raise OSError("no space left for the repository copy")
    jobs = [(t.task_id, i, (lambda t=t: SweSession(t, session, messages))) for i, t in enumerate(suite[:3])]
    jobs.insert(1, ("broken", 9, broken))
    with pytest.raises(OSError, match="no space left"):
        run_trajectories(ScriptedEngine(tok, suite, known_fix_script), chat, jobs, PARAMS,
                         AgentSettings(max_context_tokens=8192, tool_threads=2))
    assert not any((tmp_path / "sandboxes").iterdir())


def test_a_finish_after_observations_that_fill_the_context_still_finishes(setup, tmp_path):
    """A last turn of a large look and then ``finish`` ended "context" and its reward was
    masked: the finish never ran, though a finish's turn adds nothing to the context."""
    def fix_look_finish(task_id, turn, text):
        if turn < 2:
            return known_fix_script(task_id, turn, text)
        return call_text("execute_bash", command="seq 100000 105000") + "\n" + call_text("finish", message="fixed")
    settings = AgentSettings(max_context_tokens=8192, tool_threads=2, max_observation_chars=30000)
    (traj,), _ = run(setup, tmp_path, fix_look_finish, settings, tasks=setup[2][:1])
    room = 8192 - traj.num_tokens
    assert setup[1].count(traj.turns[-1].observations[0]) >= room  # the look alone filled the context
    assert (traj.end_reason, traj.reward, traj.invalid) == ("finish", 1.0, False), [t.observations for t in traj.turns]
