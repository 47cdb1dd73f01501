"""``mlperf-grpo package``: runs -> the submission layout -> the official checkers.

Layout built under ``OUT`` (what ``mlperf_logging.package_checker`` walks for training
6.1.0)::

    OUT/systems/<system>.json                          system description skeleton
    OUT/results/<system>/qwen35_397b_grpo/result_<i>.txt  each run's MLPerf log, verbatim
    OUT/benchmarks/qwen35_397b_grpo/implementations/mlperf-grpo/   what reproduces the run:
        src/ (with model assets), configs/, pyproject.toml, README.md of this project
    OUT/checker_logs/                                  what each checker printed

Then, each as ``python -m`` in a subprocess, judged by its text as well as its exit code:

- ``mlperf_logging.package_checker OUT training 6.1.0``: always exits 0; passes when it
  prints ``PACKAGE CHECKER FOUND NO ERRORS`` and no ``ERROR`` line.
- ``mlperf_logging.rcp_checker <benchmark folder> --rcp_version 6.1.0`` (its default
  ruleset is older): exit 0 and ``RCP test PASSED``. Closed division only, as the package
  checker runs it (``package_checker.check_training_package_folder``: the RCP check for
  ``division == "closed"``); an open submission lists it as skipped.
- ``mlperf_logging.result_summarizer.compute_score``: crashes on 6.1.0 (it unpacks four
  values from ``_compute_strong_score_standalone(..., return_full_scores=True)``, which
  returns five). We run it and report the crash, then compute the score with that same
  library function (``_compute_strong_score_standalone``, the one the package-level
  summarizer uses) in a subprocess and print its score next to ours.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mlperf_logging.mllog import constants as C  # noqa: N812

from mlperf_grpo import rules
from mlperf_grpo.config.rundir import RunDir
from mlperf_grpo.logs.mllog import read_log, time_to_train_ms

USAGE = "training"
FILL_IN = "FILL IN"
"""Marks a system-description value the submitter must replace."""


class PackageError(ValueError):
    """The runs cannot be packaged (too few, no log, mixed benchmark/division/GBS)."""


@dataclass(frozen=True)
class RunSummary:
    """One packaged run, read from its log."""

    run_dir: str
    result_file: str
    status: str | None
    seed: object
    samples_count: int | None
    """``samples_count`` of the last ``eval_accuracy`` before ``run_stop`` (RCP's reading)."""
    time_to_train_ms: int | None


@dataclass
class CheckerResult:
    """A checker's verdict, exit code and the lines of its output that matter."""

    name: str
    passed: bool
    returncode: int
    summary: list[str] = field(default_factory=list)
    log_file: str = ""
    skipped: bool = False
    """Not run (it does not apply to this division); ``passed`` is then True."""


@dataclass
class PackageResult:
    """What ``package`` built and what the checkers said."""

    output: str
    system: str
    division: str
    runs: list[RunSummary]
    checkers: list[CheckerResult]
    score_min: float | None
    """Our score: olympic mean of the time-to-train minutes (drop fastest and slowest) x
    the RCP scaling factor (``scaling.json``, 1.0 when absent)."""
    summarizer_score_min: float | None

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checkers)


def _read_run(run_dir: Path) -> tuple[Path, dict]:
    """The run's log path and the values we need from it."""
    try:
        _, mllog_file = RunDir(run_dir).load()
    except ValueError as err:  # RunDirError, ConfigError
        raise PackageError(str(err)) from None
    if not mllog_file.is_file():
        raise PackageError(f"{run_dir}: no MLPerf log at {mllog_file}")
    log = read_log(mllog_file)
    stops = log.find(C.RUN_STOP)
    evals = [e for e in log.events if e.key == C.EVAL_ACCURACY and (not stops or e.line_no < stops[0].line_no)]
    info = {
        "benchmark": log.first_value(C.SUBMISSION_BENCHMARK),
        "division": log.first_value(C.SUBMISSION_DIVISION),
        "org": log.first_value(C.SUBMISSION_ORG),
        "gbs": log.first_value(C.GLOBAL_BATCH_SIZE),
        "seed": log.first_value(C.SEED),
        "status": stops[0].metadata.get(C.STATUS) if stops else None,
        "samples_count": evals[-1].metadata.get(C.SAMPLES_COUNT) if evals else None,
        "ttt_ms": time_to_train_ms(log),
        "run_start_ms": log.find(C.RUN_START)[0].time_ms if log.find(C.RUN_START) else None,
    }
    if info["status"] is None:
        raise PackageError(f"{run_dir}: the log {mllog_file} has no run_stop; evaluate the run first")
    return mllog_file, info


