"""The lint rule that ties ``check LOG --run-dir DIR`` to the log: DIR must be this log's
run, or its results and checkpoint records are another run's evidence.

Two ties, the stronger first: DIR's own log (``run.json``'s ``mllog_file``) starts at
this log's ``run_start`` time; and each checkpoint record's weight-update time in DIR
lies within its step's training in this log (:func:`~mlperf_grpo.logs.values.step_window`,
as ``merge`` and ``evaluate --checkpoints`` tie them).
"""

from __future__ import annotations

import json
from pathlib import Path

from mlperf_grpo.logs.check.findings import Finding
from mlperf_grpo.logs.check.lint_input import LintInput
from mlperf_grpo.logs.mllog import read_log
from mlperf_grpo.logs.values import checkpoint_records, is_number, logged_global_batch_size, ms_text, step_window

IMPACT = ("the results and checkpoints checked against this log are another run's; pass this log's run directory "
          "(or none)")


def _own_run_start(run_dir: Path) -> tuple[Path, float] | None:
    """``(log, run_start time)`` of the run directory's own log, or None when unknown."""
    try:
        name = json.loads((run_dir / "run.json").read_text())["mllog_file"]
        log_path = run_dir / name if not Path(name).is_absolute() else Path(name)
        starts = read_log(log_path).find("run_start")
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    return (log_path, starts[0].time_ms) if starts and is_number(starts[0].time_ms) else None


def run_dir_of_log(inp: LintInput) -> list[Finding]:
    """One finding when ``inp.run_dir`` is not the run this log records."""
    starts = inp.log.find("run_start")
    if inp.run_dir is None or not starts or not is_number(starts[0].time_ms):
        return []
    start = starts[0]
    own = _own_run_start(Path(inp.run_dir))
    if own is not None and own[1] != start.time_ms:
        return [Finding.at("run-dir", start, f"the run directory {inp.run_dir} is not this log's run: its log {own[0]} "
                                              f"started at {ms_text(own[1])} ms, this log at {ms_text(start.time_ms)} ms",
                           IMPACT)]
    gbs = logged_global_batch_size(inp.log)
    for sc, (record, t_update) in sorted(checkpoint_records(Path(inp.run_dir)).items()) if gbs else []:
        lo, hi = step_window(inp.log, sc // gbs, gbs)
        if hi is not None and (t_update > hi.time_ms or (lo is not None and t_update < lo.time_ms)):
            return [Finding.at("run-dir", start, f"the run directory {inp.run_dir} is not this log's run: {record}'s "
                                                  f"weight-update time {ms_text(t_update)} ms is not within step "
                                                  f"{sc // gbs}'s training in this log", IMPACT)]
    return []
