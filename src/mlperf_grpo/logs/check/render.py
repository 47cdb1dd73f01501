"""Output of ``mlperf-grpo check``: a readable table, or JSON for machines."""

from __future__ import annotations

import json
import textwrap

from mlperf_grpo.logs.check import CheckReport


def _fmt_minutes(minutes: float | None) -> str:
    return "-" if minutes is None else f"{minutes:.3f} min ({minutes * 60:.3f} s)"


def format_report(report: CheckReport) -> str:
    """One log's result as aligned text: official verdict, score, findings, notes."""
    o, s = report.official, report.score
    out = [f"== {report.path}"]
    if report.run_dir:
        out.append(f"run directory: {report.run_dir}")
    out.append(f"official compliance (training 6.1.0, division {o.division or '?'}): {report.official_summary()}")
    if o.valid or len(o.messages) > 1:  # warnings, or every message behind the summary
        out += [textwrap.indent(m, "    ") for m in o.messages]
    if report.mode is not None:
        out.append(f"evaluation: {report.mode.mode} ({report.mode.evidence})")
    ref = f" (RCP reference at this GBS: {s.reference_samples})" if s.reference_samples else ""
    rows = [
        ("status", s.status or "-"),
        ("time-to-train, log", _fmt_minutes(s.log_minutes) + "  (run_stop - run_start)" if s.status == "success"
         else f"none (run_stop status {s.status!r}: no score)" if s.status else "none (no run_stop)"),
        ("time-to-train, summarizer", _fmt_minutes(s.summarizer_minutes)),
        ("samples to converge, log", f"{s.log_samples if s.log_samples is not None else '-'}  (first passing eval)"),
        ("samples to converge, RCP", f"{s.rcp_samples if s.rcp_samples is not None else '-'}{ref}"),
    ]
    width = max(len(k) for k, _ in rows)
    out += [f"  {k:<{width}}  {v}" for k, v in rows]
    for d in s.disagreements:
        out.append(f"  DISAGREE: {d}")
    if report.findings:
        out.append(f"lint: {len(report.findings)} finding(s)")
        line_w = max(len(str(f.line or "-")) for f in report.findings)
        key_w = max(len(f.key) for f in report.findings)
        rule_w = max(len(f.rule) for f in report.findings)
        out.append(f"  {'LINE':>{line_w}}  {'KEY':<{key_w}}  {'RULE':<{rule_w}}  PROBLEM / WHY IT MATTERS")
        for f in report.findings:
            out.append(f"  {str(f.line or '-'):>{line_w}}  {f.key:<{key_w}}  {f.rule:<{rule_w}}  {f.problem}")
            out.append(f"  {'':>{line_w}}  {'':<{key_w}}  {'':<{rule_w}}  -> {f.impact}")
    else:
        out.append("lint: no findings")
    for n in report.notes:
        out.append(f"note: {n}")
    out.append("result: " + ("CLEAN" if report.clean else "NOT CLEAN"))
    return "\n".join(out)


def format_reports(reports: list[CheckReport]) -> str:
    """All logs' results, separated by blank lines."""
    return "\n\n".join(format_report(r) for r in reports)


def to_json(reports: list[CheckReport], errors: list[tuple[object, str]] = ()) -> str:
    """``{"clean": bool, "logs": [report dicts, then {"log", "error"} for unreadable logs]}``
    as indented JSON; ``clean`` is False when any log is unreadable."""
    logs = [r.to_dict() for r in reports] + [{"log": str(path), "clean": False, "error": message} for path, message in errors]
    clean = all(r.clean for r in reports) and not errors
    return json.dumps({"clean": clean, "logs": logs}, indent=2, default=str)
