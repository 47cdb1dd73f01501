"""What the offline-eval lint rules read (:class:`LintInput`) and the small helpers the
rule modules share (``check/lint.py``: lines, metadata, run_stop; ``check/lint_evals.py``:
the evaluation series and the run_stop's time and step). No function raises on any input."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlperf_grpo import rules
from mlperf_grpo.logs.mllog import LogEvent, ParsedLog
from mlperf_grpo.logs.values import is_number


@dataclass
class LintInput:
    """What the rules read.

    ``lines`` are the file's lines (``lines[n - 1]`` is line ``n``); ``run_dir`` is the
    run directory when known (its ``checkpoints/step_N/training_info.json`` and
    ``eval/step_N.jsonl`` are used when present); ``notes`` collects checks that
    could not be made (not findings).
    """

    log: ParsedLog
    lines: list[str]
    run_dir: Path | None = None
    target: float = rules.TARGET_ACCURACY
    notes: list[str] = field(default_factory=list)


def first_passing_eval(log: ParsedLog, target: float = rules.TARGET_ACCURACY) -> LogEvent | None:
    """The first ``eval_accuracy`` (file order) whose value is a number strictly above ``target``."""
    for e in log.find("eval_accuracy"):
        if is_number(e.value) and rules.is_passing(e.value, target):
            return e
    return None


def samples_count_value(e: LogEvent) -> Any:
    return e.metadata.get("samples_count")


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (values may be huge or deeply nested)."""
    try:
        text = repr(value)
    except RecursionError:
        text = f"<{type(value).__name__} nested too deeply>"
    return text if len(text) <= limit else text[:limit - 3] + "..."
