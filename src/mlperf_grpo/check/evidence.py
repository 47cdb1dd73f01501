"""What a run directory's evaluation results say, read without trusting the log.

``<run>/eval/step_N.jsonl`` (written by the evaluator: a header line, then one line per
validation task with its ``rewards``) gives each checkpoint's accuracy again:
pass@k over the stored rewards (:func:`mlperf_grpo.rules.pass_at_k`), which is how the
evaluator computed the value it logged. ``check`` compares the log with it.
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


def stored_results(run_dir: Path | None) -> dict[int, StoredResult]:
    """step -> :class:`StoredResult` of every ``<run_dir>/eval/step_N.jsonl`` (empty without one)."""
    eval_dir = Path(run_dir) / "eval" if run_dir is not None else None
    if eval_dir is None or not eval_dir.is_dir():
        return {}
    found = {}
    for path in sorted(eval_dir.glob("step_*.jsonl")):
        if (m := _RESULTS.fullmatch(path.name)) is not None:
            found[int(m.group(1))] = read_result(path)
    return found
