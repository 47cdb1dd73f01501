"""A task a random-init model earns reward on: the built-in arithmetic prompts, rewarded
for the format of the answer only.

``task: {name: python, entry_point: "format_task:factory"}`` (with ``benchmarks/`` on
``sys.path``, as it is for a script run from there). The prompts, validation set and
training pool are the built-in arithmetic task's (``mlperf_grpo.tasks.arithmetic``);
:func:`reward` is 1.0 when the whole completion is a decimal integer, **whatever its
value** (the format half of the arithmetic reward), else 0.0.

Why the benchmarks use it: a random-init model almost never writes the right sum, so
with the real reward every group's rewards are equal, every advantage is 0, and the
loss and the gradients are exactly 0: a comparison of 1 rank against N then compares
zeros. With the built-in tokenizer (15 tokens, ``<eos>`` among them) a random model
writes digits and then ``<eos>`` in about a quarter of its completions, so almost every
group of 16 has rewards of both values, the advantages and gradients are not zero, and
the loss is not either (the rewarded completions are the short ones, so the token-level
mean of ``-A`` does not cancel). The work of a step (generation, scoring in the reward
workers, forward and backward passes, optimizer step, refit) is the same as with the
real reward; only the reward values differ. A benchmark figure measured with this task
says so in its output (``"task": "format"``).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlperf_grpo.tasks import arithmetic
from mlperf_grpo.tasks.base import Task


def reward(completion: str, task: Task) -> float:
    """1.0 when ``completion`` (stripped) is a decimal integer of any value, else 0.0
    (:func:`mlperf_grpo.tasks.arithmetic.final_answer` finds one)."""
    return 1.0 if arithmetic.final_answer(completion) is not None else 0.0


@dataclass(frozen=True)
class FormatSuite:
    """The arithmetic task's prompts with :func:`reward` (a ``TaskSuite``)."""

    reward: str = "format_task:reward"

    def validation_tasks(self, num_tasks: int) -> list[Task]:
        """The built-in arithmetic validation tasks."""
        return arithmetic.validation_tasks(num_tasks)

    def train_tasks(self, num_tasks: int, num_validation_tasks: int, seed: int) -> list[Task]:
        """The built-in arithmetic training pool."""
        return arithmetic.train_tasks(num_tasks, num_validation_tasks, seed)


def factory() -> FormatSuite:
    """The suite, for ``task.entry_point: "format_task:factory"``."""
    return FormatSuite()
