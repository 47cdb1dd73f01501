"""Offline-evaluation lint rules of the evaluation series (after the pass, contiguity,
values, pairing, samples, stored results) and of the ``run_stop``'s time and step: one
function per rule, as in :mod:`mlperf_grpo.logs.check.lint`, which runs them all.

Sources: as :mod:`mlperf_grpo.logs.check.lint`.
"""

from __future__ import annotations

import math
from typing import Any

from mlperf_grpo import rules
from mlperf_grpo.logs.check.evidence import result_files, results_dirs, stored_results
from mlperf_grpo.logs.check.findings import Finding
from mlperf_grpo.logs.check.lint_input import LintInput, first_passing_eval, samples_count_value, short
from mlperf_grpo.logs.check.shape import DEFERRED, INLINE, evaluation_mode, trained_samples
from mlperf_grpo.logs.mllog import LogEvent
from mlperf_grpo.logs.values import (
    EVAL_KEYS,
    checkpoint_records,
    int_or_none,
    is_number,
    logged_global_batch_size,
    ms_text,
    samples_count_of,
)


def evals_after_pass(inp: LintInput) -> list[Finding]:
    """``eval_accuracy`` lines after the first passing one."""
    passing = first_passing_eval(inp.log, inp.target)
    if passing is None:
        return []
    out = []
    for e in inp.log.find("eval_accuracy"):
        if e.line_no <= passing.line_no:
            continue
        if samples_count_value(e) == samples_count_value(passing):
            impact = (f"a second result for the passing checkpoint (samples_count {short(samples_count_value(e))}): the RCP checker's "
                      "convergence point is the same, but the log no longer says which result counts")
        else:
            impact = ("the RCP checker takes the last eval_accuracy before run_stop as samples to converge, "
                      f"so it reads {short(samples_count_value(e))} instead of {short(samples_count_value(passing))}")
        out.append(Finding.at("eval-after-pass", e,
                              f"evaluation at samples_count {short(samples_count_value(e))} after the first passing one "
                              f"(line {passing.line_no}, samples_count {short(samples_count_value(passing))})", impact))
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
    first_sc = next((sc for e in evals if (sc := samples_count_of(e)) is not None), None)
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
        e = next(e for e in evals if samples_count_of(e) == first_sc)
        out.append(Finding.at("eval-series", e,
                              f"first evaluation at samples_count {first_sc}, not a whole step at GBS {gbs}", impact))
    for e in evals:
        sc = samples_count_of(e)
        if sc is None:
            continue
        step = int_or_none(e.metadata.get("step"))
        if step is not None and step * gbs != sc:
            out.append(Finding.at("eval-series", e, f"step {step} does not match samples_count {sc} at GBS {gbs}",
                                  "the step and samples_count name different checkpoints; the score uses samples_count"))
        if previous is not None and sc <= previous:
            out.append(Finding.at("eval-series", e,
                                  f"samples_count {sc} is not after the previous evaluation's {previous} (not ascending)", impact))
        elif sc != expected:
            what = "first evaluation" if previous is None else "evaluation"
            out.append(Finding.at("eval-series", e,
                                  f"{what} at samples_count {sc} (step {sc / gbs:g}); expected {expected} (step {expected / gbs:g})", impact))
        previous, expected = sc, max(expected, sc + gbs)
    return out


def _series_types(evals: list[LogEvent]) -> list[Finding]:
    """``eval_accuracy`` lines without ``samples_count`` (a wrong-typed one is a metadata-type finding)."""
    return [Finding.at("eval-series", e, "samples_count is missing",
                       "the compliance checker fails it and the RCP checker crashes or reads no convergence point")
            for e in evals if "samples_count" not in e.metadata]


