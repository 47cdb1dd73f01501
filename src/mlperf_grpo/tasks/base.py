"""The task record shared by every task suite."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    """One prompt with a programmatically checkable answer.

    ``task_id`` is stable across runs; pass@k groups generations by it.
    """

    task_id: str
    prompt: str
    answer: str
