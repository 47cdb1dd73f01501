"""The software-repair task record (``task.name: swe``) and what grading needs of it.

A task is a repository at a commit plus an issue text; the agent edits the repository in
its sandbox and the task's hidden tests decide the reward (:mod:`.grade`). Field meanings
follow the rows the benchmark reads: R2E-Gym (``expected_output_json``,
``execution_result_content``) and SWE-bench / SWE-Gym (``FAIL_TO_PASS``,
``PASS_TO_PASS``, ``test_patch``), both as carried by NeMo Gym's ``instance_dict``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

LogFormat = Literal["unittest", "pytest-r2e", "pytest-swebench"]
"""How a test log is read into ``{test name: status}`` (:mod:`.log_parsers`)."""


@dataclass(frozen=True)
class Grading:
    """What the grader copies into the final state, runs and compares.

    Exactly one rule applies: ``expected`` (R2E-Gym: the parsed log must equal it) or
    ``fail_to_pass`` + ``pass_to_pass`` (SWE-bench: every named test must pass).
    """

    test_files: tuple[tuple[str, str], ...]
    """``(path relative to the repository, text)``: written into the final state before
    the run, replacing whatever the agent left at those paths (R2E-Gym: ``r2e_tests/*``)."""
    test_command: str
    """Shell command run in the sandbox's repository folder (bash -c)."""
    log_format: LogFormat
    expected: tuple[tuple[str, str], ...] | None = None
    """R2E-Gym ``expected_output_json`` as ``(test name, status)`` pairs, or None."""
    fail_to_pass: tuple[str, ...] = ()
    pass_to_pass: tuple[str, ...] = ()
    test_patch: str | None = None
    """SWE-bench: a unified diff adding the hidden tests, applied with ``git apply``."""


@dataclass(frozen=True)
class SweTask:
    """One software-repair task; ``task_id`` groups pass@k (the row's ``instance_id``)."""

    task_id: str
    problem_statement: str
    repo_dir: Path | None
    """A local copy of the repository at its base commit (tiny suite, or user-provided
    through the row's ``repo_dir``), or None when only ``image`` holds it."""
    image: str | None
    """The container image the row names (SIF path or OCI name), or None."""
    grading: Grading
    metadata: dict = field(default_factory=dict, compare=False, hash=False)
    """Row fields kept for logs and prompts (``repo``, ``base_commit``, ``dataset_name``, ...)."""

    @property
    def prompt(self) -> str:
        """The issue text: what a :class:`~mlperf_grpo.tasks.base.Task`'s ``prompt`` is to
        code that fingerprints tasks (``eval_settings``: ids, prompts, answers)."""
        return self.problem_statement

    @property
    def answer(self) -> str:
        """The grading as canonical JSON (test files, command, expected outcome): a
        :class:`~mlperf_grpo.tasks.base.Task`'s ``answer`` for fingerprints, so an edited
        hidden test or expected status changes the validation tasks' hash."""
        return json.dumps(asdict(self.grading), sort_keys=True, ensure_ascii=False)
