"""``mlperf-grpo`` command line: one short function per subcommand.

Exit codes: 0 success, 3 aborted (no checkpoint passed), 2 bad input, 1 anything else.
Errors are one line on stderr, ``mlperf-grpo: error: ...``, without a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT, EXIT_ABORTED = 0, 1, 2, 3
DEFAULT_OUTPUT = Path("runs/default")


class BadInput(Exception):
    """Wrong input from the user: exit 2 with the message."""


def _config(args: argparse.Namespace):
    from mlperf_grpo.config import load_config

    return load_config(args.config)


def _print_outcome(outcome, run_dir: Path) -> int:
    status = outcome.status
    print(f"status: {status}")
    print(f"passing step: {outcome.passing_step if outcome.passing_step is not None else 'none'}")
    print(f"time-to-train: {outcome.time_to_train_ms / 60000:.3f} min (run_start to run_stop, from the log)")
    print(f"log: {outcome.mllog_file}")
    print(f"run directory: {run_dir}")
    return EXIT_OK if status == "success" else EXIT_ABORTED


def _deferred() -> bool:
    """``DEFERRED_OFFLINE_EVAL`` (1 by default; 0 = evaluate inline during training)."""
    from mlperf_grpo.evaluate.inline import deferred_requested

    try:
        return deferred_requested()
    except ValueError as err:
        raise BadInput(str(err)) from None


def _note_open_differences(config) -> None:
    from mlperf_grpo.plan import format_differences

    if config.division == "open" and (text := format_differences(config)):
        print(f"note: {text}")


def cmd_train(args: argparse.Namespace) -> int:
    """Train and write deferred checkpoints; no run_stop. DEFERRED_OFFLINE_EVAL=0: inline eval."""
    from mlperf_grpo.rundir import RunDir
    from mlperf_grpo.train.loop import train

    config = _config(args)
    _note_open_differences(config)
    if not _deferred():
        from mlperf_grpo.evaluate.inline import train_with_inline_eval

        outcome = train_with_inline_eval(config, RunDir(args.output), config_filename=args.config or "builtin-default")
        return _print_outcome(outcome, args.output)
    result = train(config, RunDir(args.output), config_filename=args.config or "builtin-default")
    print(f"trained {len(result.steps)} steps; checkpoints {result.checkpoint_steps[:1]}..{result.checkpoint_steps[-1:]} in {args.output}/checkpoints")
    return EXIT_OK


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Offline evaluation of a trained run; writes run_stop."""
    from mlperf_grpo.evaluate.offline import evaluate_run

    if not _deferred():
        raise BadInput("DEFERRED_OFFLINE_EVAL=0 evaluates inline during training; 'evaluate' is the deferred driver: unset it or set it to 1")
    outcome = evaluate_run(args.run_dir, retain_checkpoints=args.retain_checkpoints)
    return _print_outcome(outcome, args.run_dir)


def cmd_run(args: argparse.Namespace) -> int:
    """Train, then evaluate offline: the whole benchmark run."""
    from mlperf_grpo.evaluate.offline import evaluate_run, retain_requested

    if not _deferred():
        return cmd_train(args)  # inline evaluation: training writes run_stop itself
    retain_requested(args.retain_checkpoints)  # a bad RETAIN_GRPO_CHECKPOINTS fails before training
    cmd_train(args)
    outcome = evaluate_run(args.output, retain_checkpoints=args.retain_checkpoints)
    return _print_outcome(outcome, args.output)


