"""What a run directory's evaluation results say, read without trusting the log.

``<run>/eval/step_N.jsonl`` (written by the evaluator: a header line, then one line per
validation task with its ``rewards``) gives each checkpoint's accuracy again:
pass@k over the stored rewards (:func:`mlperf_grpo.rules.pass_at_k`), which is how the
evaluator computed the value it logged. ``check`` compares the log with it. An
evaluation of ``--checkpoints <run>/checkpoints`` (the series outside its run directory)
writes them to ``<run>/checkpoints/eval/`` instead (:func:`results_dir`).
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


def results_dir(run_dir: Path | None) -> Path | None:
    """Where a run directory's evaluation results are: ``<run_dir>/eval/`` when it holds a
    ``step_N.jsonl``, else ``<run_dir>/checkpoints/eval/`` when that does (the results of
    ``evaluate --checkpoints <run_dir>/checkpoints``), else ``<run_dir>/eval/`` when it is
    a folder; None without a run directory or any of these."""
    if run_dir is None:
        return None
    candidates = [Path(run_dir) / "eval", Path(run_dir) / "checkpoints" / "eval"]
    for folder in candidates:
        if any(_RESULTS.fullmatch(p.name) for p in folder.glob("step_*.jsonl")):
            return folder
    return candidates[0] if candidates[0].is_dir() else None


def stored_results(run_dir: Path | None) -> dict[int, StoredResult]:
    """step -> :class:`StoredResult` of every ``step_N.jsonl`` in :func:`results_dir`
    (empty without one)."""
    eval_dir = results_dir(run_dir)
    if eval_dir is None:
        return {}
    found = {}
    for path in sorted(eval_dir.glob("step_*.jsonl")):
        if (m := _RESULTS.fullmatch(path.name)) is not None:
            found[int(m.group(1))] = read_result(path)
    return found
