"""The task record and the task-suite protocol shared by every task source."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from mlperf_grpo.errors import ConfigError


@dataclass(frozen=True)
class Task:
    """One prompt with a programmatically checkable answer.

    ``task_id`` is stable across runs; pass@k groups generations by it.
    """

    task_id: str
    prompt: str
    answer: str


class TaskError(ConfigError):
    """A task source is unusable (bad file, row, count or entry point); one line, exit 2."""


@runtime_checkable
class TaskSuite(Protocol):
    """What a task source provides; ``task: {name: python, entry_point: "pkg.mod:factory"}``
    calls ``factory()`` with no arguments and expects an object with these three members.

    - ``validation_tasks(num_tasks) -> list[Task]``: exactly ``num_tasks`` tasks with
      distinct ids, the same list on every call (``eval_samples`` of them).
    - ``train_tasks(num_tasks, num_validation_tasks, seed) -> list[Task]``: the training
      prompt pool (``num_tasks`` of them, logged as ``train_samples``), disjoint from the
      validation tasks.
    - ``reward``: ``(completion_text, task) -> float``, a module-level function or its
      ``"module:function"`` name: it runs in a scoring worker process, which imports it
      by name, under ``tasks.scoring``'s timeout and error policy (a reward > 0 is a pass).
    """

    reward: Callable[[str, Task], float] | str

    def validation_tasks(self, num_tasks: int) -> list[Task]: ...

    def train_tasks(self, num_tasks: int, num_validation_tasks: int, seed: int) -> list[Task]: ...


def is_agentic(suite: object) -> bool:
    """True for a suite whose samples are agent trajectories graded in sandboxes
    (``task.name: swe``, :class:`~mlperf_grpo.agent.suite.AgentSuite`, ``agentic = True``):
    its ``reward`` is not called; the agent's grading gives each trajectory's reward."""
    return bool(getattr(suite, "agentic", False))
