"""Offline-evaluation lint: what the official checkers let through but scores wrongly.

One function per rule; each takes a :class:`LintInput` and returns a list of
:class:`~mlperf_grpo.logs.check.findings.Finding`. :func:`lint` runs them all. No rule
raises on any input: values of the wrong type are findings, not errors.

Sources: DESIGN.md ("The rule, in one paragraph" and "How the official checkers read a
log"), the 6.1.0 compliance configs ``training_6.1.0/{common,closed_qwen35_397b_grpo}.yaml``,
``rcp_checker.read_submission_file`` and ``result_summarizer._query_run_start_stop`` of
``mlperf-logging``.
"""

from __future__ import annotations

from typing import Any, Callable

from mlperf_grpo.logs.check.findings import Finding
from mlperf_grpo.logs.check.lint_evals import (
    eval_at_target,
    eval_outside_run,
    eval_pairing,
    eval_results,
    eval_samples,
    eval_series,
    eval_values,
    evals_after_pass,
    run_stop_step,
    run_stop_time,
)
from mlperf_grpo.logs.check.lint_input import LintInput, first_passing_eval, samples_count_value, short
from mlperf_grpo.logs.check.run_dir import run_dir_of_log
from mlperf_grpo.logs.mllog import LogEvent, loads_line
from mlperf_grpo.logs.values import EVAL_KEYS, int_or_none, is_number, ms_text

MAX_LINE_CHARS = 4096
"""Longest ``:::MLLOG`` line the official checkers are given. Their line normalisation is
quadratic in line length (16 kB of nested JSON: about 1.7 s per parse, three parses per
check; 100 kB: about 10 s); a real line is under 1 kB (the longest in the reference and
our logs: about 260 characters), so 4096 leaves a wide margin and keeps a check fast."""

METADATA_INTS = ("samples_count", "step")
"""Metadata fields that must be non-negative integers wherever they appear."""

RCP_SUBSTRINGS = {
    "eval_accuracy": "the RCP checker treats every line containing 'eval_accuracy' as an evaluation and takes "
    "its samples_count as the convergence point (it crashes when the line has none)",
    "eval_error": "the RCP checker treats every line containing 'eval_error' as an evaluation and takes "
    "its samples_count as the convergence point (it crashes when the line has none)",
    "global_batch_size": "the RCP checker takes the value of every line containing 'global_batch_size' as "
    "the batch size and so may compare against the wrong reference convergence point",
    "submission_benchmark": "the RCP checker takes the value of every line containing 'submission_benchmark' "
    "as the benchmark name",
}
"""Substrings the RCP checker matches anywhere in a line, and what that does."""


# --- the rules ------------------------------------------------------------------------


def invalid_lines(inp: LintInput) -> list[Finding]:
    """``:::MLLOG`` lines that are not JSON objects, or lack what the official parser reads.

    The official parser (``mlp_parser.ruleset_610``) needs ``time_ms`` (a number),
    ``key``, ``value`` and ``metadata``; a missing one is a parse error or a crash.
    """
    out = []
    impact = ("the compliance checker fails the log ('Log lines had parsing errors') and the summarizer drops "
              "the run; the RCP checker crashes on it if the line mentions a key it reads")
    for line_no, reason in inp.log.bad_lines:
        out.append(Finding("invalid-json", line_no, "?", f"text after ':::MLLOG' is not a JSON object: {reason}", impact))
    for e in inp.log.events:
        raw = _raw_json(inp, e.line_no)
        missing = [k for k in ("time_ms", "value", "metadata") if not isinstance(raw, dict) or k not in raw]
        if missing:
            out.append(Finding.at("invalid-json", e, f"missing field(s) {', '.join(missing)}", impact))
        elif e.time_ms is None:
            out.append(Finding.at("invalid-json", e, f"time_ms {short(raw.get('time_ms'))} is not a number", impact))
    return out


def _raw_json(inp: LintInput, line_no: int) -> Any:
    try:
        return loads_line(inp.lines[line_no - 1])
    except (IndexError, ValueError):
        return None


def long_lines(inp: LintInput) -> list[Finding]:
    """Lines longer than :data:`MAX_LINE_CHARS`: the official checkers are not run on the log."""
    return [
        Finding("long-line", line_no, "?", f"line is {len(line)} characters, over the limit of {MAX_LINE_CHARS}",
                "the official checkers take time quadratic in line length on it (minutes to hours), so check does "
                "not run them: no official verdict; log large values elsewhere")
        for line_no, line in enumerate(inp.lines, start=1) if len(line) > MAX_LINE_CHARS
    ]


