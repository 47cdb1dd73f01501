"""``mlperf-grpo merge``: append an evaluator's own log to the training log.

For setups where the offline evaluator logs to its own file (post-processing a log is
allowed). The output is the training log, byte for byte, followed by the evaluator's
``eval_start``/``eval_accuracy``/``eval_stop`` lines grouped per checkpoint in ascending
``samples_count`` (the order the closed checker needs), then its ``run_stop``. Time stamps
are kept as written and nothing is re-sorted by time: a backdated ``run_stop`` stays last.

Refused (:class:`MergeError`, nothing written): the same file given as both logs; an
``output`` that exists and is neither the training log (merging in place) nor already the
merged result; an ``output`` whose folder does not exist; two ``run_stop``s in the result,
or none (an evaluation log without ``run_stop`` is unfinished); evaluations after the
training log's own ``run_stop``; evaluations at a ``samples_count`` that is not a whole
step at the training log's global batch size; a gap or overlap in the evaluation series
(closed: from S0; open: from the first evaluation); two different evaluations of one
checkpoint; a successful ``run_stop`` that does not name the first passing checkpoint;
invalid JSON in the evaluator's log; and an evaluation log that cannot be this training's
(:func:`tie_to_training`): an evaluation of a step the training log never trained or
begun before that step was trained, or a ``run_stop`` that is not a weight-update time of
its step (the first passing one; aborted: the step it names) in this training log. Evaluations after the first passing one are dropped (the RCP checker
would take the last one as the convergence point) and reported.

Idempotent: merging again, or merging the output with the same evaluator log, gives the
same bytes (events already in the training log are skipped). Written atomically.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mlperf_grpo import rules
from mlperf_grpo.logs.mllog import PREFIX, LogEvent, ParsedLog, loads_line, parse_log_text
from mlperf_grpo.logs.values import (
    EVAL_KEYS,
    UnreadableLog,
    checkpoint_records,
    find_run_dir,
    is_int,
    is_number,
    load_log_text,
    logged_global_batch_size,
    ms_text,
    samples_count_of,
    step_window,
)

MERGED_KEYS = (*EVAL_KEYS, "run_stop")
_KEY_ORDER = {k: i for i, k in enumerate(MERGED_KEYS)}


class MergeError(ValueError):
    """The logs cannot be merged into a correct log; the message says why (one line)."""


@dataclass
class MergeResult:
    """What :func:`merge_logs` did.

    ``appended``: lines added after the training log; ``already_present``: evaluator
    events found in the training log already; ``ignored_keys``: evaluator lines with
    other keys (not copied); ``dropped_steps``: evaluations after the first pass, not
    copied; ``changed``: False when the output already had exactly these bytes;
    ``tie``: how the evaluation log was tied to the training (:func:`tie_to_training`).
    """

    output: Path
    appended: int = 0
    already_present: int = 0
    ignored_keys: list[str] = field(default_factory=list)
    dropped_steps: list[int] = field(default_factory=list)
    changed: bool = True
    tie: str = ""


def _read(path: Path, role: str) -> tuple[str, ParsedLog, list[str]]:
    try:
        text = load_log_text(path)
    except UnreadableLog as err:
        raise MergeError(f"{role} log {err}") from None
    return text, parse_log_text(text), text.splitlines()


def _canonical(lines: list[str], e: LogEvent) -> str:
    line = lines[e.line_no - 1]
    try:
        return json.dumps(loads_line(line), sort_keys=True)
    except (ValueError, RecursionError):
        return _mllog_part(lines, e)


def _mllog_part(lines: list[str], e: LogEvent) -> str:
    line = lines[e.line_no - 1]
    return line[line.find(PREFIX):].rstrip()


def _passes(e: LogEvent) -> bool:
    return is_number(e.value) and rules.is_passing(e.value)


def _refuse_another_run(train, train_lines, ev, ev_lines, eval_log: Path) -> None:
    """The evaluation log must be of the training log's run: it may repeat the training
    log's own ``init_start``/``run_start`` lines (a merged log merged again) but hold no
    other, and no evaluation or ``run_stop`` of it may be timed before the run started.

    Raises:
        MergeError: one line naming the line of the evaluation log that shows another run.
    """
    own = {_canonical(train_lines, e) for e in train.events if e.key in ("init_start", "run_start")}
    for e in ev.events:
        if e.key in ("init_start", "run_start") and _canonical(ev_lines, e) not in own:
            raise MergeError(f"evaluation log {eval_log} line {e.line_no}: {'an' if e.key[0] == 'i' else 'a'} {e.key} of another run; "
                             "give the log of this run's evaluator as --eval")
    run_start_ms = train.find("run_start")[0].time_ms
    for e in ev.events:
        if e.key in MERGED_KEYS and isinstance(e.time_ms, (int, float)) and isinstance(run_start_ms, (int, float)) \
                and e.time_ms < run_start_ms:
            raise MergeError(f"evaluation log {eval_log} line {e.line_no}: {e.key} at {e.time_ms} ms is before the "
                             f"training log's run_start ({run_start_ms} ms); the logs are of different runs")


def _swapped_hint(train: ParsedLog, ev: ParsedLog, train_log: Path, eval_log: Path) -> str:
    """When the two logs look given the wrong way round (``--train`` holds evaluation
    lines and no ``run_start``, ``--eval`` holds the ``run_start``): which is which."""
    if not ev.find("run_start") or not any(e.key in MERGED_KEYS for e in train.events):
        return ""
    return (f"; it holds an evaluator's lines and {eval_log} holds the training (its run_start): the training log "
            f"is {eval_log} and the evaluator's is {train_log}, so swap them: --train {eval_log} --eval {train_log}")


def tie_to_training(train_log: Path, train: ParsedLog, eval_log: Path, groups: dict[int, list[LogEvent]],
                    stops: list[LogEvent], first_pass: int | None, gbs: int) -> str:
    """Refuse an evaluation log that cannot be of this training; say how it is tied.

    Every evaluation must be of a step the training log trained, begun after that step
    ended (its checkpoint existed). ``run_stop`` carries a checkpoint's weight-update time
    (DESIGN.md, "The rule"): of the first passing step (success) or of the step it names
    (aborted). The strongest tie available is used: that step's
    ``training_step_end_time_ms`` in ``<run>/checkpoints/step_N/training_info.json`` next to
    the training log (equal, to the ms); else the training log's own window for the
    step (:func:`step_window`: after the previous step ended, no later than its own
    ``block_stop``).

    Returns:
        One sentence naming the tie used ("" when there is no new ``run_stop``).
    Raises:
        MergeError: one line naming the evaluation log's line and the training's values.
    """
    trained = {sc for e in train.events if e.key in ("block_stop", "tracked_stats") and (sc := samples_count_of(e)) is not None}
    last = max(trained, default=0)
    for sc, events in sorted(groups.items()):
        if sc > last:
            raise MergeError(f"evaluation log {eval_log} line {events[0].line_no}: an evaluation of step {sc // gbs}, but "
                             f"the training log trained to step {last // gbs}; the logs are of different runs")
        start, _ = step_window(train, sc // gbs, gbs)
        begun = min((e for e in events if is_number(e.time_ms)), key=lambda e: e.time_ms, default=None)
        if start is not None and begun is not None and begun.time_ms < start.time_ms:
            raise MergeError(f"evaluation log {eval_log} line {begun.line_no}: the evaluation of step {sc // gbs} began at "
                             f"{ms_text(begun.time_ms)} ms, before that step was trained (after {ms_text(start.time_ms)} ms, "
                             f"training log line {start.line_no}); the logs are of different runs")
    if not stops:
        return ""
    stop = stops[0]
    sc = first_pass if stop.metadata.get("status") == "success" else samples_count_of(stop)
    if sc is None or not is_number(stop.time_ms):
        return "none: the run_stop names no step"
    step = sc // gbs
    infos = checkpoint_records(find_run_dir(train_log))
    if sc in infos:
        path, t_update = infos[sc]
        if stop.time_ms != t_update:
            raise MergeError(f"evaluation log {eval_log} line {stop.line_no}: run_stop at {ms_text(stop.time_ms)} ms is not "
                             f"step {step}'s weight-update time {t_update} ms ({path}); the evaluation is of another run")
        return f"run_stop equals step {step}'s weight-update time in {path}"
    lo, hi = step_window(train, step, gbs)
    if hi is None:
        raise MergeError(f"evaluation log {eval_log} line {stop.line_no}: run_stop names step {step}, which the training log "
                         "never trained; the logs are of different runs")
    if (lo is not None and stop.time_ms < lo.time_ms) or stop.time_ms > hi.time_ms:
        after = f"after {ms_text(lo.time_ms)} ms (line {lo.line_no}) and " if lo is not None else ""
        raise MergeError(f"evaluation log {eval_log} line {stop.line_no}: run_stop at {ms_text(stop.time_ms)} ms is not a "
                         f"weight-update time of step {step} in the training log ({after}no later than {ms_text(hi.time_ms)} "
                         f"ms, its {hi.key} at line {hi.line_no}); the evaluation is of another run")
    lines = f"lines {lo.line_no}-{hi.line_no}" if lo is not None else f"line {hi.line_no}"
    return f"run_stop lies within step {step}'s training in the training log ({lines}; no checkpoint records beside it)"


def merge_logs(train_log: Path, eval_log: Path, output: Path) -> MergeResult:
    """Merge ``eval_log`` into ``train_log`` and write ``output`` atomically.

    ``output`` may be ``train_log`` itself (merging in place).
    Raises:
        MergeError: see the module docstring; also an unreadable input.
        OSError: the output cannot be written.
    """
    train_log, eval_log, output = Path(train_log), Path(eval_log), Path(output)
    result = MergeResult(output=output)
    if train_log.resolve() == eval_log.resolve():
        raise MergeError(f"--train and --eval are the same file ({train_log}); give the evaluator's own log as --eval")
    check_output_dir(output)
    train_text, train, train_lines = _read(train_log, "training")
    _, ev, ev_lines = _read(eval_log, "evaluation")
    gbs = _check_inputs(train, ev, train_log, eval_log)
    _refuse_another_run(train, train_lines, ev, ev_lines, eval_log)
    groups, new_stops = _new_evaluations(train, train_lines, ev, ev_lines, eval_log, gbs, result)
    _check_series(train, ev, groups, train_log, eval_log, gbs)
    first_pass, kept = _up_to_first_pass(train, groups, gbs, result)
    _check_run_stops(train, new_stops, kept, first_pass, train_log, eval_log)
    result.tie = tie_to_training(train_log, train, eval_log, {g[0].metadata["samples_count"]: g for g in kept},
                                 new_stops, first_pass, gbs)
    new_lines = [_mllog_part(ev_lines, e) for group in kept for e in group] + [_mllog_part(ev_lines, e) for e in new_stops]
    result.appended = len(new_lines)
    body = train_text if train_text.endswith("\n") else train_text + "\n"
    result.changed = _write_output(output, train_log, (body + "".join(line + "\n" for line in new_lines)).encode())
    return result


def _check_inputs(train: ParsedLog, ev: ParsedLog, train_log: Path, eval_log: Path) -> int:
    """The training log's global batch size, once both logs are usable as such."""
    if ev.bad_lines:
        line_no, reason = ev.bad_lines[0]
        raise MergeError(f"evaluation log {eval_log} line {line_no}: {reason}")
    if not train.find("run_start"):
        raise MergeError(f"training log {train_log} has no run_start" + _swapped_hint(train, ev, train_log, eval_log))
    gbs = logged_global_batch_size(train)
    if gbs is None:
        raise MergeError(f"training log {train_log} has no positive integer global_batch_size")
    return gbs


