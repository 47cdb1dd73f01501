"""A software-repair task's trajectory environment: its own sandbox with a copy of the
task's repository, the reference agent's tools, and the task's hidden tests at the end
(:class:`~mlperf_grpo.agent.loop.Session` for ``task.name: swe``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlperf_grpo.agent.tools import Observation, ToolCall, execute
from mlperf_grpo.sandbox import Sandbox, SandboxLimits
from mlperf_grpo.tasks.swe import Grade, SweTask, grade, pristine_base_files


@dataclass(frozen=True)
class SweSessionSettings:
    """``limits``: each command's sandbox limits (``command_timeout_s``: the reference's
    60 s); ``test_timeout_s``: the hidden tests' run (60 s); ``root``: where sandboxes go."""

    limits: SandboxLimits
    test_timeout_s: float
    root: Path


class SweSession:
    """One trajectory of ``task``: the sandbox opens on construction, :meth:`close` removes it.

    The base versions of the files a test patch touches are read then, before the agent's
    first command: from ``task.repo_dir`` on the host, or from the sandbox's fresh copy of
    an image's ``/testbed`` (grading resets them from these, never from the agent's ``.git``).

    Raises:
        TaskError: a test patch whose base files cannot be read (the sandbox is closed).
    """

    def __init__(self, task: SweTask, settings: SweSessionSettings, messages: Callable[[SweTask], list[dict]]) -> None:
        self.task = task
        self.settings = settings
        self._messages = messages
        self.sandbox = Sandbox(task.repo_dir, settings.limits, settings.root, image=task.image)
        try:
            self._base_files = pristine_base_files(task, task.repo_dir or self.sandbox.workdir)
        except BaseException:
            self.sandbox.close()
            raise

    def messages(self) -> list[dict]:
        return self._messages(self.task)

    def call(self, call: ToolCall, max_chars: int) -> Observation:
        return execute(call, self.sandbox, max_chars)

    def grade(self) -> Grade:
        return grade(self.task, self.sandbox, self.settings.test_timeout_s, self._base_files)

    def close(self) -> None:
        self.sandbox.close()
