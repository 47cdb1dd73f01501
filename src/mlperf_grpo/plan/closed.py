"""``mlperf-grpo plan``: the closed-division values for one global batch size.

The values come from :func:`rules.closed_plan` (pure); the reference convergence point
(RCP) comes from the official ``mlperf_logging`` package's
``rcp_checker/training_6.1.0/rcps_qwen35_397b_grpo.json``, read the way
``rcp_checker.py`` reads it: olympic mean of each record's "Epochs to converge"
(``samples_count`` at convergence), linear interpolation between the records around a
GBS, no RCP above the largest. With a standard deviation of 0 (all 6.1.0 records) the
minimum acceptable mean of a submission equals the RCP mean.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mlperf_grpo import rules


def rcp_file(ruleset: str = rules.RULESET) -> Path:
    """Path of the installed package's RCP data for this benchmark."""
    import mlperf_logging.rcp_checker as rcp

    return Path(rcp.__file__).parent / f"training_{ruleset}" / f"rcps_{rules.BENCHMARK}.json"


def _olympic_mean(values: list[float]) -> float:
    values = sorted(values)
    return float(np.mean(values[1:-1])) if len(values) > 2 else float(np.mean(values))


def load_rcp_means(path: Path | None = None) -> dict[int, float]:
    """``{GBS: olympic mean samples_count to converge}`` of the official RCP records.

    Raises:
        OSError, ValueError: the file is missing or malformed.
    """
    data = json.loads((path or rcp_file()).read_text())
    return {int(r["BS"]): _olympic_mean(r["Epochs to converge"]) for r in data.values()}


def rcp_convergence(global_batch_size: int, means: dict[int, float]) -> dict[str, object]:
    """How ``rcp_checker`` judges a closed submission at this GBS.

    Returns:
        ``{"kind", "samples_count", "note"}``: kind is ``exact`` (a record at this GBS),
        ``interpolated`` (between two records), ``below`` (smaller than every record:
        compared with the smallest) or ``missing`` (larger than every record: the RCP
        check fails unless bypassed). ``samples_count`` is the mean a submission's
        olympic mean of samples_count-to-converge must reach (None when missing).
    Source: ``mlperf_logging/rcp_checker/rcp_checker.py`` ``check_directory``.
    """
    sizes = sorted(means)
    gbs = global_batch_size
    if gbs in means:
        return {"kind": "exact", "samples_count": means[gbs], "note": f"RCP record at GBS {gbs}"}
    if gbs < sizes[0]:
        return {"kind": "below", "samples_count": means[sizes[0]],
                "note": f"no RCP below GBS {sizes[0]}; the checker compares with GBS {sizes[0]}'s record"}
    if gbs > sizes[-1]:
        return {"kind": "missing", "samples_count": None,
                "note": f"no RCP above GBS {sizes[-1]}; rcp_checker fails ('Missing RCP') unless bypassed"}
    low = max(s for s in sizes if s < gbs)
    high = min(s for s in sizes if s > gbs)
    mean = float(np.interp(gbs, [low, high], [means[low], means[high]]))
    return {"kind": "interpolated", "samples_count": mean, "note": f"interpolated between GBS {low} and {high}"}


def build_plan(global_batch_size: int) -> dict[str, object]:
    """:func:`rules.closed_plan` plus the RCP figure and whether converging at S0 passes it.

    Raises:
        ValueError: the GBS is not a positive multiple of 16.
    """
    plan = rules.closed_plan(global_batch_size)
    rcp = rcp_convergence(plan["global_batch_size"], load_rcp_means())
    if rcp["samples_count"] is not None:
        rcp["first_eval_passes_rcp"] = plan["first_eval_samples_count"] >= rcp["samples_count"] - 1e-4
    plan["rcp"] = rcp
    return plan


def format_plan(plan: dict[str, object]) -> str:
    """The plan as ``name: value`` lines (what ``mlperf-grpo plan`` prints)."""
    skip = {"first_eval_step_formula", "opt_base_learning_rate_formula", "opt_gradient_clip_norm_formula", "rcp",
            "reference_algorithm_keys"}
    formulas = {
        "first_eval_step": plan["first_eval_step_formula"],
        "opt_base_learning_rate": plan["opt_base_learning_rate_formula"],
        "opt_gradient_clip_norm": plan["opt_gradient_clip_norm_formula"],
    }
    lines = [f"closed division, {plan['benchmark']}, ruleset {plan['ruleset']}"]
    for key, value in plan.items():
        if key in skip or key in ("benchmark", "ruleset"):
            continue
        if key == "later_eval_samples_count":
            value = ", ".join(str(v) for v in value) + ", ... (+GBS each)"
        if key == "config":  # from --config: the file and its division (its departures: format_differences)
            lines.append(f"  config: {value['file']} ({value['division']} division)")
            continue
        line = f"  {key}: {value}"
        if key in formulas:
            line += f"   = {formulas[key]}"
        if key in plan["reference_algorithm_keys"]:  # where the recipe file sets it
            line += f"   (recipe: {plan['reference_algorithm_keys'][key]})"
        lines.append(line)
    rcp = plan["rcp"]
    figure = "none" if rcp["samples_count"] is None else f"{rcp['samples_count']:g} samples"
    lines.append(f"  rcp_samples_to_converge: {figure} ({rcp['kind']}: {rcp['note']})")
    if "first_eval_passes_rcp" in rcp:
        verdict = "passes the RCP check" if rcp["first_eval_passes_rcp"] else (
            f"would be faster than the RCP: rcp_checker fails unless runs converge at >= {rcp['samples_count']:g}")
        lines.append(f"  converging at the first eval ({plan['first_eval_samples_count']} samples) {verdict}")
    return "\n".join(lines)


def format_differences(config) -> str:
    """Lines naming the values of ``config`` that differ from closed ("" when none)."""
    diffs = config.closed_violations()
    if not diffs:
        return ""
    head = f"{config.division} division: {len(diffs)} value(s) differ from closed:"
    return "\n".join([head] + [f"  {d}" for d in diffs])
