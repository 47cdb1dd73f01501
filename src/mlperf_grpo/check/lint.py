"""Offline-evaluation lint: what the official checkers let through but scores wrongly.

One function per rule; each takes a :class:`LintInput` and returns a list of
:class:`~mlperf_grpo.check.findings.Finding`. :func:`lint` runs them all. No rule
raises on any input: values of the wrong type are findings, not errors.

Sources: DESIGN.md ("The rule, in one paragraph" and "How the official checkers read a
log"), the 6.1.0 compliance configs ``training_6.1.0/{common,closed_qwen35_397b_grpo}.yaml``,
``rcp_checker.read_submission_file`` and ``result_summarizer._query_run_start_stop`` of
``mlperf-logging``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from mlperf_grpo import rules
from mlperf_grpo.check.evidence import stored_results
from mlperf_grpo.check.findings import Finding
from mlperf_grpo.check.shape import DEFERRED, INLINE, evaluation_mode, int_or_none, ms_text, trained_samples
from mlperf_grpo.log_values import EVAL_KEYS, checkpoint_records, is_number, logged_global_batch_size
from mlperf_grpo.mllog import LogEvent, ParsedLog, loads_line

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


def _sc(e: LogEvent) -> Any:
    return e.metadata.get("samples_count")


def _sc_int(e: LogEvent) -> int | None:
    return int_or_none(e.metadata.get("samples_count"))


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
            out.append(Finding("invalid-json", e.line_no, e.key, f"missing field(s) {', '.join(missing)}", impact))
        elif e.time_ms is None:
            out.append(Finding("invalid-json", e.line_no, e.key, f"time_ms {_short(raw.get('time_ms'))} is not a number", impact))
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
            out.append(Finding("metadata-type", e.line_no, e.key, f"metadata is {type(metadata).__name__}, not an object", impact))
            continue
        for name in METADATA_INTS:
            if name in e.metadata:
                v = e.metadata[name]
                if int_or_none(v) is None or v < 0:
                    out.append(Finding("metadata-type", e.line_no, e.key,
                                       f"metadata {name} {_short(v)} is not a non-negative integer", impact))
        if "status" in e.metadata and not isinstance(e.metadata["status"], str):
            out.append(Finding("metadata-type", e.line_no, e.key, f"metadata status {_short(e.metadata['status'])} is not a string", impact))
    return out


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (values may be huge or deeply nested)."""
    try:
        text = repr(value)
    except RecursionError:
        text = f"<{type(value).__name__} nested too deeply>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


_WRITER_METADATA = ("file", "lineno")
"""Metadata ``mlperf_logging`` adds to every line (where it was written): not what a line says."""