def _new_evaluations(train: ParsedLog, train_lines: list[str], ev: ParsedLog, ev_lines: list[str], eval_log: Path,
                     gbs: int, result: MergeResult) -> tuple[dict[int, list[LogEvent]], list[LogEvent]]:
    """The evaluator's events not yet in the training log: evaluations by samples_count
    (each start, accuracy, stop) and ``run_stop`` lines; counts what is skipped in ``result``."""
    present = {_canonical(train_lines, e) for e in train.events if e.key in MERGED_KEYS}
    groups: dict[int, list[LogEvent]] = {}
    new_stops: list[LogEvent] = []
    for e in ev.events:
        if e.key not in MERGED_KEYS:
            result.ignored_keys.append(e.key)
        elif _canonical(ev_lines, e) in present:
            result.already_present += 1
        elif e.key == "run_stop":
            new_stops.append(e)
        elif not is_int(sc := e.metadata.get("samples_count")):
            raise MergeError(f"evaluation log {eval_log} line {e.line_no}: {e.key} has no integer samples_count")
        else:
            groups.setdefault(sc, []).append(e)
    for sc, events in groups.items():
        accuracies = [e for e in events if e.key == "eval_accuracy"]
        if len(accuracies) != 1 or len(events) > 3:
            raise MergeError(f"evaluation log {eval_log}: {len(accuracies)} eval_accuracy and {len(events)} eval lines "
                             f"at samples_count {sc} (step {sc // gbs}); expected one evaluation")
        events.sort(key=lambda e: _KEY_ORDER[e.key])  # stable: start, accuracy, stop
    return groups, new_stops


