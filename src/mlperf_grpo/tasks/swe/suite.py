"""The ``task.name: swe`` suite: training and validation :class:`SweTask` rows for the agent loop.

``task: {name: swe, suite: tiny}`` is the shipped tiny suite (:mod:`.tiny`);
``task: {name: swe, train_path: ..., validation_path: ...}`` reads JSONL rows
(:mod:`.rows`: the benchmark's NeMo Gym files or R2E-Gym / SWE-bench rows). Row order is
kept everywhere: the benchmark's files are curriculum-ordered and not shuffled (DESIGN.md,
"The benchmark's workload"), so the training pool is the first ``task.num_train_tasks``
rows and the seed does not reorder them. Validation is every validation row, which must
number exactly ``validation.num_tasks`` (251 in the benchmark).

There is no completion-text reward: a trajectory is scored by its hidden tests
(:func:`.grade.grade`), which the agent loop calls; :attr:`SweSuite.agentic` tells the
trainer and the evaluator to run that loop.
"""

from __future__ import annotations

from pathlib import Path

from mlperf_grpo.tasks.base import Task, TaskError
from mlperf_grpo.tasks.swe.rows import load_swe_rows
from mlperf_grpo.tasks.swe.task import SweTask
from mlperf_grpo.tasks.swe.tiny import tiny_suite

REWARD = "mlperf_grpo.tasks.swe.suite:no_text_reward"


def no_text_reward(completion: str, task: Task) -> float:
    """Refuses: a swe task is rewarded by its hidden tests after a whole trajectory.

    Raises:
        TaskError: always.
    """
    raise TaskError("task.name swe is rewarded by the task's hidden tests after an agent trajectory "
                    "(tasks/swe/grade.py), not by one completion's text")


class SweSuite:
    """Training and validation rows of the swe task (module docstring).

    Args:
        train, validation: the rows, in order.
        train_source, validation_source: where they came from, for messages.
    Raises:
        TaskError: a task id in both lists.
    """

    reward = REWARD
    agentic = True
    """The rollouts are agent trajectories in sandboxes (``mlperf_grpo.agent``)."""

    def __init__(self, train: list[SweTask], validation: list[SweTask], train_source: str, validation_source: str):
        self._train, self._validation = list(train), list(validation)
        self.train_source, self.validation_source = train_source, validation_source
        shared = {t.task_id for t in self._train} & {t.task_id for t in self._validation}
        if shared:
            raise TaskError(f"{validation_source}: instance_id {sorted(shared)[0]!r} is also in {train_source}; "
                            "training and validation tasks must not overlap")

    def validation_tasks(self, num_tasks: int) -> list[SweTask]:
        """Every validation row, in order.

        Raises:
            TaskError: there are not exactly ``num_tasks`` rows.
        """
        if len(self._validation) != num_tasks:
            raise TaskError(f"{self.validation_source} has {len(self._validation)} rows; validation.num_tasks is "
                            f"{num_tasks}: set validation.num_tasks to {len(self._validation)}")
        return list(self._validation)

    def train_tasks(self, num_tasks: int, num_validation_tasks: int, seed: int) -> list[SweTask]:
        """The first ``num_tasks`` training rows, in order (``seed`` unused: no shuffling).

        Raises:
            TaskError: fewer rows than ``num_tasks``.
        """
        if num_tasks > len(self._train):
            raise TaskError(f"{self.train_source} has {len(self._train)} rows; task.num_train_tasks is {num_tasks}: "
                            f"set task.num_train_tasks to at most {len(self._train)}")
        return self._train[:num_tasks]


def load_swe_suite(suite: str | None, train_path: str | None, validation_path: str | None,
                   root: Path | None = None) -> SweSuite:
    """The :class:`SweSuite` of a ``task`` config section.

    Args:
        suite: ``"tiny"`` for the shipped suite, or None to read the two files.
        root: folder for the tiny suite's repositories (default: the temp folder).
    Raises:
        TaskError: as :func:`.rows.load_swe_rows`, or neither a suite nor two files.
    """
    if suite == "tiny":
        return SweSuite(tiny_suite("train", root), tiny_suite("validation", root), "the tiny swe suite (train)",
                        "the tiny swe suite (validation)")
    if suite is not None or train_path is None or validation_path is None:
        raise TaskError("task.name swe needs task.suite: tiny, or task.train_path and task.validation_path")
    return SweSuite(load_swe_rows(Path(train_path)), load_swe_rows(Path(validation_path)), train_path, validation_path)
