"""``mlperf-grpo check``: the official checkers plus the offline-evaluation lint.

:func:`check_log` reads one log, runs the lint rules of :mod:`mlperf_grpo.logs.check.lint`,
the official compliance checker (training 6.1.0), RCP checker and summarizer (in a child
process with a time limit, :func:`mlperf_grpo.logs.check.official.run_official`), and the
score computations of :mod:`mlperf_grpo.logs.check.score`, and returns a :class:`CheckReport`.
Every input gets a verdict in bounded time: the lint never raises, lines over
:data:`~mlperf_grpo.logs.check.lint.MAX_LINE_CHARS` are a finding and keep the official
checkers from running (verdict ``SKIPPED``), and a checker run over the limit is killed
(verdict ``TIMEOUT``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from mlperf_grpo.logs.check.findings import Finding
from mlperf_grpo.logs.check.lint import MAX_LINE_CHARS, LintInput, lint
from mlperf_grpo.logs.check.official import OFFICIAL_TIME_LIMIT_S, ComplianceResult, not_run, run_official
from mlperf_grpo.logs.check.score import Score, compute_score
from mlperf_grpo.logs.check.shape import EvalMode, evaluation_mode
from mlperf_grpo.logs.mllog import ParsedLog, parse_log_text
from mlperf_grpo.logs.values import UnreadableLog, find_run_dir, load_log_text

__all__ = ["CheckReport", "Finding", "UnreadableLog", "check_log", "find_run_dir", "load_log_text"]


@dataclass
class CheckReport:
    """Everything ``check`` found about one log. ``clean`` means exit code 0."""

    path: Path
    run_dir: Path | None
    official: ComplianceResult
    findings: list[Finding]
    score: Score
    notes: list[str] = field(default_factory=list)
    mode: EvalMode | None = None
    """Inline or deferred evaluation, and the evidence (:func:`~mlperf_grpo.logs.check.shape.evaluation_mode`)."""

    @property
    def clean(self) -> bool:
        return self.official.valid and not self.findings and not self.score.disagreements

    def official_summary(self) -> str:
        """The official verdict and its top reasons in one line a person can act on."""
        return official_summary(self.official)

    def to_dict(self) -> dict:
        return {
            "log": str(self.path),
            "run_dir": str(self.run_dir) if self.run_dir else None,
            "clean": self.clean,
            "official": {
                "verdict": self.official.verdict,
                "summary": self.official_summary(),
                "division": self.official.division,
                "configs": self.official.configs,
                "messages": self.official.messages,
            },
            "score": self.score.to_dict(),
            "evaluation": {"mode": self.mode.mode, "evidence": self.mode.evidence} if self.mode else None,
            "findings": [f.to_dict() for f in self.findings],
            "notes": self.notes,
        }


_MISSING = re.compile(r"Required \w+ occurrence of '([^']+)' but found 0")
_FAILED_LINE = re.compile(r"CHECK for '([^']+)' failed in line (\d+).*?failed test:\s*(.+?)\s*(?:current context|$)", re.S)
_FAILED_KEY = re.compile(r"Failed checks for (\S+)\s*:\s*(.+)")


def official_summary(result: ComplianceResult, top: int = 3) -> str:
    """The official verdict and its top reasons in one line a person can act on.

    Missing required keys are counted and the first named; failed value checks name the
    key, its file line (the checker's own numbering counts ``:::MLLOG`` lines from 0:
    :meth:`ComplianceResult.file_line`) and the failing test; anything else contributes
    its first line.
    """
    if result.valid:
        return "SUCCESS"
    missing: list[str] = []
    reasons: list[str] = []
    for message in result.messages:
        if found := _MISSING.search(message):
            missing.append(found.group(1))
        elif found := _FAILED_LINE.search(message):
            line = result.file_line(int(found.group(2)))
            where = f"line {line}" if line is not None else f"the checker's line index {found.group(2)}"
            reasons.append(f"{found.group(1)} ({where}) fails {' '.join(found.group(3).split())}")
        elif found := _FAILED_KEY.search(message):
            reasons.append(f"{found.group(1)} fails {' '.join(found.group(2).split())}")
        elif message.strip():
            reasons.append(message.strip().splitlines()[0][:160])
    if missing:
        names = ", ".join(missing[:top]) + (f", +{len(missing) - top} more" if len(missing) > top else "")
        reasons.insert(0, f"{len(missing)} required key(s) missing ({names})")
    reasons = list(dict.fromkeys(reasons))
    more = f"; +{len(reasons) - top} more" if len(reasons) > top else ""
    fix = ""
    if missing or any(" fails " in r for r in reasons):
        fix = " -> log the missing keys and fix the failing values (all messages below), then check again"
    return f"{result.verdict}: " + ("; ".join(reasons[:top]) or "no message") + more + fix


def lint_text(text: str, run_dir: Path | None = None) -> tuple[ParsedLog, list[Finding], list[str]]:
    """Parse log text and run the lint only (no official checker). Never raises."""
    log = parse_log_text(text)
    inp = LintInput(log=log, lines=text.splitlines(), run_dir=run_dir)
    return log, lint(inp), inp.notes


def check_log(path: Path, run_dir: Path | None = None, *, auto_run_dir: bool = True,
              time_limit_s: float = OFFICIAL_TIME_LIMIT_S) -> CheckReport:
    """Check one MLPerf log.

    Args:
        path: the log file.
        run_dir: the run directory (checkpoints' ``training_info.json``, ``eval/``);
            found next to the log when ``auto_run_dir`` and not given.
        time_limit_s: limit for the official checkers together (seconds); past it they
            are killed and the verdict is ``TIMEOUT``.
    Raises:
        UnreadableLog: see :func:`load_log_text`. Nothing else: the official checkers'
            crashes become messages.
    """
    path = Path(path)
    text = load_log_text(path)
    if run_dir is None and auto_run_dir:
        run_dir = find_run_dir(path)
    log, findings, notes = lint_text(text, run_dir)
    long_lines = [f.line for f in findings if f.rule == "long-line"]
    if long_lines:
        results = not_run(f"not run: line {long_lines[0]} is longer than {MAX_LINE_CHARS} characters "
                          "(the official checkers are quadratic in line length)")
    else:
        results = run_official(path, time_limit_s)
    score = compute_score(log, results.summarizer, results.rcp)
    return CheckReport(path, run_dir, results.compliance, findings, score, notes + score.notes,
                       evaluation_mode(log, run_dir))