def _check_series(train: ParsedLog, ev: ParsedLog, groups: dict[int, list[LogEvent]], train_log: Path, eval_log: Path,
                  gbs: int) -> None:
    """The evaluations, the training log's and the new ones, are whole steps, contiguous
    from the first eval step (open division: from the first evaluation)."""
    other = [sc for sc in sorted(groups) if sc % gbs]
    if other:
        ev_gbs = logged_global_batch_size(ev)
        hint = f" (the evaluation log declares global_batch_size {ev_gbs})" if ev_gbs not in (None, gbs) else ""
        raise MergeError(f"evaluation log {eval_log}: samples_count {other[0]} is not a whole step at the training log's "
                         f"global batch size {gbs}{hint}; the logs are of different runs")
    existing = train.find("eval_accuracy")
    series = [e.metadata.get("samples_count") for e in existing] + sorted(groups)
    s0_samples = rules.first_eval_step(gbs) * gbs
    if train.first_value("submission_division") == "open" and series and is_int(series[0]):
        s0_samples = series[0]  # open division: the first eval step is free; contiguous from there
    expected = list(range(s0_samples, s0_samples + gbs * len(series), gbs))
    if series != expected:
        wrong = next(i for i, (a, b) in enumerate(zip(series, expected)) if a != b)
        if wrong < len(existing):
            raise MergeError(f"training log {train_log}: its evaluations are not contiguous from samples_count {s0_samples}")
        raise MergeError(f"the evaluations would have a gap or an overlap: expected samples_count {expected[wrong]} "
                         f"(step {expected[wrong] // gbs}), next available is {series[wrong]} (step {series[wrong] // gbs})")


