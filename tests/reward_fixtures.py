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
    """``"sleep S"`` sleeps S seconds (then scores 0); anything else: the arithmetic reward."""
    if completion.startswith("sleep "):
        time.sleep(float(completion.split()[1]))
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
