"""Is another trainer's MLPerf log ready to have evaluations appended?

``mlperf-grpo evaluate --checkpoints`` runs this before reading a checkpoint. It reuses
``check``'s lint rules, so a problem reads the same as ``mlperf-grpo check`` reports it,
and adds what only the evaluator knows: the config's global batch size, and that the log
trained every step the series holds.
"""

from __future__ import annotations

from pathlib import Path

from mlperf_grpo.logs.check import UnreadableLog, load_log_text
from mlperf_grpo.logs.check.findings import Finding
from mlperf_grpo.logs.check.lint import (
    LintInput,
    duplicate_global_batch_size,
    invalid_lines,
    metadata_types,
    multiple_run_stops,
    run_stop_order,
)
from mlperf_grpo.logs.check.shape import trained_samples
from mlperf_grpo.logs.mllog import parse_log_text
from mlperf_grpo.logs.values import logged_global_batch_size

RULES = (invalid_lines, metadata_types, run_stop_order, multiple_run_stops, duplicate_global_batch_size)
"""The lint rules whose findings make a training log unusable for evaluation."""


class TrainingLogError(ValueError):
    """The training log cannot take the evaluation's lines; the message is one line."""


def _line(path: Path, f: Finding) -> str:
    """A finding as one line, with the words ``check`` prints for it."""
    where = f"{path}:{f.line}" if f.line else str(path)
    return f"{where}: {f.key}: {f.problem} ({f.rule}: {f.impact})"


def check_training_log(path: Path, global_batch_size: int, last_checkpoint_step: int | None = None) -> int:
    """Validate the log a foreign series was trained with.

    Args:
        path: the training log.
        global_batch_size: the config's (completions per step).
        last_checkpoint_step: the series' last step, when known: the log must have trained
            it (a ``block_stop`` or ``tracked_stats`` at its ``samples_count``).
    Returns:
        The last trained step (``samples_count / global_batch_size`` of the last one).
    Raises:
        TrainingLogError: unreadable; a lint finding of :data:`RULES` (``no run_stop`` is
            expected and allowed); ``global_batch_size`` missing or not the config's; no
            trained step logged; the series goes past the last trained step.
    """
    try:
        text = load_log_text(path)
    except UnreadableLog as err:
        raise TrainingLogError(f"training log {err}") from None
    log = parse_log_text(text)
    inp = LintInput(log=log, lines=text.splitlines())
    for rule in RULES:
        for f in rule(inp):
            if not (f.key == "run_stop" and f.problem == "no run_stop"):
                raise TrainingLogError(_line(path, f))
    logged = logged_global_batch_size(log)
    if logged is None:
        raise TrainingLogError(f"{path}: no positive integer global_batch_size line; the eval samples_count "
                               "cannot be checked against the training")
    if logged != global_batch_size:
        line = log.find("global_batch_size")[0].line_no
        raise TrainingLogError(f"{path}:{line}: global_batch_size {logged} differs from the config's {global_batch_size} "
                               "(grpo.num_prompts_per_step x num_generations_per_prompt); pass the config the run was trained with")
    trained = [sc for _, sc in trained_samples(log)]
    if not trained:
        raise TrainingLogError(f"{path}: no block_stop or tracked_stats with a samples_count: the log trained no step")
    last = max(trained) // global_batch_size
    if last_checkpoint_step is not None and last_checkpoint_step > last:
        raise TrainingLogError(f"{path}: the log trained to step {last} (samples_count {max(trained)}), but the series "
                               f"has a checkpoint of step {last_checkpoint_step}: is this the series' own log?")
    return last
