"""What a run directory's evaluation results say, read without trusting the log.

``<run>/eval/step_N.jsonl`` (written by the evaluator: a header line, then one line per
validation task with its ``rewards``) gives each checkpoint's accuracy again:
pass@k over the stored rewards (:func:`mlperf_grpo.rules.pass_at_k`), which is how the
evaluator computed the value it logged. ``check`` compares the log with it. An
evaluation of ``--checkpoints <run>/checkpoints`` (the series outside its run directory)
writes them to ``<run>/checkpoints/eval/`` instead (:func:`results_dirs`: both are read).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from mlperf_grpo import rules

_RESULTS = re.compile(r"step_(\d+)\.jsonl")


@dataclass(frozen=True)
class StoredResult:
    """One ``eval/step_N.jsonl``: ``accuracy`` is pass@k of its rewards (a float in [0, 1]),
    or None with ``problem`` (one sentence) when the file cannot give one."""

    path: Path
    tasks: int
    accuracy: float | None
    problem: str | None = None


def _rewards(record: object) -> list[float] | None:
    """A task line's rewards when they are a non-empty list of finite numbers, else None."""
    rewards = record.get("rewards") if isinstance(record, dict) else None
    if not isinstance(rewards, list) or not rewards:
        return None
    ok = all(isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) for r in rewards)
    return rewards if ok else None


def read_result(path: Path) -> StoredResult:
    """pass@k of one results file. Never raises: an unreadable file, a line that is not JSON
    or a task without finite rewards is a :class:`StoredResult` with a ``problem``."""
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError as err:
        return StoredResult(path, 0, None, f"cannot read it: {err.strerror or err}")
    rewards = []
    for n, line in enumerate(lines[1:], start=2):  # line 1 is the header (sampling, seed, engine)
        try:
            task = _rewards(json.loads(line))
        except (ValueError, RecursionError):
            task = None
        if task is None:
            return StoredResult(path, len(lines) - 1, None, f"line {n} is not a task with a list of finite rewards")
        rewards.append(task)
    if not rewards:
        return StoredResult(path, 0, None, "it holds no task")
    return StoredResult(path, len(rewards), rules.pass_at_k(rewards))


def results_dirs(run_dir: Path | None) -> list[Path]:
    """The folders of a run directory that hold evaluation results: ``<run_dir>/eval/``
    and ``<run_dir>/checkpoints/eval/`` (where ``evaluate --checkpoints
    <run_dir>/checkpoints`` writes, also when it resumes an evaluation of the run), those
    that exist; empty without a run directory."""
    if run_dir is None:
        return []
    return [folder for folder in (Path(run_dir) / "eval", Path(run_dir) / "checkpoints" / "eval") if folder.is_dir()]


def result_files(run_dir: Path | None) -> dict[int, list[Path]]:
    """step -> its ``step_N.jsonl`` files in :func:`results_dirs` (one, or one per folder)."""
    found: dict[int, list[Path]] = {}
    for folder in results_dirs(run_dir):
        for path in sorted(folder.glob("step_*.jsonl")):
            if (m := _RESULTS.fullmatch(path.name)) is not None:
                found.setdefault(int(m.group(1)), []).append(path)
    return found


def stored_results(run_dir: Path | None) -> dict[int, StoredResult]:
    """step -> :class:`StoredResult` of its ``step_N.jsonl`` in :func:`results_dirs`
    (empty without one). A step with a file in both folders whose accuracies or task
    counts differ gets a ``problem`` naming both."""
    found = {}
    for step, paths in result_files(run_dir).items():
        results = [read_result(path) for path in paths]
        first = results[0]
        other = next((r for r in results[1:] if (r.accuracy, r.tasks) != (first.accuracy, first.tasks)), None)
        found[step] = first if other is None else StoredResult(
            first.path, first.tasks, None, f"{other.path} holds other results for the same step")
    return found
