"""``mlperf-grpo evaluate --checkpoints DIR --mllog LOG --config C``: a series another
trainer wrote, through the same lifecycle as our own runs (:func:`offline.evaluate_series`:
lock, resume, series checks, step-order commits, one backdated ``run_stop``, teardown).

``DIR`` holds the series (``checkpoint/foreign_layouts.py`` describes the layouts) and, written by
the evaluator, ``.lock``, ``eval/step_N.jsonl``, ``eval/summary.json`` and
``eval/source.json`` (the format and what it could not check). Teardown keeps another
trainer's series (NeMo-RL, a manifest's directories); of our own layout it deletes only the
files our writer made in each ``step_N/``, never ``DIR`` itself or anything else in it.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from mlperf_grpo.checkpoint import foreign_layouts as foreign
from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.config.rundir import RunDir, RunDirError
from mlperf_grpo.evaluate.foreign_source import SOURCE_FILE, OursAt, build_source
from mlperf_grpo.evaluate.offline import EvalOutcome, SeriesRequest, evaluate_series
from mlperf_grpo.evaluate.series import EvaluationError
from mlperf_grpo.logs.mllog import read_log

EVAL_LOG_KEYS = {"eval_start", "eval_accuracy", "eval_stop", "run_stop"}
"""What this evaluator writes to an ``--eval-log``."""


def check_eval_log(eval_log: Path, root: Path) -> None:
    """Refuse an ``--eval-log`` that this evaluator of the series in ``root`` did not
    write: its directory must exist, and an existing non-empty file must hold only
    evaluation and ``run_stop`` events whose steps have results in ``root/eval/``
    (``step_N.jsonl``). Otherwise another run's evaluations would be taken for this
    series' and its checkpoints deleted unevaluated.

    Raises:
        EvaluationError: the path is not usable (one line naming the fix).
    """
    if not eval_log.parent.is_dir():
        raise EvaluationError(f"--eval-log {eval_log}: directory {eval_log.parent} does not exist; create it or give another path")
    if not eval_log.is_file() or not eval_log.read_bytes().strip():
        return
    log = read_log(eval_log)
    foreign_keys = sorted({e.key for e in log.events} - EVAL_LOG_KEYS)
    steps = [e.metadata.get("step") for e in log.find("eval_accuracy")]
    unknown = [st for st in steps if not (RunDir(root).eval_dir / f"step_{st}.jsonl").is_file()]
    if log.bad_lines or not log.events or foreign_keys or unknown:
        why = (f"it holds {', '.join(foreign_keys)} events" if foreign_keys else
               f"no results in {RunDir(root).eval_dir} for its step {unknown[0]}" if unknown else "it is not an MLPerf log")
        raise EvaluationError(f"--eval-log {eval_log} was not written by an evaluation of {root} ({why}); "
                              "give a new path (an existing eval log is only resumed by the evaluation that wrote it)")


def _run_keeps_its_checkpoints(checkpoints: Path) -> bool:
    """Whether ``checkpoints`` is a run directory's ``checkpoints/`` whose ``run.json``
    asked to keep them (``--retain-checkpoints`` or ``RETAIN_GRPO_CHECKPOINTS=1`` at
    training); an unreadable ``run.json`` beside it counts as asking (nothing is deleted
    on a guess)."""
    run = RunDir(checkpoints.resolve().parent)
    if checkpoints.resolve() != run.checkpoints.resolve() or not run.info_file.is_file():
        return False
    try:
        return run.retain_recorded()
    except RunDirError:
        return True


@dataclass(frozen=True)
class CheckpointsRequest:
    """``evaluate --checkpoints DIR --mllog LOG``: the series' folder (or manifest), the
    training log, ``--format``, ``--eval-log``, whether to keep the checkpoints (resolved
    once by the caller), a progress bar, and the config's path (for torchrun's ranks)."""

    checkpoints: Path
    mllog_file: Path
    fmt: str = "auto"
    eval_log: Path | None = None
    retain: bool = False
    show_progress: bool = True
    config_file: Path | None = None


def evaluate_checkpoints(request: CheckpointsRequest, config: RunConfig, ranks=None) -> EvalOutcome:
    """Evaluate a series written by another trainer (or ours, outside a run directory)
    and write its ``run_stop`` to ``mllog_file`` (or to ``eval_log``).

    ``ranks``: the torchrun ranks this process joined as rank 0 (a NeMo-RL or manifest
    series; ``config_file`` is then the config's path, which they load): they are the
    workers, ``WORLD_SIZE / T`` of ``T`` ranks each (``inference.tensor_parallel_size``),
    each rank reading its share of every checkpoint.

    The caller validates the training log first (``check.series.check_training_log``).

    Raises:
        CheckpointError: the layout is not recognised.
        EvaluationError, RefitError, RunLockedError, ...: as :func:`offline.evaluate_series`.
    """
    checkpoints, mllog_file, eval_log, retain = request.checkpoints, request.mllog_file, request.eval_log, request.retain
    source = build_source(checkpoints, request.fmt, config, request.config_file)
    if ranks is not None and isinstance(source, OursAt):
        raise EvaluationError(f"{checkpoints} holds our trainer's layout outside a run directory: evaluate it without "
                              "torchrun (one worker), or evaluate its run directory under torchrun")
    if eval_log is not None:
        check_eval_log(eval_log, source.root)
    if isinstance(source, OursAt) and not retain and _run_keeps_its_checkpoints(checkpoints):
        print(f"note: {checkpoints.resolve().parent / 'run.json'} records that its run keeps its checkpoints: "
              "they are kept", file=sys.stderr)
        retain = True
    run = RunDir(source.root)
    unchecked = foreign.UNCHECKED.get(getattr(source, "format", foreign.OURS), ())
    for what in unchecked:
        print(f"note: not checked, the {getattr(source, 'format', 'ours')} layout cannot prove it: {what}", file=sys.stderr)
    record = run.eval_dir / SOURCE_FILE
    made = [p for p in (run.eval_dir, record, run.root / ".lock") if not p.exists()]
    new_eval_log = eval_log if eval_log is not None and not eval_log.exists() else None
    if not record.is_file():
        run.eval_dir.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(
            {"format": getattr(source, "format", foreign.OURS), "checkpoints": str(checkpoints.resolve()),
             "unchecked": list(unchecked), "global_batch_size": config.global_batch_size}, indent=2) + "\n")
    try:
        return evaluate_series(SeriesRequest(run, source, config, mllog_file, eval_log=eval_log, retain=retain,
                                             show_progress=request.show_progress,
                                             workers=1 if ranks is None else ranks.world_size, ranks=ranks))
    except BaseException:
        _remove_if_nothing_logged(run, made)
        if new_eval_log is not None and new_eval_log.is_file() and new_eval_log.stat().st_size == 0:
            new_eval_log.unlink()  # created for lines that never came: the path is left as given
        raise


def _remove_if_nothing_logged(run: RunDir, made: list[Path]) -> None:
    """An evaluation of a series folder that ended with nothing logged (refused, or
    stopped before its first result) leaves the folder as it found it: the record, the
    lock and ``eval/`` it made are removed (``eval/`` only when then empty)."""
    if any(run.eval_dir.glob("step_*.jsonl")) or run.summary_file.exists():
        return
    for path in made:
        if path.is_dir():
            with contextlib.suppress(OSError):
                path.rmdir()
        else:
            path.unlink(missing_ok=True)
    if run.eval_dir in made:
        with contextlib.suppress(OSError):
            run.eval_dir.rmdir()
