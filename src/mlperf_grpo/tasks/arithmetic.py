"""Two-digit addition: the built-in task.

A task is ``"a+b="`` with ``10 <= a, b <= 99``; the answer is the decimal sum. The
final answer of a completion is the number the model wrote and nothing else: the whole
completion (spaces around it aside) must be a decimal integer, compared exactly with the
sum (:func:`final_answer`). ``99=46`` or ``12+34`` for ``12+34=`` earn nothing. The
validation set is a fixed list of distinct problems drawn with a fixed seed; the
training pool is drawn from the remaining problems, so the two never overlap.
"""

from __future__ import annotations

import random
import re

from mlperf_grpo.tasks.base import Task, TaskError

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
        TaskError: more tasks asked for than problems exist (8,100): one line, exit 2.
    """
    problems = all_problems()
    if num_tasks > len(problems):
        raise TaskError(f"the arithmetic task has {len(problems)} problems; validation.num_tasks is {num_tasks}: "
                        f"set validation.num_tasks to at most {len(problems)}")
    random.Random(VALIDATION_SEED).shuffle(problems)
    return [_task(a, b) for a, b in problems[:num_tasks]]


def train_tasks(num_tasks: int, num_validation_tasks: int, seed: int) -> list[Task]:
    """A training pool of ``num_tasks`` problems disjoint from the validation tasks.

    Raises:
        TaskError: the pool does not fit beside the validation set: one line, exit 2.
    """
    held_out = {t.task_id for t in validation_tasks(num_validation_tasks)}
    problems = [p for p in all_problems() if f"add-{p[0]}-{p[1]}" not in held_out]
    if num_tasks > len(problems):
        raise TaskError(
            f"the arithmetic task has {len(problems)} problems outside the validation set; task.num_train_tasks is "
            f"{num_tasks}: set task.num_train_tasks to at most {len(problems)}"
        )
    random.Random(seed).shuffle(problems)
    return [_task(a, b) for a, b in problems[:num_tasks]]


_INTEGER = re.compile(r"\d+")


def final_answer(completion: str) -> int | None:
    """The number ``completion`` states: the whole text (stripped) as a decimal integer.

    Returns:
        The integer, or None when the completion is anything else (an expression, an
        equation, words, several numbers, nothing).
    """
    text = completion.strip()
    return int(text) if _INTEGER.fullmatch(text) else None


def reward(completion: str, task: Task) -> float:
    """1.0 when ``completion``'s final answer (:func:`final_answer`) equals the sum exactly, else 0.0."""
    answer = final_answer(completion)
    return 1.0 if answer is not None and answer == int(task.answer) else 0.0