def cmd_check(args: argparse.Namespace) -> int:
    """Official checkers plus the offline-eval lint: 0 clean, 1 not clean, 2 a log unreadable.

    Every readable log is reported even when another is unreadable; an unreadable log is
    one ``mlperf-grpo: error:`` line on stderr (with ``--json``: an entry with ``error``).
    """
    import json

    from mlperf_grpo.check import UnreadableLog, check_log
    from mlperf_grpo.check.render import format_reports, to_json

    problem = None
    if args.run_dir is not None and args.no_run_dir:
        problem = "--run-dir and --no-run-dir contradict each other; pass one"
    elif args.run_dir is not None and not args.run_dir.is_dir():
        problem = f"--run-dir {args.run_dir} is not a directory"
    elif not args.time_limit_s > 0:
        problem = f"--time-limit-s must be a positive number of seconds, got {args.time_limit_s}"
    if problem is not None:
        if args.json:
            print(json.dumps({"clean": False, "error": problem, "logs": []}, indent=2))
        raise BadInput(problem)
    reports, errors = [], []
    for path in args.logs:
        try:
            reports.append(check_log(path, run_dir=args.run_dir, auto_run_dir=not args.no_run_dir,
                                     time_limit_s=args.time_limit_s))
        except UnreadableLog as err:
            errors.append((path, str(err)))
    if args.json:
        print(to_json(reports, errors))
    elif reports:
        print(format_reports(reports))
    for _, message in errors:
        print(f"mlperf-grpo: error: {message}", file=sys.stderr)
    if errors:
        return EXIT_BAD_INPUT
    return EXIT_OK if all(r.clean for r in reports) else EXIT_FAILURE


def cmd_merge(args: argparse.Namespace) -> int:
    """Append an evaluator's log to the training log, atomically and idempotently."""
    from mlperf_grpo.merge import MergeError, OutputWriteError, merge_logs

    try:
        result = merge_logs(args.train, args.eval, args.output)
    except (MergeError, OutputWriteError) as err:
        raise BadInput(str(err)) from None
    state = "written" if result.changed else "unchanged (already merged)"
    print(f"{result.output}: {state}; {result.appended} eval line(s) after the training log, "
          f"{result.already_present} already present")
    if result.dropped_steps:
        print(f"dropped evaluations after the first pass: steps {result.dropped_steps}")
    if result.ignored_keys:
        print(f"ignored {len(result.ignored_keys)} line(s) of other keys in the evaluation log: {sorted(set(result.ignored_keys))}")
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    """Timeline report of one log as PNG or HTML."""
    from mlperf_grpo.check import UnreadableLog
    from mlperf_grpo.merge import OutputWriteError
    from mlperf_grpo.report import ReportError, write_report

    try:
        print(f"report: {write_report(args.log, args.output)}")
    except (UnreadableLog, ReportError, OutputWriteError) as err:
        raise BadInput(str(err)) from None
    return EXIT_OK


def _parse_gbs(text: str) -> int:
    from mlperf_grpo.rules import check_closed_global_batch_size

    try:
        value = int(text)
    except ValueError:
        raise BadInput(f"--global-batch-size must be an integer, got {text!r}") from None
    try:
        return check_closed_global_batch_size(value)
    except ValueError as err:
        raise BadInput(f"--global-batch-size: {err}") from None


def cmd_plan(args: argparse.Namespace) -> int:
    """Closed-division values derived from a GBS (or a config's GBS, with its differences)."""
    import json

    from mlperf_grpo.plan import build_plan, format_differences, format_plan

    if (args.global_batch_size is None) == (args.config is None):
        raise BadInput("give exactly one of --global-batch-size N and --config FILE")
    config = _config(args) if args.config else None
    gbs = _parse_gbs(args.global_batch_size) if config is None else config.global_batch_size
    try:
        plan = build_plan(gbs)
    except ValueError as err:
        raise BadInput(f"{args.config}: {err}") from None
    if config is not None:
        plan["config"] = {"file": args.config, "division": config.division,
                          "differences_from_closed": [vars(v) for v in config.closed_violations()]}
    if args.json:
        print(json.dumps(plan, indent=2, default=str))
        return EXIT_OK
    print(format_plan(plan))
    if config is not None:
        print(format_differences(config) or f"{args.config}: every value matches the closed rules")
    return EXIT_OK