def _up_to_first_pass(train: ParsedLog, groups: dict[int, list[LogEvent]], gbs: int,
                      result: MergeResult) -> tuple[int | None, list[list[LogEvent]]]:
    """The first passing samples_count and the new evaluations up to it (those after it
    are dropped: the RCP checker would take the last one as the convergence point)."""
    first_pass = next((e.metadata.get("samples_count") for e in train.find("eval_accuracy") if _passes(e)), None)
    kept: list[list[LogEvent]] = []
    for sc in sorted(groups):
        if first_pass is not None:
            result.dropped_steps.append(sc // gbs)
            continue
        kept.append(groups[sc])
        if any(_passes(e) for e in groups[sc] if e.key == "eval_accuracy"):
            first_pass = sc
    return first_pass, kept


def _check_run_stops(train: ParsedLog, new_stops: list[LogEvent], kept: list[list[LogEvent]], first_pass: int | None,
                     train_log: Path, eval_log: Path) -> None:
    """Exactly one ``run_stop`` in the result, after every evaluation; a successful one
    names the first passing evaluation."""
    old_stops = train.find("run_stop")
    if len(old_stops) + len(new_stops) > 1:
        where = [f"{train_log}:{e.line_no}" for e in old_stops] + [f"{eval_log}:{e.line_no}" for e in new_stops]
        raise MergeError(f"the result would have {len(where)} run_stops ({', '.join(where)}); a log needs exactly one")
    if not old_stops and not new_stops:
        raise MergeError(f"evaluation log {eval_log} has no run_stop: the evaluation is unfinished (or its run_stop was "
                         "lost); finish it (mlperf-grpo evaluate writes run_stop) before merging")
    if old_stops and kept:
        raise MergeError(f"training log {train_log} already has a run_stop (line {old_stops[0].line_no}); the evaluations "
                         "would come after it and the RCP checker would find no convergence point")
    for stop in new_stops:
        sc = stop.metadata.get("samples_count")
        if stop.metadata.get("status") == "success" and is_int(sc) and sc != first_pass:
            raise MergeError(f"evaluation log {eval_log} line {stop.line_no}: run_stop at samples_count {sc}, but the first "
                             f"passing evaluation is at {first_pass}")


def _write_output(output: Path, train_log: Path, data: bytes) -> bool:
    """Write ``data`` to ``output`` atomically; False when it already holds exactly it.

    Raises:
        MergeError: ``output`` exists and is neither the training log nor this result.
        OutputWriteError: the existing output cannot be read, or the new one written.
    """
    try:
        existing_output = output.read_bytes()
    except FileNotFoundError:
        existing_output = None
    except OSError as err:
        raise OutputWriteError(f"cannot read the existing output {output}: {err.strerror}") from None
    if existing_output == data:
        return False
    if existing_output is not None and output.resolve() != train_log.resolve():
        raise MergeError(f"output {output} exists and is not this merge's result; choose a new file (or pass the "
                         "training log itself as --output to merge in place)")
    write_atomic(output, data)
    return True


def check_output_dir(path: Path) -> None:
    """Refuse an output whose folder does not exist (nothing is created silently).

    Raises:
        OutputWriteError: one line naming the missing folder.
    """
    directory = Path(path).parent if str(Path(path).parent) else Path(".")
    if not directory.is_dir():
        raise OutputWriteError(f"cannot write {path}: folder {directory} does not exist; create it first")


class OutputWriteError(OSError):
    """An output file cannot be written; the message names it."""


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file next to ``path``, fsync, then rename over ``path``.

    Raises:
        OutputWriteError: the folder does not exist (it is not created), is not writable, or
            the disk is full (the message names ``path``); ``path`` is untouched.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    check_output_dir(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as err:
        raise OutputWriteError(f"cannot write {path}: {err.strerror}") from None
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