def _system_description(system: str, org: str, division: str) -> dict[str, object]:
    """A ``systems/<system>.json`` with every field the 6.1.0 checker requires.

    Values known on this machine are filled in; the rest read ``FILL IN``. Every value is
    a string (the checker joins them); the counts the result summarizer multiplies
    (nodes, processors, accelerators per node) hold this machine's values so it runs.
    """
    return {
        "submitter": org,
        "division": division,
        "status": "Available on-premise",
        "system_name": system,
        "number_of_nodes": "1",
        "host_processors_per_node": "1",
        "host_processor_model_name": platform.processor() or FILL_IN,
        "host_processor_core_count": str(os.cpu_count() or 1),
        "host_processor_vcpu_count": str(os.cpu_count() or 1),
        "host_processor_frequency": FILL_IN,
        "host_processor_caches": FILL_IN,
        "host_processor_interconnect": FILL_IN,
        "host_memory_capacity": FILL_IN,
        "host_storage_type": FILL_IN,
        "host_storage_capacity": FILL_IN,
        "host_networking": FILL_IN,
        "host_networking_topology": FILL_IN,
        "host_memory_configuration": FILL_IN,
        "accelerators_per_node": "0",
        "accelerator_model_name": FILL_IN,
        "accelerator_host_interconnect": FILL_IN,
        "accelerator_frequency": FILL_IN,
        "accelerator_on-chip_memories": FILL_IN,
        "accelerator_memory_configuration": FILL_IN,
        "accelerator_memory_capacity": FILL_IN,
        "accelerator_interconnect": FILL_IN,
        "accelerator_interconnect_topology": FILL_IN,
        "cooling": FILL_IN,
        "hw_notes": f"{FILL_IN}: values reading '{FILL_IN}' must be replaced before submitting",
        "framework": "mlperf-grpo 0.1.0 (PyTorch)",
        "other_software_stack": FILL_IN,
        "operating_system": f"{platform.system()} {platform.release()}",
        "sw_notes": "",
    }


IMPLEMENTATION_FILES = ("src", "configs", "pyproject.toml", "README.md")
"""What the implementation folder holds: everything needed to install and rerun the runs."""


def project_root() -> Path:
    """The source tree this package runs from (the folder holding ``pyproject.toml``).

    Raises:
        PackageError: the package is not running from its source tree (a wheel install),
            so the implementation cannot be copied; the message says how to fix it.
    """
    root = Path(__file__).resolve().parents[3]
    missing = [name for name in IMPLEMENTATION_FILES if not (root / name).exists()]
    if missing:
        raise PackageError(f"the implementation cannot be packaged: {', '.join(missing)} not found in {root}; "
                           "run package from a source checkout installed with 'pip install -e .'")
    return root


def _copy_source(root: Path, dest: Path) -> None:
    """The implementation that reproduces the runs: ``src/`` (model assets included),
    ``configs/``, ``pyproject.toml`` and ``README.md``."""
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in IMPLEMENTATION_FILES:
        if (root / name).is_dir():
            shutil.copytree(root / name, dest / name, ignore=ignore)
        else:
            shutil.copy2(root / name, dest / name)


def _run_module(args: list[str], log_file: Path, cwd: Path) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    log_file.write_text(text)
    return proc.returncode, text


def _lines(text: str, *patterns: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if any(p in ln for p in patterns)]


def run_package_checker(out: Path, logs: Path) -> CheckerResult:
    """``package_checker``; it always exits 0, so its verdict is read from its text."""
    log = logs / "package_checker.txt"
    rc, text = _run_module(["mlperf_logging.package_checker", str(out), USAGE, rules.RULESET,
                            "--log_output", str(logs / "package_checker.log")], log, out)
    errors = [ln.strip() for ln in text.splitlines() if ln.startswith(("ERROR", "CRITICAL"))]
    passed = rc == 0 and "PACKAGE CHECKER FOUND NO ERRORS" in text and not errors
    summary = errors or _lines(text, "FOUND NO ERRORS", "RCP Test Passed")
    if "Traceback" in text:
        passed, summary = False, summary + [text.strip().splitlines()[-1]]
    return CheckerResult("package_checker", passed, rc, summary, str(log))


def run_rcp_checker(bench_dir: Path, logs: Path) -> CheckerResult:
    """``rcp_checker --rcp_version 6.1.0`` on the benchmark folder."""
    log = logs / "rcp_checker.txt"
    rc, text = _run_module(["mlperf_logging.rcp_checker", str(bench_dir), "--rcp_version", rules.RULESET,
                            "--log_output", str(logs / "rcp_checker.log")], log, logs)
    passed = rc == 0 and "RCP test PASSED" in text
    summary = _lines(text, "RCP test", "Submission mean epochs", "Traceback", "Error:")
    return CheckerResult("rcp_checker", passed, rc, summary, str(log))


