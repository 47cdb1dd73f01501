"""Task suites: prompts, validation sets and reward functions, by config name."""

from __future__ import annotations

from mlperf_grpo.tasks import arithmetic
from mlperf_grpo.tasks.base import Task

SUITES = {"arithmetic": arithmetic}
"""Config ``task.name`` -> module with ``validation_tasks``, ``train_tasks``, ``reward``."""

__all__ = ["SUITES", "Task"]