def eval_at_target(inp: LintInput) -> list[Finding]:
    """An ``eval_accuracy`` exactly at the target: not a pass (the comparison is strict)."""
    return [
        Finding.at("eval-at-target", e, f"accuracy {e.value} equals the target {inp.target}; a pass needs strictly more",
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
            problem = f"value {short(v)} is not a number"
        elif not math.isfinite(v):
            problem = f"value {v} is not finite"
        elif not 0.0 <= v <= 1.0:
            problem = f"value {v} is outside [0, 1]"
        else:
            continue
        out.append(Finding.at("eval-value", e, problem,
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
        sc = samples_count_value(e)
        sc = sc if isinstance(sc, (int, float, str)) and not isinstance(sc, bool) else short(sc)
        if e.key == "eval_start":
            if sc in open_:
                out.append(Finding("eval-pairing", open_[sc].line_no, "eval_start", f"eval_start at samples_count {sc} has no eval_stop before the next one (line {e.line_no})", impact))
            open_[sc] = e
            accuracy_of.pop(sc, None)
            continue
        start = open_.get(sc)
        if start is None:
            out.append(Finding.at("eval-pairing", e, f"{e.key} at samples_count {sc} has no open eval_start with that samples_count", impact))
            continue
        steps = (start.metadata.get("step"), e.metadata.get("step"))
        if None not in steps and steps[0] != steps[1]:  # a missing optional step is no mismatch
            out.append(Finding.at("eval-pairing", e,
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
    sc = samples_count_of(passing) if passing is not None and stop.metadata.get("status") == "success" else None
    if sc is None:
        sc = samples_count_of(stop)
    if sc is None:
        before = [e for e in evals if samples_count_of(e) is not None]
        sc = samples_count_of(before[-1]) if before else None
    if sc is None:
        inp.notes.append("run_stop time not checked: no samples_count on run_stop and no evaluation before it")
        return out
    blocks = {(e.key, sc_): e for e in log.events if e.key in ("block_start", "block_stop") and (sc_ := samples_count_of(e)) is not None}
    block_stop = blocks.get(("block_stop", sc))
    gbs = logged_global_batch_size(log)
    block_start = blocks.get(("block_start", sc - gbs)) if gbs else None
    if block_stop is not None and is_number(block_stop.time_ms) and stop.time_ms > block_stop.time_ms:
        out.append(Finding.at("run-stop-time", stop,
                              f"time_ms {ms_text(stop.time_ms)} is {ms_text(stop.time_ms - block_stop.time_ms)} ms after the block_stop at "
                              f"samples_count {sc} (line {block_stop.line_no})",
                              "the weight update ends inside the step's block; a later run_stop adds checkpoint or "
                              "evaluation time to time-to-train"))
    if block_start is not None and is_number(block_start.time_ms) and stop.time_ms < block_start.time_ms:
        out.append(Finding.at("run-stop-time", stop,
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
            out.append(Finding.at("run-stop-time", stop,
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
        return [Finding.at("run-stop-time", stop,
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
    claimed = {"samples_count": samples_count_of(stop)}
    step = int_or_none(stop.metadata.get("step"))
    if step is not None and gbs is not None:
        claimed["step"] = step * gbs
    claimed = {k: v for k, v in claimed.items() if v is not None}
    trained = sorted({sc for _, sc in trained_samples(inp.log)})
    status = stop.metadata.get("status")
    passing = first_passing_eval(inp.log, inp.target)
    passing_sc = samples_count_of(passing) if passing is not None else None
    for field_name, sc in claimed.items():
        shown = f"{field_name} {stop.metadata.get(field_name)}"
        wrong: list[tuple[str, str]] = []  # (problem, impact)
        if status == "success":
            if passing_sc is not None and sc != passing_sc:
                wrong.append((f"{shown} is not the first passing evaluation's samples_count {passing_sc} (line {passing.line_no})",
                              "the run_stop names another checkpoint than the one that converged: a wrong score"))
            if trained and sc not in trained:
                wrong.append((f"{shown} is a step the log never trained (no block_stop or tracked_stats at samples_count {sc})",
                              "the converged checkpoint does not exist in this run: a wrong score"))
        elif status == "aborted" and trained and sc != trained[-1]:
            wrong.append((f"{shown} is not the final trained step (samples_count {trained[-1]})",
                          "an aborted run ends at its final checkpoint; an earlier one shortens the run"))
        out += [Finding.at("run-stop-step", stop, problem, impact) for problem, impact in wrong]
    return out


def eval_outside_run(inp: LintInput) -> list[Finding]:
    """Evaluation events before ``run_start`` or before ``init_stop``."""
    out = []
    for key in ("run_start", "init_stop"):
        found = inp.log.find(key)
        if not found:
            continue
        out += [Finding.at("eval-outside-run", e, f"{e.key} before {key} (line {found[0].line_no})",
                           "an evaluation outside the timed run: its result cannot count, and the lint cannot place it")
                for e in inp.log.events if e.key in EVAL_KEYS and e.line_no < found[0].line_no]
    unique = {(f.line, f.key): f for f in out}  # before both: one finding, naming init_stop
    return list(unique.values())


def eval_samples(inp: LintInput) -> list[Finding]:
    """``eval_samples`` differs from the number of validation tasks evaluated.

    The number evaluated is read from ``<run>/eval/step_N.jsonl`` (a header line, then
    one line per task; :func:`~mlperf_grpo.logs.check.evidence.results_dirs`) when the run
    directory is known.
    """
    logged = inp.log.find("eval_samples")
    files = [path for paths in result_files(inp.run_dir).values() for path in paths]
    if not logged or not files:
        if inp.run_dir is not None and not files:
            inp.notes.append("eval_samples not compared with the tasks evaluated: no step_N.jsonl in "
                             f"{inp.run_dir / 'eval'} or {inp.run_dir / 'checkpoints' / 'eval'}")
        return []
    out = []
    for path in files:
        try:
            lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            continue
        tasks = max(len(lines) - 1, 0)
        if tasks != logged[0].value:
            out.append(Finding("eval-samples", logged[0].line_no, "eval_samples",
                               f"eval_samples is {short(logged[0].value)} but {path} has {tasks} tasks",
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
        sc = samples_count_of(e)
        if sc is None or sc % gbs or not is_number(e.value):
            continue  # eval-series / metadata-type / eval-value findings
        stored = results.get(sc // gbs)
        if stored is None:
            unmatched.append(sc // gbs)
        elif stored.accuracy is None:
            out.append(Finding.at("eval-results", e,
                                  f"the accuracy of step {sc // gbs} cannot be recomputed: {stored.path}: {stored.problem}", impact))
        elif e.value != stored.accuracy:
            out.append(Finding.at("eval-results", e,
                                  f"eval_accuracy {e.value!r} of step {sc // gbs} is not {stored.accuracy!r}, pass@k of the "
                                  f"{stored.tasks} tasks' rewards in {stored.path}", impact))
    if unmatched:
        looked = " or ".join(map(str, results_dirs(inp.run_dir) or [inp.run_dir / "eval"]))
        inp.notes.append(f"eval_accuracy not recomputed for step(s) {', '.join(map(str, unmatched))}: no "
                         f"step_N.jsonl for them in {looked}")
    return out