def _says(e: LogEvent) -> str:
    """What a line carries, for a message: its value, or (an interval event such as
    ``run_stop``, whose value is null) its time and metadata."""
    if e.value is not None:
        return f"value {_short(e.value)}"
    metadata = {k: v for k, v in e.metadata.items() if k not in _WRITER_METADATA}
    return f"time_ms {ms_text(e.time_ms) if is_number(e.time_ms) else _short(e.time_ms)}, metadata {_short(metadata, 120)}"


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
            out.append(Finding("run-stop-status", e.line_no, "run_stop", f"status {_short(status)} is neither 'success' nor 'aborted'",
                               "the RCP checker counts every status other than 'success' as not converged; "
                               "the compliance checker accepts any value"))
        elif status != "success" and passing is not None:
            out.append(Finding("run-stop-status", e.line_no, "run_stop",
                               f"status {_short(status)} but the eval_accuracy at line {passing.line_no} "
                               f"({passing.value}) passes the target {inp.target}",
                               "a converged run is counted as not converged (infinite time)"))
        elif status == "success" and passing is None:
            out.append(Finding("run-stop-status", e.line_no, "run_stop",
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
        out.append(Finding("run-stop-order", stop.line_no, "run_stop",
                           f"run_stop is written before the eval line {evals[-1].line_no} ({evals[-1].key})",
                           "the RCP checker takes the last eval_accuracy before run_stop as the convergence point "
                           "(and crashes when there is none); later evals are ignored"))
    if starts:
        start = starts[0]
        if stop.line_no < start.line_no:
            out.append(Finding("run-stop-order", stop.line_no, "run_stop", f"run_stop is written before run_start (line {start.line_no})",
                               "the compliance checker fails it and the summarizer pairs the wrong lines"))
        if is_number(stop.time_ms) and is_number(start.time_ms) and stop.time_ms < start.time_ms:
            out.append(Finding("run-stop-order", stop.line_no, "run_stop",
                               f"run_stop time_ms {ms_text(stop.time_ms)} is before run_start time_ms {ms_text(start.time_ms)}",
                               "time-to-train is negative"))
    return out


def evals_after_pass(inp: LintInput) -> list[Finding]:
    """``eval_accuracy`` lines after the first passing one."""
    passing = first_passing_eval(inp.log, inp.target)
    if passing is None:
        return []
    out = []
    for e in inp.log.find("eval_accuracy"):
        if e.line_no <= passing.line_no:
            continue
        if _sc(e) == _sc(passing):
            impact = (f"a second result for the passing checkpoint (samples_count {_short(_sc(e))}): the RCP checker's "
                      "convergence point is the same, but the log no longer says which result counts")
        else:
            impact = ("the RCP checker takes the last eval_accuracy before run_stop as samples to converge, "
                      f"so it reads {_short(_sc(e))} instead of {_short(_sc(passing))}")
        out.append(Finding("eval-after-pass", e.line_no, "eval_accuracy",
                           f"evaluation at samples_count {_short(_sc(e))} after the first passing one "
                           f"(line {passing.line_no}, samples_count {_short(_sc(passing))})", impact))
    return out


def eval_series(inp: LintInput) -> list[Finding]:
    """Evaluations not contiguous from the first eval step, or not ascending.

    Closed division: the k-th ``eval_accuracy`` (k from 0) has ``samples_count = (S0 + k) * GBS``
    with ``S0 = ceil(2.5 + 3840 / GBS)`` (closed compliance config, ``next_validation_samples``).
    Open division (``submission_division: open``, where the first eval step is free): the
    log's own series, ``samples_count = first + k * GBS`` from its first evaluation, which
    must be a whole step (a multiple of GBS). A note says which rule was applied.
    """
    gbs = logged_global_batch_size(inp.log)
    if gbs is None:
        inp.notes.append("eval series not checked: no positive integer global_batch_size in the log")
        return []
    evals = inp.log.find("eval_accuracy")
    open_division = inp.log.first_value("submission_division") == "open"
    first_sc = next((sc for e in evals if (sc := _sc_int(e)) is not None), None)
    if open_division:
        if first_sc is None:
            return _series_types(evals)
        expected, rule = first_sc, (f"open division: contiguous, one per step (+{gbs}) from the log's own first evaluation "
                                    f"at samples_count {first_sc}")
        inp.notes.append(f"eval series judged by the open-division rule (from the log's first evaluation, samples_count {first_sc}); "
                         "closed logs are judged from S0")
    else:
        s0 = rules.first_eval_step(gbs)
        expected, rule = s0 * gbs, f"closed division: samples_count = (S0 + k) * GBS from S0 = {s0}"
    impact = (f"rule applied, {rule}; a gap or reordering means a checkpoint's result is missing or the convergence "
              "point is wrong")
    out = _series_types(evals)
    previous = None
    if open_division and first_sc % gbs:
        e = next(e for e in evals if _sc_int(e) == first_sc)
        out.append(Finding("eval-series", e.line_no, "eval_accuracy",
                           f"first evaluation at samples_count {first_sc}, not a whole step at GBS {gbs}", impact))
    for e in evals:
        sc = _sc_int(e)
        if sc is None:
            continue
        step = int_or_none(e.metadata.get("step"))
        if step is not None and step * gbs != sc:
            out.append(Finding("eval-series", e.line_no, "eval_accuracy", f"step {step} does not match samples_count {sc} at GBS {gbs}",
                               "the step and samples_count name different checkpoints; the score uses samples_count"))
        if previous is not None and sc <= previous:
            out.append(Finding("eval-series", e.line_no, "eval_accuracy",
                               f"samples_count {sc} is not after the previous evaluation's {previous} (not ascending)", impact))
        elif sc != expected:
            what = "first evaluation" if previous is None else "evaluation"
            out.append(Finding("eval-series", e.line_no, "eval_accuracy",
                               f"{what} at samples_count {sc} (step {sc / gbs:g}); expected {expected} (step {expected / gbs:g})", impact))
        previous, expected = sc, max(expected, sc + gbs)
    return out


def _series_types(evals: list[LogEvent]) -> list[Finding]:
    """``eval_accuracy`` lines without ``samples_count`` (a wrong-typed one is a metadata-type finding)."""
    return [Finding("eval-series", e.line_no, "eval_accuracy", "samples_count is missing",
                    "the compliance checker fails it and the RCP checker crashes or reads no convergence point")
            for e in evals if "samples_count" not in e.metadata]


def eval_at_target(inp: LintInput) -> list[Finding]:
    """An ``eval_accuracy`` exactly at the target: not a pass (the comparison is strict)."""
    return [
        Finding("eval-at-target", e.line_no, "eval_accuracy", f"accuracy {e.value} equals the target {inp.target}; a pass needs strictly more",
                "a run stopped here did not converge; treating it as a pass understates time-to-train")
        for e in inp.log.find("eval_accuracy") if is_number(e.value) and e.value == inp.target
    ]


def eval_values(inp: LintInput) -> list[Finding]:
    """``eval_accuracy`` value null, not a number, not finite, or outside [0, 1]."""
    out = []
    for e in inp.log.find("eval_accuracy"):
        v = e.value
        if v is None:
            problem = "value is null"
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            problem = f"value {_short(v)} is not a number"
        elif not math.isfinite(v):
            problem = f"value {v} is not finite"
        elif not 0.0 <= v <= 1.0:
            problem = f"value {v} is outside [0, 1]"
        else:
            continue
        out.append(Finding("eval-value", e.line_no, "eval_accuracy", problem,
                           "the compliance check of the value fails or crashes, and the RCP checker and pass test read garbage"))
    return out


def eval_pairing(inp: LintInput) -> list[Finding]:
    """``eval_start``/``eval_stop`` unpaired, or naming another checkpoint than their ``eval_accuracy``.

    Events are paired by ``samples_count``: each evaluation is ``eval_start``, then
    ``eval_accuracy``, then ``eval_stop``, all with the same ``samples_count`` (and the
    same ``step`` where both carry one: ``step`` is optional, the reference logs it on
    ``eval_start`` only). Interleaved evaluations are allowed.
    """
    out: list[Finding] = []
    impact = "the eval interval no longer says which checkpoint was evaluated when; a result may belong to another step"
    open_: dict[Any, LogEvent] = {}
    accuracy_of: dict[Any, LogEvent] = {}
    for e in inp.log.events:
        if e.key not in EVAL_KEYS:
            continue
        sc = _sc(e)
        sc = sc if isinstance(sc, (int, float, str)) and not isinstance(sc, bool) else _short(sc)
        if e.key == "eval_start":
            if sc in open_:
                out.append(Finding("eval-pairing", open_[sc].line_no, "eval_start", f"eval_start at samples_count {sc} has no eval_stop before the next one (line {e.line_no})", impact))
            open_[sc] = e
            accuracy_of.pop(sc, None)
            continue
        start = open_.get(sc)
        if start is None:
            out.append(Finding("eval-pairing", e.line_no, e.key, f"{e.key} at samples_count {sc} has no open eval_start with that samples_count", impact))
            continue
        steps = (start.metadata.get("step"), e.metadata.get("step"))
        if None not in steps and steps[0] != steps[1]:  # a missing optional step is no mismatch
            out.append(Finding("eval-pairing", e.line_no, e.key,
                               f"step {e.metadata.get('step')!r} differs from its eval_start's step {start.metadata.get('step')!r} (line {start.line_no})", impact))
        if e.key == "eval_accuracy":
            accuracy_of[sc] = e
        else:
            if sc not in accuracy_of:
                out.append(Finding("eval-pairing", e.line_no, "eval_stop", f"eval_stop at samples_count {sc} without an eval_accuracy since its eval_start (line {start.line_no})", impact))
            del open_[sc]
            accuracy_of.pop(sc, None)
    for sc, start in open_.items():
        out.append(Finding("eval-pairing", start.line_no, "eval_start", f"eval_start at samples_count {sc} has no eval_stop", impact))
    return out


def run_stop_time(inp: LintInput) -> list[Finding]:
    """``run_stop.time_ms`` is not the weight-update time of its checkpoint.

    The checkpoint is, for ``success``, the first passing evaluation's (a run_stop naming
    another is also a ``run-stop-step`` finding); else the one at the run_stop's
    ``samples_count`` (else at the last ``eval_accuracy`` before it). Compared with ``training_info.json``'s
    ``training_step_end_time_ms`` when the run's checkpoints are still on disk, and with
    the ``block_start``/``block_stop`` of that step in the log (the weight update happens
    inside the step's block).
    """
    log, out = inp.log, []
    stops = log.find("run_stop")
    if not stops or not is_number(stops[0].time_ms):
        return out
    stop = stops[0]
    evals = [e for e in log.find("eval_accuracy") if e.line_no < stop.line_no]
    if not evals:
        aborted = stop.metadata.get("status") == "aborted" and not log.find("eval_accuracy")
        inp.notes.append("run_stop time not checked: no evaluation is logged before it"
                         + (" (training itself was aborted)" if aborted else ""))
        return out
    mode = evaluation_mode(log, inp.run_dir)
    if mode.mode == INLINE:
        inp.notes.append(f"inline evaluation ({mode.evidence}): run_stop ends the run when its evaluation ends, "
                         "evaluation time counts")
        return _inline_run_stop_time(stop, evals)
    if mode.mode != DEFERRED:
        inp.notes.append(f"run_stop time not checked: {mode.evidence}")
        return out
    passing = first_passing_eval(log, inp.target)
    sc = _sc_int(passing) if passing is not None and stop.metadata.get("status") == "success" else None
    if sc is None:
        sc = _sc_int(stop)
    if sc is None:
        before = [e for e in evals if _sc_int(e) is not None]
        sc = _sc_int(before[-1]) if before else None
    if sc is None:
        inp.notes.append("run_stop time not checked: no samples_count on run_stop and no evaluation before it")
        return out
    blocks = {(e.key, sc_): e for e in log.events if e.key in ("block_start", "block_stop") and (sc_ := _sc_int(e)) is not None}
    block_stop = blocks.get(("block_stop", sc))
    gbs = logged_global_batch_size(log)
    block_start = blocks.get(("block_start", sc - gbs)) if gbs else None
    if block_stop is not None and is_number(block_stop.time_ms) and stop.time_ms > block_stop.time_ms:
        out.append(Finding("run-stop-time", stop.line_no, "run_stop",
                           f"time_ms {ms_text(stop.time_ms)} is {ms_text(stop.time_ms - block_stop.time_ms)} ms after the block_stop at "
                           f"samples_count {sc} (line {block_stop.line_no})",
                           "the weight update ends inside the step's block; a later run_stop adds checkpoint or "
                           "evaluation time to time-to-train"))
    if block_start is not None and is_number(block_start.time_ms) and stop.time_ms < block_start.time_ms:
        out.append(Finding("run-stop-time", stop.line_no, "run_stop",
                           f"time_ms {ms_text(stop.time_ms)} is before that step's block_start (line {block_start.line_no}, "
                           f"{ms_text(block_start.time_ms)})",
                           "time-to-train is understated: the checkpoint's weights did not exist yet"))
    if block_stop is None:
        inp.notes.append(f"run_stop time not compared with the log: no block_stop at samples_count {sc} (one block spans "
                         "several steps)")
    infos = checkpoint_records(inp.run_dir)
    if sc in infos:
        path, t_update = infos[sc]
        if stop.time_ms != t_update:
            out.append(Finding("run-stop-time", stop.line_no, "run_stop",
                               f"time_ms {ms_text(stop.time_ms)} differs from the weight-update time {t_update} in {path}",
                               f"time-to-train is off by {ms_text(stop.time_ms - t_update)} ms"))
    elif inp.run_dir is not None:
        inp.notes.append(f"run_stop not compared with a weight-update time: no training_info.json at samples_count {sc} "
                         f"under {inp.run_dir / 'checkpoints'} (deleted at teardown?)")
    else:
        inp.notes.append("the backdated run_stop is not verified against the checkpoints' weight-update times: "
                         "checked without its run directory (give it with --run-dir)")
    return out


def _inline_run_stop_time(stop: LogEvent, evals: list[LogEvent]) -> list[Finding]:
    """Inline: ``run_stop`` may not be earlier than the evaluation it ends the run on."""
    last = evals[-1]
    if is_number(last.time_ms) and stop.time_ms < last.time_ms:
        return [Finding("run-stop-time", stop.line_no, "run_stop",
                        f"time_ms {ms_text(stop.time_ms)} is before the eval_accuracy at line {last.line_no} ({ms_text(last.time_ms)}) "
                        "in an inline-evaluated run", "inline evaluation is on the clock; time-to-train is understated")]
    return []


def run_stop_step(inp: LintInput) -> list[Finding]:
    """``run_stop`` naming another step than its result.

    ``success``: its ``samples_count`` (and ``step`` x GBS) must be the first passing
    evaluation's, and a step the log trained (a ``block_stop`` or ``tracked_stats`` at that
    ``samples_count``). ``aborted``: the final trained step. A missing field is not checked.
    """
    stops, out = inp.log.find("run_stop"), []
    if not stops:
        return out
    stop, gbs = stops[0], logged_global_batch_size(inp.log)
    claimed = {"samples_count": _sc_int(stop)}
    step = int_or_none(stop.metadata.get("step"))
    if step is not None and gbs is not None:
        claimed["step"] = step * gbs
    claimed = {k: v for k, v in claimed.items() if v is not None}
    trained = sorted({sc for _, sc in trained_samples(inp.log)})
    status = stop.metadata.get("status")
    passing = first_passing_eval(inp.log, inp.target)
    for field_name, sc in claimed.items():
        shown = f"{field_name} {stop.metadata.get(field_name)}"
        if status == "success" and passing is not None and _sc_int(passing) is not None and sc != _sc_int(passing):
            out.append(Finding("run-stop-step", stop.line_no, "run_stop",
                               f"{shown} is not the first passing evaluation's samples_count {_sc_int(passing)} (line {passing.line_no})",
                               "the run_stop names another checkpoint than the one that converged: a wrong score"))
        if status == "success" and trained and sc not in trained:
            out.append(Finding("run-stop-step", stop.line_no, "run_stop",
                               f"{shown} is a step the log never trained (no block_stop or tracked_stats at samples_count {sc})",
                               "the converged checkpoint does not exist in this run: a wrong score"))
        if status == "aborted" and trained and sc != trained[-1]:
            out.append(Finding("run-stop-step", stop.line_no, "run_stop",
                               f"{shown} is not the final trained step (samples_count {trained[-1]})",
                               "an aborted run ends at its final checkpoint; an earlier one shortens the run"))
    return out


def eval_outside_run(inp: LintInput) -> list[Finding]:
    """Evaluation events before ``run_start`` or before ``init_stop``."""
    out = []
    for key in ("run_start", "init_stop"):
        found = inp.log.find(key)
        if not found:
            continue
        out += [Finding("eval-outside-run", e.line_no, e.key, f"{e.key} before {key} (line {found[0].line_no})",
                        "an evaluation outside the timed run: its result cannot count, and the lint cannot place it")
                for e in inp.log.events if e.key in EVAL_KEYS and e.line_no < found[0].line_no]
    unique = {(f.line, f.key): f for f in out}  # before both: one finding, naming init_stop
    return list(unique.values())


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
                out.append(Finding("substring-key", e.line_no, e.key, f"{where} '{needle}'", impact))
    return out


def duplicate_global_batch_size(inp: LintInput) -> list[Finding]:
    """``global_batch_size`` logged more than once."""
    return _repeats(inp, "global_batch_size", "duplicate-gbs",
                    "the compliance checker only warns when the values agree, but the closed checker resets its expected "
                    "eval samples_count on every such line and the RCP checker keeps the last value")


def eval_samples(inp: LintInput) -> list[Finding]:
    """``eval_samples`` differs from the number of validation tasks evaluated.

    The number evaluated is read from ``<run>/eval/step_N.jsonl`` (a header line, then
    one line per task) when the run directory is known.
    """
    logged = inp.log.find("eval_samples")
    eval_dir = inp.run_dir / "eval" if inp.run_dir else None
    if not logged or eval_dir is None or not eval_dir.is_dir():
        if inp.run_dir is not None:
            inp.notes.append("eval_samples not compared with the tasks evaluated: no eval/ results in the run directory")
        return []
    out = []
    for path in sorted(eval_dir.glob("step_*.jsonl")):
        try:
            lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            continue
        tasks = max(len(lines) - 1, 0)
        if tasks != logged[0].value:
            out.append(Finding("eval-samples", logged[0].line_no, "eval_samples",
                               f"eval_samples is {_short(logged[0].value)} but {path} has {tasks} tasks",
                               "the accuracy was computed on another validation set than the one the log declares"))
    return out


def eval_results(inp: LintInput) -> list[Finding]:
    """``eval_accuracy`` other than pass@k of the run directory's ``eval/step_N.jsonl``.

    Each logged evaluation (step = ``samples_count`` / GBS) whose results file is in the
    run directory must log exactly the accuracy those rewards give: the evaluator logs
    :func:`mlperf_grpo.rules.pass_at_k` of them, the same division of two integers, kept
    exactly by JSON. A results file that cannot give one is a finding too; a logged
    evaluation without a file is a note (the check could not be made).
    """
    results, gbs = stored_results(inp.run_dir), logged_global_batch_size(inp.log)
    if inp.run_dir is None or gbs is None:
        return []
    out, unmatched = [], []
    impact = ("the log's result is not what the stored evaluation gives: the convergence point and time-to-train "
              "may come from an edited log or another run")
    for e in inp.log.find("eval_accuracy"):
        sc = _sc_int(e)
        if sc is None or sc % gbs or not is_number(e.value):
            continue  # eval-series / metadata-type / eval-value findings
        stored = results.get(sc // gbs)
        if stored is None:
            unmatched.append(sc // gbs)
        elif stored.accuracy is None:
            out.append(Finding("eval-results", e.line_no, "eval_accuracy",
                               f"the accuracy of step {sc // gbs} cannot be recomputed: {stored.path}: {stored.problem}", impact))
        elif e.value != stored.accuracy:
            out.append(Finding("eval-results", e.line_no, "eval_accuracy",
                               f"eval_accuracy {e.value!r} of step {sc // gbs} is not {stored.accuracy!r}, pass@k of the "
                               f"{stored.tasks} tasks' rewards in {stored.path}", impact))
    if unmatched:
        inp.notes.append(f"eval_accuracy not recomputed for step(s) {', '.join(map(str, unmatched))}: no "
                         f"eval/step_N.jsonl for them under {inp.run_dir}")
    return out


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
                                   f"block_start at samples_count {_short(_sc(open_block))} has no block_stop before the "
                                   f"next block_start (line {e.line_no})", impact))
            open_block = e
        elif e.key == "block_stop":
            if open_block is None:
                again = f" (the previous block_stop is at line {last_stop.line_no})" if last_stop is not None else ""
                out.append(Finding("block-pairing", e.line_no, "block_stop",
                                   f"block_stop at samples_count {_short(_sc(e))} closes no block_start{again}", impact))
            open_block, last_stop = None, e
    if open_block is not None:
        inp.notes.append(f"the last block_start (line {open_block.line_no}) has no block_stop: training stopped during "
                         "that step")
    return out


RULES: list[Callable[[LintInput], list[Finding]]] = [
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