def metadata_types(inp: LintInput) -> list[Finding]:
    """Metadata that is not an object, or a ``samples_count``/``step`` that is present but not
    a non-negative integer, or a ``status`` that is not a string."""
    out = []
    impact = "the official checkers and the score read this field; a wrong type makes them crash or misread it"
    for e in inp.log.events:
        raw = _raw_json(inp, e.line_no)
        metadata = raw.get("metadata") if isinstance(raw, dict) else None
        if metadata is not None and not isinstance(metadata, dict):
            out.append(Finding.at("metadata-type", e, f"metadata is {type(metadata).__name__}, not an object", impact))
            continue
        for name in METADATA_INTS:
            if name in e.metadata:
                v = e.metadata[name]
                if int_or_none(v) is None or v < 0:
                    out.append(Finding.at("metadata-type", e,
                                          f"metadata {name} {short(v)} is not a non-negative integer", impact))
        if "status" in e.metadata and not isinstance(e.metadata["status"], str):
            out.append(Finding.at("metadata-type", e, f"metadata status {short(e.metadata['status'])} is not a string", impact))
    return out


_WRITER_METADATA = ("file", "lineno")
"""Metadata ``mlperf_logging`` adds to every line (where it was written): not what a line says."""


def _says(e: LogEvent) -> str:
    """What a line carries, for a message: its value, or (an interval event such as
    ``run_stop``, whose value is null) its time and metadata."""
    if e.value is not None:
        return f"value {short(e.value)}"
    metadata = {k: v for k, v in e.metadata.items() if k not in _WRITER_METADATA}
    return f"time_ms {ms_text(e.time_ms) if is_number(e.time_ms) else short(e.time_ms)}, metadata {short(metadata, 120)}"


def _repeats(inp: LintInput, key: str, rule: str, impact: str) -> list[Finding]:
    """One finding for every ``key`` line after the first."""
    found = inp.log.find(key)
    return [
        Finding(rule, e.line_no, key, f"{key} logged again ({_says(e)}; the first, at line {found[0].line_no}, "
                f"has {_says(found[0])})", impact)
        for e in found[1:]
    ]


def multiple_run_stops(inp: LintInput) -> list[Finding]:
    """More than one ``run_stop``: the compliance checker only warns when they are alike."""
    return _repeats(inp, "run_stop", "multiple-run-stop",
                    "the summarizer times the run to the first run_stop while the RCP checker takes the status "
                    "and convergence point of the last one; the score depends on which you believe")


def run_stop_status(inp: LintInput) -> list[Finding]:
    """``run_stop`` status that contradicts the evaluations (or is not success/aborted)."""
    out = []
    passing = first_passing_eval(inp.log, inp.target)
    for e in inp.log.find("run_stop"):
        status = e.metadata.get("status")
        if status not in ("success", "aborted"):
            out.append(Finding.at("run-stop-status", e, f"status {short(status)} is neither 'success' nor 'aborted'",
                                  "the RCP checker counts every status other than 'success' as not converged; "
                                  "the compliance checker accepts any value"))
        elif status != "success" and passing is not None:
            out.append(Finding.at("run-stop-status", e,
                                  f"status {short(status)} but the eval_accuracy at line {passing.line_no} "
                                  f"({passing.value}) passes the target {inp.target}",
                                  "a converged run is counted as not converged (infinite time)"))
        elif status == "success" and passing is None:
            out.append(Finding.at("run-stop-status", e,
                                  f"status 'success' but no eval_accuracy is above the target {inp.target}",
                                  "the log claims convergence it does not show; the compliance checker fails it"))
    return out