def cmd_package(args: argparse.Namespace) -> int:
    """Submission layout for >= 3 runs, then package_checker, rcp_checker, summarizer."""
    from mlperf_grpo.package import PackageError, build_package, format_result

    try:
        result = build_package(args.run_dirs, args.system, args.output)
    except PackageError as err:
        raise BadInput(str(err)) from None
    print(format_result(result))
    return EXIT_OK if result.passed else EXIT_FAILURE


def build_parser() -> argparse.ArgumentParser:
    """The ``mlperf-grpo`` argument parser: one subcommand per workflow."""
    parser = argparse.ArgumentParser(prog="mlperf-grpo", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def add_train_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", help="run config (YAML); default: the built-in default run")
        p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"run directory (default {DEFAULT_OUTPUT})")

    def add_retain(p: argparse.ArgumentParser) -> None:
        p.add_argument("--retain-checkpoints", action="store_true",
                       help="keep the deferred checkpoints (also RETAIN_GRPO_CHECKPOINTS=1)")

    p = sub.add_parser("run", help="train then evaluate offline (the benchmark run)")
    add_train_args(p)
    add_retain(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("train", help="train and write deferred checkpoints")
    add_train_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("evaluate", help="evaluate a run's checkpoints offline and write run_stop")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    add_retain(p)
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("check", help="official compliance checker plus the offline-eval lint (exit 0 clean, 1 findings, 2 unreadable)")
    p.add_argument("logs", type=Path, nargs="+", metavar="LOG")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--run-dir", type=Path, help="run directory with checkpoints/ and eval/ (default: the log's folder when it is one)")
    p.add_argument("--no-run-dir", action="store_true", help="check the log alone, without its run directory")
    from mlperf_grpo.check.official import OFFICIAL_TIME_LIMIT_S

    p.add_argument("--time-limit-s", type=float, default=OFFICIAL_TIME_LIMIT_S, metavar="S",
                   help=f"limit for the official checkers on one log; past it the verdict is TIMEOUT (default {OFFICIAL_TIME_LIMIT_S:g})")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("merge", help="append an evaluator's own log to the training log")
    p.add_argument("--train", type=Path, required=True, metavar="TRAIN_LOG")
    p.add_argument("--eval", type=Path, required=True, metavar="EVAL_LOG")
    p.add_argument("--output", "-o", type=Path, required=True, metavar="OUT")
    p.set_defaults(func=cmd_merge)

    p = sub.add_parser("report", help="timeline of a run as PNG or HTML")
    p.add_argument("log", type=Path, metavar="LOG")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="FILE", help="FILE.png or FILE.html")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("plan", help="closed-division values derived from the global batch size")
    p.add_argument("--global-batch-size", metavar="N", help="a positive multiple of 16")
    p.add_argument("--config", help="a run config: its GBS, and which of its values differ from closed")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("package", help="submission layout of 3 runs, checked by the official checkers")
    p.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR")
    p.add_argument("--system", required=True, help="system name (systems/<system>.json)")
    p.add_argument("--output", type=Path, required=True, help="new folder for the submission")
    p.set_defaults(func=cmd_package)
    return parser


def _bad_input_types() -> tuple[type[BaseException], ...]:
    from mlperf_grpo.checkpoint import CheckpointError
    from mlperf_grpo.config import ConfigError
    from mlperf_grpo.evaluate.offline import EvaluationError
    from mlperf_grpo.mllog import LogWriteError
    from mlperf_grpo.model import ModelLoadError
    from mlperf_grpo.rundir import RunDirError

    return (BadInput, ConfigError, RunDirError, EvaluationError, CheckpointError, ModelLoadError, LogWriteError)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (see module docstring)."""
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return args.func(args)
    except BrokenPipeError:  # the reader went away (e.g. `check --json | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM during training (TrainingStopped)
        print(f"mlperf-grpo: {str(err) or 'interrupted'}", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as err:  # noqa: BLE001  (every error becomes one line)
        code = EXIT_BAD_INPUT if isinstance(err, _bad_input_types()) else EXIT_FAILURE
        print(f"mlperf-grpo: error: {err}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
