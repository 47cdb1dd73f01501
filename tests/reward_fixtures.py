"""Module-level reward functions for the scoring tests (a scoring worker imports them by name)."""

import os
import time

from mlperf_grpo.tasks import arithmetic

BAD_TASK = arithmetic.validation_tasks(251)[7].task_id
"""The validation task on which :func:`crashing_reward` raises."""


def crashing_reward(completion, task):
    """The arithmetic reward, except that it raises on :data:`BAD_TASK`."""
    if task.task_id == BAD_TASK:
        raise RuntimeError("sandbox crashed")
    return arithmetic.reward(completion, task)


def sleepy_reward(completion, task):
    """``"sleep S"`` sleeps S seconds (then scores 0); ``"sleep S DIR"`` first creates the
    empty file ``DIR/<worker pid>`` (so a test sees the call has started); anything else:
    the arithmetic reward."""
    if completion.startswith("sleep "):
        _, seconds, *marks = completion.split()
        for mark in marks:
            open(os.path.join(mark, str(os.getpid())), "w").close()
        time.sleep(float(seconds))
        return 0.0
    return arithmetic.reward(completion, task)


def pid_reward(completion, task):
    """The worker's process id (to see which process scored a call)."""
    return float(os.getpid())


def dying_reward(completion, task):
    """``"die"`` ends the worker process at once; anything else: the arithmetic reward."""
    if completion == "die":
        os._exit(7)
    return arithmetic.reward(completion, task)


def bad_value_reward(completion, task):
    """Returns a value that is not a number."""
    return "many"


class ArithmeticSubset:
    """A task suite for ``task: {name: python}``: the arithmetic tasks, this module's reward."""

    reward = "reward_fixtures:sleepy_reward"

    def validation_tasks(self, num_tasks):
        return arithmetic.validation_tasks(num_tasks)

    def train_tasks(self, num_tasks, num_validation_tasks, seed):
        return arithmetic.train_tasks(num_tasks, num_validation_tasks, seed)


def arithmetic_subset():
    """Entry point ``reward_fixtures:arithmetic_subset``."""
    return ArithmeticSubset()


def not_a_suite():
    """An entry point that returns the wrong type."""
    return ["validation", "train"]


def failing_factory():
    """An entry point that raises."""
    raise OSError("sandbox image missing")


def closure_reward_suite():
    """A suite whose reward a worker cannot import."""
    suite = ArithmeticSubset()
    suite.reward = lambda completion, task: 1.0
    return suite


def short_suite():
    """A suite whose validation_tasks returns one task too few."""
    suite = ArithmeticSubset()
    suite.validation_tasks = lambda n: arithmetic.validation_tasks(n - 1)
    return suite