def run_stop_order(inp: LintInput) -> list[Finding]:
    """``run_start``/``run_stop`` missing, repeated, or out of order (lines or times)."""
    log, out = inp.log, []
    starts, stops = log.find("run_start"), log.find("run_stop")
    if not starts:
        out.append(Finding("run-stop-order", None, "run_start", "no run_start",
                           "time-to-train cannot be computed (the summarizer raises 'run_start not recorded')"))
    for e in starts[1:]:
        out.append(Finding("run-stop-order", e.line_no, "run_start", f"another run_start (the first is at line {starts[0].line_no})",
                           "the summarizer times from the last run_start before run_stop, which shortens the score"))
    if not stops:
        out.append(Finding("run-stop-order", None, "run_stop", "no run_stop",
                           "the run has no score (the summarizer raises 'run_stop not recorded'; RCP: not converged)"))
        return out
    stop = stops[0]
    evals = [e for e in log.events if e.key in EVAL_KEYS]
    if evals and evals[-1].line_no > stop.line_no:
        out.append(Finding.at("run-stop-order", stop,
                              f"run_stop is written before the eval line {evals[-1].line_no} ({evals[-1].key})",
                              "the RCP checker takes the last eval_accuracy before run_stop as the convergence point "
                              "(and crashes when there is none); later evals are ignored"))
    if starts:
        start = starts[0]
        if stop.line_no < start.line_no:
            out.append(Finding.at("run-stop-order", stop, f"run_stop is written before run_start (line {start.line_no})",
                                  "the compliance checker fails it and the summarizer pairs the wrong lines"))
        if is_number(stop.time_ms) and is_number(start.time_ms) and stop.time_ms < start.time_ms:
            out.append(Finding.at("run-stop-order", stop,
                                  f"run_stop time_ms {ms_text(stop.time_ms)} is before run_start time_ms {ms_text(start.time_ms)}",
                                  "time-to-train is negative"))
    return out


def substring_keys(inp: LintInput) -> list[Finding]:
    """Lines that contain a key the RCP checker matches as a substring, without being that key."""
    out = []
    for e in inp.log.events:
        try:
            raw = inp.lines[e.line_no - 1]
        except IndexError:
            continue
        for needle, impact in RCP_SUBSTRINGS.items():
            if e.key != needle and needle in raw:
                where = f"key {e.key!r} contains" if needle in e.key else f"the {e.key} line's value or metadata contains"
                out.append(Finding.at("substring-key", e, f"{where} '{needle}'", impact))
    return out


def duplicate_global_batch_size(inp: LintInput) -> list[Finding]:
    """``global_batch_size`` logged more than once."""
    return _repeats(inp, "global_batch_size", "duplicate-gbs",
                    "the compliance checker only warns when the values agree, but the closed checker resets its expected "
                    "eval samples_count on every such line and the RCP checker keeps the last value")


def block_pairing(inp: LintInput) -> list[Finding]:
    """``block_start``/``block_stop`` unpaired: each ``block_start`` must be closed by one
    ``block_stop`` before the next ``block_start``; a ``block_stop`` with no open block
    (a duplicate) is a finding too. The last block may stay open: training stopped during
    that step (a kill), and its published checkpoints were evaluated; that is a note."""
    out: list[Finding] = []
    impact = ("a step's block_stop bounds its weight-update time (run-stop-time) and says how far training went; "
              "a missing or repeated one hides a step or claims one that was not trained")
    open_block, last_stop = None, None
    for e in inp.log.events:
        if e.key == "block_start":
            if open_block is not None:
                out.append(Finding("block-pairing", open_block.line_no, "block_start",
                                   f"block_start at samples_count {short(samples_count_value(open_block))} has no block_stop before the "
                                   f"next block_start (line {e.line_no})", impact))
            open_block = e
        elif e.key == "block_stop":
            if open_block is None:
                again = f" (the previous block_stop is at line {last_stop.line_no})" if last_stop is not None else ""
                out.append(Finding("block-pairing", e.line_no, "block_stop",
                                   f"block_stop at samples_count {short(samples_count_value(e))} closes no block_start{again}", impact))
            open_block, last_stop = None, e
    if open_block is not None:
        inp.notes.append(f"the last block_start (line {open_block.line_no}) has no block_stop: training stopped during "
                         "that step")
    return out


RULES: list[Callable[[LintInput], list[Finding]]] = [
    run_dir_of_log,
    invalid_lines,
    long_lines,
    metadata_types,
    multiple_run_stops,
    run_stop_status,
    run_stop_order,
    evals_after_pass,
    eval_series,
    eval_at_target,
    eval_values,
    eval_pairing,
    run_stop_time,
    run_stop_step,
    eval_outside_run,
    substring_keys,
    duplicate_global_batch_size,
    eval_samples,
    eval_results,
    block_pairing,
]


def lint(inp: LintInput) -> list[Finding]:
    """Run every rule; findings sorted by line (file-level ones first). Never raises."""
    findings: list[Finding] = []
    for rule in RULES:
        findings.extend(rule(inp))
    return sorted(findings, key=lambda f: (f.line or 0))
