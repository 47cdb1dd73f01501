"""Two-digit addition: the built-in task, with answers checked by ``math-verify``.

A task is ``"a+b="`` with ``10 <= a, b <= 99``; the answer is the decimal sum. The
validation set is a fixed list of distinct problems drawn with a fixed seed; the
training pool is drawn from the remaining problems, so the two never overlap.
"""

from __future__ import annotations

import random

from mlperf_grpo.tasks.base import Task
from mlperf_grpo.tasks.verify import verify_answer

OPERAND_RANGE = range(10, 100)
VALIDATION_SEED = 20261130
"""Seed of the validation draw. Changing it changes every recorded accuracy."""


def all_problems() -> list[tuple[int, int]]:
    """Every ``(a, b)`` pair, in a fixed order (8,100 pairs)."""
    return [(a, b) for a in OPERAND_RANGE for b in OPERAND_RANGE]


def _task(a: int, b: int) -> Task:
    return Task(task_id=f"add-{a}-{b}", prompt=f"{a}+{b}=", answer=str(a + b))


def validation_tasks(num_tasks: int) -> list[Task]:
    """The first ``num_tasks`` problems of the fixed validation draw.

    Raises:
        ValueError: more tasks asked for than problems exist (8,100).
    """
    problems = all_problems()
    if num_tasks > len(problems):
        raise ValueError(f"arithmetic has {len(problems)} problems; asked for {num_tasks} validation tasks")
    random.Random(VALIDATION_SEED).shuffle(problems)
    return [_task(a, b) for a, b in problems[:num_tasks]]


def train_tasks(num_tasks: int, num_validation_tasks: int, seed: int) -> list[Task]:
    """A training pool of ``num_tasks`` problems disjoint from the validation tasks.

    Raises:
        ValueError: the pool does not fit beside the validation set.
    """
    held_out = {t.task_id for t in validation_tasks(num_validation_tasks)}
    problems = [p for p in all_problems() if f"add-{p[0]}-{p[1]}" not in held_out]
    if num_tasks > len(problems):
        raise ValueError(
            f"arithmetic has {len(problems)} problems outside the validation set; "
            f"asked for {num_tasks} training tasks"
        )
    random.Random(seed).shuffle(problems)
    return [_task(a, b) for a, b in problems[:num_tasks]]


def reward(completion: str, task: Task) -> float:
    """1.0 when ``completion``'s final answer equals the task's answer, else 0.0."""
    return 1.0 if verify_answer(completion, task.answer) else 0.0
