"""The agent of ``task.name: swe`` for training rollouts and validation alike: from the
config's ``agent`` section, one sandboxed trajectory per (task, seed), all in flight
together (``agent/loop.py``). The tasks are the suite's
:class:`~mlperf_grpo.tasks.swe.SweTask` rows (``tasks/swe/suite.py``)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from mlperf_grpo.agent.chat import ChatTokens
from mlperf_grpo.agent.loop import AgentSettings, RolloutStats, run_trajectories
from mlperf_grpo.agent.swe_session import SweSession, SweSessionSettings
from mlperf_grpo.agent.tools import TOOL_SCHEMAS
from mlperf_grpo.agent.trajectory import Trajectory
from mlperf_grpo.errors import ConfigError
from mlperf_grpo.inference.base import SamplingParams
from mlperf_grpo.sandbox import INSIDE_WORKDIR, SandboxLimits, backend_name, cleanup_leftovers, root_problem
from mlperf_grpo.tasks.lengths import PromptTooLongError
from mlperf_grpo.tasks.swe import SweTask
from mlperf_grpo.tasks.swe.prompt import agent_messages, load_templates

TEMPLATE_KWARGS = {"enable_thinking": False}
"""The reference runs the agent with thinking off (DESIGN.md, "The benchmark's workload")."""


@dataclass
class AgentRun:
    """The trajectories of one :meth:`AgentRunner.trajectories` call, in job order, and its stats."""

    trajectories: list[Trajectory]
    stats: RolloutStats


def sandbox_root(agent) -> Path:
    """``agent.sandbox_root``, or ``$TMPDIR/mlperf-grpo-sandboxes-<uid>`` (one per user:
    another user's is not writable, and must not be used)."""
    if agent.sandbox_root:
        return Path(agent.sandbox_root)
    return Path(tempfile.gettempdir()) / f"mlperf-grpo-sandboxes-{os.geteuid()}"


class AgentRunner:
    """Runs trajectories with the settings of a config's ``agent`` section
    (:class:`~mlperf_grpo.config.sections.AgentConfig`). Construction removes leftover
    sandboxes of killed runs under the sandbox root (one it cannot remove is left, with a
    warning line: ``sandbox.cleanup_leftovers``).

    Raises:
        ConfigError: no sandbox runtime on this machine (``sandbox.backend_name``), or a
            sandbox root that cannot be a folder (made here when missing).
        TaskError: ``agent.prompt_files`` that cannot be read.
    """

    def __init__(self, agent) -> None:
        root = sandbox_root(agent)
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"agent.sandbox_root {str(root)!r} cannot be made a folder ({error.strerror}); "
                              "give a writable folder") from None
        problem = root_problem(root)
        if problem:
            raise ConfigError(f"agent.sandbox_root {str(root)!r} cannot hold sandboxes: {problem}; "
                              "give a folder of your own")
        backend_name()  # refuses a machine without a sandbox runtime, before anything runs
        self.settings = AgentSettings(
            max_turns=agent.max_turns, max_context_tokens=agent.max_context_tokens,
            max_new_tokens_per_turn=agent.max_new_tokens_per_turn, trajectory_timeout_s=agent.trajectory_timeout_s,
            max_observation_chars=agent.max_observation_chars, tool_threads=agent.tool_threads)
        cleanup_leftovers(root)  # sandboxes of runs that were killed
        self.session = SweSessionSettings(SandboxLimits(command_timeout_s=agent.command_timeout_s), agent.test_timeout_s,
                                          root)
        self.tools = [s for s in TOOL_SCHEMAS if s["function"]["name"] in agent.tools]
        templates = agent.prompt_style if agent.prompt_files is None else load_templates(
            Path(agent.prompt_files[0]), Path(agent.prompt_files[1]), tuple(Path(f) for f in agent.prompt_files[2:]))
        self._messages = partial(agent_messages, workspace_path=INSIDE_WORKDIR, templates=templates)
        self._chat: dict[int, ChatTokens] = {}

    def check_tokenizer(self, tokenizer, model_path: str) -> None:
        """Refuse a model whose tokenizer cannot write the agent's chat (no chat template,
        no ``<|im_end|>`` token: the arithmetic builtin), before the run directory exists.

        Raises:
            ConfigError: one line naming ``model_path`` and the model to use.
        """
        try:
            self.chat(tokenizer)
        except ValueError as error:
            raise ConfigError(f"model.path {model_path!r} cannot run task swe: {error}") from None

    def check_prompt_lengths(self, tokenizer, task_sets: dict[str, list[SweTask]]) -> None:
        """Refuse tasks whose first prompt (system and user turns, tool schemas, generation
        prompt) leaves no room for one sampled token in ``agent.max_context_tokens``: each
        such trajectory would end at once as overlong. Checked before the run directory exists.

        Raises:
            PromptTooLongError: one line naming the longest such prompt's task, set and tokens.
        """
        chat, limit = self.chat(tokenizer), self.settings.max_context_tokens
        for kind, tasks in task_sets.items():
            lengths = [len(chat.prompt_ids(self._messages(task))) for task in tasks]
            over = [i for i, n in enumerate(lengths) if n >= limit]
            if over:
                worst = max(over, key=lengths.__getitem__)
                raise PromptTooLongError(
                    f"{kind} task {tasks[worst].task_id!r}: the agent's first prompt is {lengths[worst]} tokens, "
                    f"no room left in agent.max_context_tokens {limit} ({len(over)} of {len(tasks)} {kind} prompts "
                    "are over it); raise agent.max_context_tokens, use agent.prompt_style: compact, or drop those tasks")

    def chat(self, tokenizer) -> ChatTokens:
        """The chat format of ``tokenizer`` with these tools (built once per tokenizer)."""
        if id(tokenizer) not in self._chat:
            self._chat[id(tokenizer)] = ChatTokens(tokenizer, self.tools, template_kwargs=TEMPLATE_KWARGS)
        return self._chat[id(tokenizer)]

    def trajectories(self, engine, jobs: list[tuple[SweTask, int]], params: SamplingParams) -> AgentRun:
        """One trajectory per ``(task, seed)`` of ``jobs`` with ``engine`` (its
        ``generate_ids`` and ``tokenizer``), in job order."""
        opened = [(t.task_id, seed, partial(SweSession, t, self.session, self._messages)) for t, seed in jobs]
        trajectories, stats = run_trajectories(engine, self.chat(engine.tokenizer), opened, params, self.settings)
        return AgentRun(trajectories, stats)