_SCORE_SNIPPET = """
import json, sys
from mlperf_logging.result_summarizer import result_summarizer as rs
tracks, _, score, _, scale = rs._compute_strong_score_standalone(
    sys.argv[1], sys.argv[2], False, sys.argv[3], "training", sys.argv[4], return_full_scores=True)
print("SCORE_JSON " + json.dumps({"score": score, "scaling_factor": scale, "runs": tracks}))
"""


def run_summarizer(bench_dir: Path, system: str, logs: Path) -> tuple[CheckerResult, float | None]:
    """The result summarizer's score, working around ``compute_score``'s 6.1.0 crash.

    Runs ``result_summarizer.compute_score`` first and records whether it crashed; then
    calls the function it wraps, ``_compute_strong_score_standalone``, in a subprocess.
    """
    rc_cs, text_cs = _run_module(
        ["mlperf_logging.result_summarizer.compute_score", "--benchmark_folder", str(bench_dir),
         "--usage", USAGE, "--ruleset", rules.RULESET, "--system", system],
        logs / "compute_score.txt", logs)
    summary = []
    if rc_cs != 0:
        last = text_cs.strip().splitlines()[-1] if text_cs.strip() else f"exit {rc_cs}"
        summary.append(f"compute_score crashed (known on 6.1.0): {last}; used _compute_strong_score_standalone")
    else:
        summary += _lines(text_cs, "Final score")
    log = logs / "result_summarizer.txt"
    proc = subprocess.run(
        [sys.executable, "-c", _SCORE_SNIPPET, rules.BENCHMARK, system, str(bench_dir), rules.RULESET],
        cwd=logs, capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    log.write_text(text)
    found = re.search(r"^SCORE_JSON (.*)$", proc.stdout, re.M)
    score = json.loads(found.group(1))["score"] if found else None
    if score is None:
        summary.append("no score: " + (text.strip().splitlines()[-1] if text.strip() else "no output"))
    else:
        summary.append(f"summarizer score: {score:.6f} min")
    return CheckerResult("result_summarizer", score is not None, proc.returncode, summary, str(log)), score


def olympic_score_min(times_ms: list[int | None], scaling_factor: float = 1.0) -> float | None:
    """Olympic mean of the time-to-train minutes, x the RCP scaling factor.

    Drops the fastest and the slowest run (one unconverged run counts as the slowest);
    None when two or more runs lack a time. Source: ``result_summarizer``
    ``_compute_olympic_average`` with ``max_dropped_scores=1``.
    """
    minutes = sorted(t / 60000 for t in times_ms if t is not None)
    dropped = len(times_ms) - len(minutes)
    if dropped > 1:
        return None
    kept = minutes[1:len(minutes) - (1 - dropped)]
    return sum(kept) / len(kept) * scaling_factor if kept else None


def build_package(run_dirs: list[Path], system: str, output: Path) -> PackageResult:
    """Lay out the submission for ``run_dirs`` under ``output`` and run the checkers.

    Raises:
        PackageError: fewer than 3 runs, one run directory given twice, a run without a
            log or ``run_stop``, two copies of one run, runs of another benchmark or of
            mixed division/GBS, a bad system name, an ``output`` folder that exists and is
            not empty or cannot be written, or no source tree to copy as the
            implementation (see :func:`project_root`).
    """
    need = 3
    output = output.resolve()  # the checkers run with another working directory
    if len(run_dirs) < need:
        raise PackageError(f"a {rules.BENCHMARK} submission needs {need} runs; got {len(run_dirs)}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", system):
        raise PackageError(f"--system {system!r}: use letters, digits, '.', '_' or '-'")
    if output.exists() and any(output.iterdir()):
        raise PackageError(f"output {output} exists and is not empty; choose a new folder")
    seen: dict[Path, Path] = {}
    for d in run_dirs:
        if Path(d).resolve() in seen:
            raise PackageError(f"run directory {d} is given twice (also as {seen[Path(d).resolve()]}); "
                               f"a submission needs {need} different runs")
        seen[Path(d).resolve()] = Path(d)
    _check_writable(output)
    root = project_root()
    runs = [(Path(d), *_read_run(Path(d))) for d in run_dirs]
    _refuse_copies(runs, need)
    for key in ("benchmark", "division", "gbs"):
        values = {info[key] for _, _, info in runs}
        if len(values) != 1:
            raise PackageError(f"runs disagree on {key}: {sorted(map(str, values))}")
    first = runs[0][2]
    if first["benchmark"] != rules.BENCHMARK:
        raise PackageError(f"runs are of benchmark {first['benchmark']!r}, not {rules.BENCHMARK}")

    bench_dir = output / "results" / system / rules.BENCHMARK
    logs = output / "checker_logs"
    try:
        summaries = _lay_out(output, bench_dir, logs, system, first, root, runs)
    except OSError as err:
        raise PackageError(f"cannot write the submission under {output}: {err.strerror} ({err.filename}); "
                           "choose a folder this user may write") from None
    rcp = run_rcp_checker(bench_dir, logs) if first["division"] == "closed" else CheckerResult(
        "rcp_checker", True, 0, ["not run: the RCP check is for the closed division (package_checker runs it for "
                                 "closed submissions only)"], skipped=True)
    checkers = [run_package_checker(output, logs), rcp]
    summarizer, summarizer_score = run_summarizer(bench_dir, system, logs)
    checkers.append(summarizer)
    scaling = bench_dir / "scaling.json"
    factor = json.loads(scaling.read_text())["scaling_factor"] if scaling.is_file() else 1.0
    score = olympic_score_min([r.time_to_train_ms for r in summaries], factor)
    return PackageResult(str(output), system, first["division"], summaries, checkers, score, summarizer_score)


def _check_writable(output: Path) -> None:
    """Raises PackageError when ``output``'s nearest existing folder is not a writable
    directory (a read-only file system, a file in the way): before anything is read or run."""
    existing = next((p for p in (output, *output.parents) if p.exists()), Path("/"))
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        why = "is a file" if not existing.is_dir() else "is not writable (a read-only file system or folder?)"
        raise PackageError(f"--output {output}: {existing} {why}; choose a folder this user may write")


def _refuse_copies(runs: list[tuple[Path, Path, dict]], need: int) -> None:
    """Raises PackageError when two run directories hold one run (copies: the same
    ``run_start`` time and seed), which would count one training as two."""
    seen: dict[tuple, Path] = {}
    for run_dir, _, info in runs:
        key = (info["run_start_ms"], info["seed"])
        if key in seen:
            raise PackageError(f"{run_dir} and {seen[key]} hold the same run (run_start at {info['run_start_ms']} ms, "
                               f"seed {info['seed']}): copies of one training; a submission needs {need} different runs")
        seen[key] = run_dir


def _lay_out(output: Path, bench_dir: Path, logs: Path, system: str, first: dict, root: Path,
             runs: list[tuple[Path, Path, dict]]) -> list[RunSummary]:
    """The submission's folders and files (see the module docstring); the runs' summaries."""
    bench_dir.mkdir(parents=True)
    (output / "systems").mkdir()
    logs.mkdir()
    desc = _system_description(system, first["org"] or FILL_IN, first["division"])
    (output / "systems" / f"{system}.json").write_text(json.dumps(desc, indent=2) + "\n")
    _copy_source(root, output / "benchmarks" / rules.BENCHMARK / "implementations" / "mlperf-grpo")
    summaries = []
    for i, (run_dir, mllog_file, info) in enumerate(runs):
        result = bench_dir / f"result_{i}.txt"
        shutil.copyfile(mllog_file, result)
        summaries.append(RunSummary(str(run_dir), str(result), info["status"], info["seed"],
                                    info["samples_count"], info["ttt_ms"] if info["status"] == C.SUCCESS else None))
    return summaries


def format_result(result: PackageResult) -> str:
    """What ``mlperf-grpo package`` prints."""
    lines = [f"submission: {result.output} (system {result.system}, {result.division} division)"]
    for r in result.runs:
        ttt = "not converged" if r.time_to_train_ms is None else f"{r.time_to_train_ms / 60000:.4f} min"
        lines.append(f"  {Path(r.result_file).name}: {r.status}, samples_count {r.samples_count}, "
                     f"seed {r.seed}, time-to-train {ttt}  <- {r.run_dir}")
    for c in result.checkers:
        if c.skipped:
            lines.append(f"{c.name}: SKIPPED")
        else:
            lines.append(f"{c.name}: {'PASS' if c.passed else 'FAIL'} (exit {c.returncode}; {c.log_file})")
        lines += [f"    {s}" for s in c.summary]
    ours = "none" if result.score_min is None else f"{result.score_min:.6f} min"
    theirs = "none" if result.summarizer_score_min is None else f"{result.summarizer_score_min:.6f} min"
    match = (result.score_min is not None and result.summarizer_score_min is not None
             and abs(result.score_min - result.summarizer_score_min) < 1e-9)
    lines.append(f"score (olympic mean time-to-train): {ours}; summarizer: {theirs}"
                 + (" (match)" if match else " (MISMATCH)" if result.summarizer_score_min is not None else ""))
    lines.append(f"system description to complete: {result.output}/systems/{result.system}.json "
                 f"(fields reading '{FILL_IN}')")
    return "\n".join(lines)
