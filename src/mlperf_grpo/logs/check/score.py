"""Time-to-train and samples to converge: what the log means versus what the official
tools compute from it.

What the log means (DESIGN.md, "The rule"): time-to-train is ``run_stop.time_ms -
run_start.time_ms`` (first of each); the run converged when an ``eval_accuracy`` is
strictly above the target and ``run_stop`` says success; samples to converge is the
``samples_count`` of the first passing evaluation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mlperf_grpo import rules
from mlperf_grpo.logs.check import official
from mlperf_grpo.logs.check.lint import first_passing_eval
from mlperf_grpo.logs.mllog import ParsedLog, time_to_train_ms


@dataclass
class Score:
    """Score of one log, three ways. Minutes are ``ms / 60000``.

    ``log_*``: the log's meaning (None unless ``run_stop`` says success: an aborted run has no
    time-to-train); ``summarizer_minutes``: ``result_summarizer``;
    ``rcp_samples``: ``rcp_checker``; ``reference_samples``: the RCP mean at this GBS
    (None for a GBS without a reference); ``disagreements``: one sentence each.
    """

    status: str | None
    log_minutes: float | None
    log_samples: int | None
    summarizer_minutes: float | None
    rcp_samples: float | int | None
    reference_samples: int | None
    notes: list[str] = field(default_factory=list)
    disagreements: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _minutes(ms: int | None) -> float | None:
    return None if ms is None else ms / 60000


def compute_score(log: ParsedLog, summ: official.SummarizerResult, rcp: official.RCPResult,
                  target: float = rules.TARGET_ACCURACY) -> Score:
    """The :class:`Score` of ``log`` (parsed) next to the official tools' readings of it. Never raises."""
    stops = log.find("run_stop")
    status = stops[0].metadata.get("status") if stops else None
    passing = first_passing_eval(log, target)
    converged = status == "success" and passing is not None
    log_samples = passing.metadata.get("samples_count") if converged else None
    try:
        log_ms = time_to_train_ms(log) if status == "success" else None  # only a converged run has a score
    except (TypeError, ValueError, OverflowError):
        log_ms = None
    gbs = log.first_value("global_batch_size")
    reference = rules.REFERENCE_SAMPLES_TO_CONVERGE.get(gbs) if isinstance(gbs, int) else None
    score = Score(status, _minutes(log_ms), log_samples, summ.minutes, rcp.samples, reference)
    score.notes += [n for n in (summ.note, rcp.note) if n]

    d = score.disagreements
    if not isinstance(log_samples, int) or isinstance(log_samples, bool):
        score.log_samples = None
    if converged and summ.minutes is None and summ.note and summ.note.startswith("no summarizer result"):
        pass  # the checkers were not run or timed out: said once, in the verdict
    elif converged and summ.minutes is None:
        d.append("the log converged but the summarizer gives it no score")
    elif summ.minutes is not None and score.log_minutes is not None and abs(summ.minutes - score.log_minutes) > 1e-9:
        d.append(f"summarizer time-to-train {summ.minutes:.4f} min != the log's {score.log_minutes:.4f} min "
                 "(first run_start to first run_stop)")
    if rcp.converged is None and rcp.note and rcp.note.startswith("no RCP checker result"):
        pass
    elif converged and rcp.converged is not True:
        d.append("the log converged but the RCP checker does not count it as converged")
    elif not converged and rcp.converged:
        d.append(f"the RCP checker counts the run as converged at {rcp.samples} samples, but the log has no "
                 "passing evaluation with a success run_stop")
    elif converged and rcp.samples != log_samples:
        d.append(f"RCP samples to converge {rcp.samples} != {log_samples}, the samples_count of the first passing "
                 f"evaluation (line {passing.line_no})")
    if rcp.global_batch_size not in (None, -1, gbs):
        d.append(f"the RCP checker reads global batch size {rcp.global_batch_size}, the log declares {gbs}")
    return score
