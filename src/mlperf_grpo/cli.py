"""``mlperf-grpo`` command line: one short function per subcommand.

Exit codes: 0 success, 3 aborted (no checkpoint passed), 2 bad input, 1 anything else,
130 Ctrl-C, 143 SIGTERM. Errors are one line on stderr, ``mlperf-grpo: error: ...``,
without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT, EXIT_ABORTED = 0, 1, 2, 3
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143  # 128 + SIGINT / SIGTERM, as a shell reports them
RUNS_DIR = Path("runs")
MODEL_SHAPE_NAMES = ("qwen3.5-397b-a17b",)
"""``plan --memory --model-shape`` choices (``memory_plan.MODEL_SHAPES``: the parser is built
without importing the library; a test keeps the two equal)."""

DESCRIPTION = """\
GRPO training with deferred offline evaluation for the MLPerf Training
qwen35_397b_grpo benchmark (ruleset 6.1.0), and tools for its MLPerf logs.

'mlperf-grpo run' trains (checkpoints from the first eval step on), evaluates the
checkpoints offline and writes one run_stop backdated to the first passing checkpoint's
weight-update time. With no --config it runs the built-in tiny default on the CPU in
seconds."""

EPILOG = """\
exit codes: 0 success (or clean), 1 failure or check findings, 2 bad input (one line on
stderr), 3 run aborted (no checkpoint passed), 130 Ctrl-C, 143 SIGTERM.
'mlperf-grpo COMMAND --help' describes each command."""


class BadInput(Exception):
    """Wrong input from the user: exit 2 with the message."""


def _config(args: argparse.Namespace):
    from mlperf_grpo.config import load_config

    return load_config(args.config)


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse reports anything else with exit 2)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def _new_run_dir() -> Path:
    """The default ``--output``, made now: ``runs/YYYYMMDD-HHMMSS`` (local time), ``-2``,
    ``-3``... appended when that name is taken, each try one atomic ``mkdir``, so two
    runs started in the same second never share a directory.

    Raises:
        RunDirError: ``runs/`` cannot be made or written.
    """
    from mlperf_grpo.rundir import reserve_new_run_dir

    return reserve_new_run_dir(RUNS_DIR, time.strftime("%Y%m%d-%H%M%S"))


def _print_outcome(outcome, run_dir: Path) -> int:
    status = outcome.status
    print(f"status: {status}")
    print(f"passing step: {outcome.passing_step if outcome.passing_step is not None else 'none'}")
    if status == "success":
        print(f"time-to-train: {outcome.time_to_train_ms / 60000:.3f} min (run_start to run_stop, from the log)")
    else:
        print("time-to-train: none (an aborted run has no score)")
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


def _start_training(args: argparse.Namespace):
    """Check everything cheap (config, environment, model, tokenizer, output), then say
    what differs from closed; returns ``(config, deferred, inputs)`` (the checked
    :class:`~mlperf_grpo.train.inputs.TrainingInputs`). Nothing is written; a missing
    ``--output`` becomes a new ``runs/YYYYMMDD-HHMMSS``."""
    from mlperf_grpo.rundir import RunDir
    from mlperf_grpo.train import collectives, ranks
    from mlperf_grpo.train.inputs import check_training_inputs

    config = _config(args)
    deferred = _deferred()
    ranks.check_layout(config, deferred=deferred)
    if deferred:  # a bad RETAIN_GRPO_CHECKPOINTS fails before training; the choice is recorded in run.json
        from mlperf_grpo.evaluate.offline import retain_requested

        args.retain_recorded = retain_requested(getattr(args, "retain_checkpoints", False))
    inputs = check_training_inputs(config, RunDir(args.output or RUNS_DIR), check_output=args.output is not None)
    if args.output is None:  # made by rank 0 once every check passed; its name on every rank
        args.output = collectives.broadcast_object(_new_run_dir() if ranks.is_writer() else None)
        args.made_output = ranks.is_writer()
    _note_open_differences(config)  # after every check: never before an error
    print(f"run directory: {args.output}")
    args.phase = "train"
    return config, deferred, inputs


def cmd_train(args: argparse.Namespace) -> int:
    """Train and write deferred checkpoints; no run_stop. DEFERRED_OFFLINE_EVAL=0: inline eval."""
    from mlperf_grpo.rundir import RunDir
    from mlperf_grpo.train.trainer import train

    config, deferred, inputs = _start_training(args)
    with _removed_if_unwritten(args):
        if not deferred:
            from mlperf_grpo.evaluate.inline import train_with_inline_eval

            outcome = train_with_inline_eval(config, RunDir(args.output), config_filename=args.config or "builtin-default",
                                             inputs=inputs)
            return _print_outcome(outcome, args.output)
        result = train(config, RunDir(args.output), config_filename=args.config or "builtin-default",
                       retain_checkpoints=args.retain_recorded, inputs=inputs)
    steps = result.checkpoint_steps
    published = f"step_{steps[0]}..step_{steps[-1]}" if steps else "none"
    print(f"trained {len(result.steps)} steps; checkpoints {published} in {args.output}/checkpoints")
    if result.stop_request is not None:
        print(f"training stopped by the evaluator's pass at step_{result.stop_request['passing_step']} "
              f"({args.output}/stop_training.json); the run_stop is the evaluator's ('evaluate --follow' merges it)")
    return EXIT_OK


@contextlib.contextmanager
def _removed_if_unwritten(args: argparse.Namespace):
    """A default ``--output`` this process made (:func:`_new_run_dir`) is removed again
    when training fails before writing any file of the run (a setup failure leaves no
    run behind); an ``--output`` given by the user is the trainer's to judge."""
    try:
        yield
    except BaseException:
        if getattr(args, "made_output", False):
            from mlperf_grpo.rundir import RunDir

            RunDir(args.output).remove_if_unwritten()
        raise


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Offline evaluation of a trained run (or of another trainer's series); writes run_stop.
    Under torchrun with WORLD_SIZE > 1 every rank is a worker (:func:`_evaluate_as_torchrun_rank`)."""
    torchrun_world = int(os.environ["WORLD_SIZE"]) if "TORCHELASTIC_RUN_ID" in os.environ else 0  # torch not imported yet
    if torchrun_world > 1:
        return _evaluate_as_torchrun_rank(args)
    return _evaluate(args, torchrun_world)


def _evaluate(args: argparse.Namespace, torchrun_world: int, ranks=None) -> int:
    """``evaluate`` in this process (``torchrun_world``: WORLD_SIZE under torchrun, this
    process its rank 0; 0 without torchrun; ``ranks``: the ``TorchrunRanks`` it joined when
    WORLD_SIZE > 1)."""
    if args.run_dir is not None and (args.workers or 1) > 1 and not torchrun_world:
        from mlperf_grpo.evaluate.prestart import prestart_rank_server

        prestart_rank_server("mlperf_grpo.evaluate.worker")  # the ranks' imports run while ours do
    from mlperf_grpo.evaluate.offline import evaluate_run

    if not _deferred():
        raise BadInput("DEFERRED_OFFLINE_EVAL=0 evaluates inline during training; 'evaluate' is the deferred driver: unset it or set it to 1")
    foreign = (args.checkpoints, args.mllog, args.config, args.eval_log, args.format)
    if args.stop_training_at_pass and not args.follow:
        raise BadInput("--stop-training-at-pass stops a training the evaluator follows: add --follow")
    if torchrun_world:
        _check_torchrun_args(args, foreign, torchrun_world)
    if args.follow:
        return _follow(args, foreign)
    if args.run_dir is not None:
        if any(v is not None for v in foreign):
            raise BadInput("give RUN_DIR (a run our trainer wrote) or --checkpoints/--mllog/--config (another "
                           "trainer's series), not both")
        args.phase = "evaluate"
        outcome = evaluate_run(args.run_dir, retain_checkpoints=args.retain_checkpoints,
                               workers=torchrun_world or args.workers, merge=_merge_in_place, ranks=ranks)
        return _print_outcome(outcome, args.run_dir)
    return _evaluate_foreign(args)


def _check_torchrun_args(args: argparse.Namespace, foreign: tuple, world: int) -> None:
    """Under torchrun the evaluation workers are its ``world`` ranks (one: the serial
    evaluator); refuse what does not fit them."""
    if args.workers not in (None, world):
        raise BadInput(f"under torchrun the evaluation workers are its {world} rank(s) (WORLD_SIZE {world}): leave out "
                       f"--workers, or give --workers {world}")
    if world == 1:
        return
    if args.follow:
        raise BadInput(f"--follow evaluates with one worker, not torchrun's {world} ranks: run it without torchrun "
                       "(or with one rank)")
    if args.run_dir is None or any(v is not None for v in foreign):
        raise BadInput(f"under torchrun ({world} ranks) evaluate takes RUN_DIR alone (a run our trainer wrote); another "
                       "trainer's series (--checkpoints/--mllog/--config) is evaluated by one worker: run it without torchrun")


def _evaluate_as_torchrun_rank(args: argparse.Namespace) -> int:
    """``evaluate`` under torchrun with WORLD_SIZE > 1: every rank is a worker with its
    engine. Rank 0 does all the rest as ``evaluate RUN_DIR --workers WORLD_SIZE`` does
    (checks the command, takes the lock, checks the log and series, plans, commits in step
    order, tears down, writes the summary), publishing the plan to the others through
    torchrun's store, and its exit code at the end; the others check nothing themselves,
    evaluate what rank 0 planned, print nothing and exit 0 (also when rank 0 found
    nothing to evaluate; on another node than rank 0's, with rank 0's failure), or exit 1
    with one line when rank 0 is gone (its heartbeat stood still: ``workers.TorchrunRanks``)."""
    from mlperf_grpo.evaluate.worker import join_evaluation
    from mlperf_grpo.evaluate.workers import joined_ranks

    with joined_ranks() as ranks:
        if ranks.rank != 0:
            return join_evaluation(args.run_dir, ranks)
        exit_code = _evaluate(args, ranks.world_size, ranks)
        ranks.conclude(exit_code)
        return exit_code


def _follow(args: argparse.Namespace, foreign: tuple) -> int:
    """``evaluate RUN_DIR --follow``: evaluate checkpoints while the training publishes
    them, then merge the follower's log into the training log (evaluate/follow.py)."""
    from mlperf_grpo.evaluate.follow import follow_run

    if args.run_dir is None:
        raise BadInput("--follow follows a run our trainer is writing: give its RUN_DIR (the --output of "
                       "'mlperf-grpo train')")
    if any(v is not None for v in foreign):
        raise BadInput("--follow follows a run directory of ours: leave out --checkpoints/--mllog/--config/"
                       "--eval-log/--format")
    if args.workers not in (None, 1):
        raise BadInput("--follow evaluates with one worker (checkpoints arrive one per training step); leave out "
                       "--workers, or evaluate the finished run with 'mlperf-grpo evaluate RUN_DIR --workers N'")
    args.phase = "evaluate"
    outcome = follow_run(args.run_dir, _merge_in_place, retain_checkpoints=args.retain_checkpoints,
                         stop_training_at_pass=args.stop_training_at_pass)
    return _print_outcome(outcome, args.run_dir)


def _merge_in_place(train_log: Path, eval_log: Path) -> None:
    """A followed run's end: ``mlperf-grpo merge --train LOG --eval EVAL_LOG -o LOG``."""
    from mlperf_grpo.merge import MergeError, merge_logs

    try:
        result = merge_logs(train_log, eval_log, train_log)
    except MergeError as err:
        raise MergeError(f"cannot merge {eval_log} into {train_log}: {err}") from None
    print(f"merged {eval_log} into {train_log}: {result.appended} eval line(s) appended")


def _evaluate_foreign(args: argparse.Namespace) -> int:
    """``evaluate --checkpoints DIR --mllog LOG --config C``: validate the training log
    (check's messages), then evaluate the series through the offline evaluator."""
    from mlperf_grpo.check.training_log import TrainingLogError, check_training_log
    from mlperf_grpo.evaluate.foreign import build_source, evaluate_checkpoints
    from mlperf_grpo.evaluate.worker_group import check_worker_groups
    from mlperf_grpo.evaluate.offline import retain_requested

    missing = [flag for flag, v in (("--checkpoints", args.checkpoints), ("--mllog", args.mllog), ("--config", args.config)) if v is None]
    if missing:
        raise BadInput(f"evaluate needs RUN_DIR, or --checkpoints DIR --mllog LOG --config FILE (missing {', '.join(missing)})")
    if args.workers not in (None, 1):
        raise BadInput("--workers applies to RUN_DIR (a run our trainer wrote); another trainer's series is evaluated by one worker")
    retain = retain_requested(args.retain_checkpoints)
    config = _config(args)
    check_worker_groups(config, None)  # another trainer's series: one worker of one rank
    if args.eval_log is not None and args.eval_log.resolve() == args.mllog.resolve():
        raise BadInput("--eval-log names the training log; leave it out to append to the training log")
    steps = build_source(args.checkpoints, args.format or "auto", config).published_steps()
    try:
        check_training_log(args.mllog, config.global_batch_size, max(steps, default=None))
    except TrainingLogError as err:
        raise BadInput(str(err)) from None
    args.phase, args.run_dir = "evaluate", args.checkpoints
    outcome = evaluate_checkpoints(args.checkpoints, args.mllog, config, args.format or "auto", args.eval_log, retain)
    return _print_outcome(outcome, args.checkpoints)


def cmd_run(args: argparse.Namespace) -> int:
    """Train, then evaluate offline: the whole benchmark run."""
    from mlperf_grpo.evaluate.offline import evaluate_run

    from mlperf_grpo.train import ranks

    if not _deferred():
        return cmd_train(args)  # inline evaluation: training writes run_stop itself
    cmd_train(args)
    if not ranks.is_writer():
        return EXIT_OK  # under torchrun rank 0 alone evaluates the run it wrote
    args.phase = "evaluate"
    outcome = evaluate_run(args.output, retain_checkpoints=args.retain_checkpoints, merge=_merge_in_place)
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
        _say(f"mlperf-grpo: error: {message}")
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
    if result.tie:
        print(f"tied to the training: {result.tie}")
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

    memory_options = [f"--{name.replace('_', '-')}" for name in ("model_shape", "model_config", "world_size")
                      if getattr(args, name) is not None]
    if args.memory:
        if args.global_batch_size is not None or args.config is not None:
            raise BadInput("plan --memory plans memory, not a GBS: drop --global-batch-size / --config")
        return _plan_memory(args)
    if memory_options:
        raise BadInput(f"{' '.join(memory_options)} belong to plan --memory: add --memory")
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


def _plan_memory(args: argparse.Namespace) -> int:
    """``plan --memory``: per-rank bytes of a model shape at N ranks and T (memory_plan.py)."""
    import json

    from mlperf_grpo import memory_plan

    if (args.model_shape is None) == (args.model_config is None):
        raise BadInput(f"plan --memory: give exactly one of --model-shape {{{','.join(memory_plan.MODEL_SHAPES)}}} "
                       "and --model-config PATH")
    if args.world_size is None:
        raise BadInput("plan --memory: give --world-size N (the ranks, one accelerator each)")
    model = (memory_plan.MODEL_SHAPES[args.model_shape] if args.model_shape
             else memory_plan.load_model_config(args.model_config))
    plan = memory_plan.plan_memory(model, args.world_size, args.tensor_parallel_size, args.dtype, args.max_in_flight)
    print(json.dumps(plan.to_json(), indent=2) if args.json else memory_plan.format_memory_plan(plan))
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
    from mlperf_grpo import __version__

    parser = argparse.ArgumentParser(
        prog="mlperf-grpo", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_train_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", help="run config (YAML); default: the built-in default run")
        p.add_argument("--output", type=Path, default=None, metavar="DIR",
                       help=f"new run directory (default: a new {RUNS_DIR}/YYYYMMDD-HHMMSS); "
                            "one that already holds a run is refused")

    def add_retain(p: argparse.ArgumentParser) -> None:
        p.add_argument("--retain-checkpoints", action="store_true",
                       help="keep the deferred checkpoints (also RETAIN_GRPO_CHECKPOINTS=1)")

    p = sub.add_parser("run", help="train then evaluate offline (the benchmark run)", description="train then evaluate offline (the benchmark run)")
    add_train_args(p)
    add_retain(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("train", help="train and write deferred checkpoints", description="train and write deferred checkpoints")
    add_train_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("evaluate", help="evaluate a run's checkpoints offline and write run_stop",
                       description="evaluate a run's checkpoints offline and write run_stop: RUN_DIR (a run of "
                                   "'train'), or another trainer's series with --checkpoints, --mllog and --config")
    p.add_argument("run_dir", type=Path, nargs="?", metavar="RUN_DIR", help="the --output of 'train' or 'run'")
    p.add_argument("--checkpoints", type=Path, metavar="DIR",
                   help="another trainer's series: NeMo-RL step_N/ dirs, or a manifest.jsonl of Hugging Face dirs")
    p.add_argument("--mllog", type=Path, metavar="LOG", help="the MLPerf log the series was trained with")
    p.add_argument("--config", help="a run config with the series' model, task, validation and batch size")
    p.add_argument("--format", choices=("auto", "ours", "nemo-rl", "hf-dirs"), default=None,
                   help="the series' layout (default: auto, detected)")
    p.add_argument("--eval-log", type=Path, metavar="PATH",
                   help="write evaluations and run_stop to this log instead of --mllog (then 'mlperf-grpo merge')")
    p.add_argument("--workers", type=_positive_int, default=None, metavar="N",
                   help="engines evaluating in parallel, one per GPU (or CPU process); the log is committed in step "
                        "order, the same for any N (default: the config's validation.workers; under torchrun its "
                        "WORLD_SIZE ranks, on any number of nodes)")
    p.add_argument("--follow", action="store_true",
                   help="evaluate RUN_DIR's checkpoints as its running training publishes them (one worker), logging "
                        "to RUN_DIR/eval/mlperf_eval.log; merged into the training log once training ended")
    p.add_argument("--stop-training-at-pass", action="store_true",
                   help="with --follow: at the first pass, write RUN_DIR/stop_training.json; the trainer stops after "
                        "the step it is on")
    add_retain(p)
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("check", help="official compliance checker plus the offline-eval lint (exit 0 clean, 1 findings, 2 unreadable)", description="official compliance checker plus the offline-eval lint (exit 0 clean, 1 findings, 2 unreadable)")
    p.add_argument("logs", type=Path, nargs="+", metavar="LOG", help="MLPerf log file(s), e.g. RUN_DIR/mlperf.log")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--run-dir", type=Path, help="run directory with checkpoints/ and eval/ (default: the log's folder when it is one)")
    p.add_argument("--no-run-dir", action="store_true", help="check the log alone, without its run directory")
    from mlperf_grpo.check.official import OFFICIAL_TIME_LIMIT_S

    p.add_argument("--time-limit-s", type=float, default=OFFICIAL_TIME_LIMIT_S, metavar="S",
                   help=f"limit for the official checkers on one log; past it the verdict is TIMEOUT (default {OFFICIAL_TIME_LIMIT_S:g})")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("merge", help="append an evaluator's own log to the training log", description="append an evaluator's own log to the training log")
    p.add_argument("--train", type=Path, required=True, metavar="TRAIN_LOG")
    p.add_argument("--eval", type=Path, required=True, metavar="EVAL_LOG")
    p.add_argument("--output", "-o", type=Path, required=True, metavar="OUT")
    p.set_defaults(func=cmd_merge)

    p = sub.add_parser("report", help="timeline of a run as PNG or HTML", description="timeline of a run as PNG or HTML")
    p.add_argument("log", type=Path, metavar="LOG", help="MLPerf log file, e.g. RUN_DIR/mlperf.log")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="FILE", help="FILE.png or FILE.html")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("plan", help="closed-division values derived from the global batch size", description="closed-division values derived from the global batch size")
    p.add_argument("--global-batch-size", metavar="N", help="a positive multiple of 16")
    p.add_argument("--config", help="a run config: its GBS, and which of its values differ from closed")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--memory", action="store_true",
                   help="per-rank memory of a training layout instead (with --model-shape or --model-config and "
                        "--world-size)")
    p.add_argument("--model-shape", choices=sorted(MODEL_SHAPE_NAMES), help="--memory: a named model shape")
    p.add_argument("--model-config", type=Path, metavar="PATH", help="--memory: a model's config.json (or its folder)")
    p.add_argument("--world-size", type=_positive_int, metavar="N", help="--memory: ranks, one accelerator each")
    p.add_argument("--tensor-parallel-size", type=_positive_int, default=1, metavar="T",
                   help="--memory: inference.tensor_parallel_size, the sharded engine's group (default 1)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="--memory: model.dtype (default bfloat16)")
    p.add_argument("--max-in-flight", type=_positive_int, default=2, metavar="K",
                   help="--memory: checkpoint.max_in_flight (default 2)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("package", help="submission layout of 3 runs, checked by the official checkers", description="submission layout of 3 runs, checked by the official checkers")
    p.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="finished run directories, 3 or more")
    p.add_argument("--system", required=True, help="system name (systems/<system>.json)")
    p.add_argument("--output", type=Path, required=True, help="new folder for the submission")
    p.set_defaults(func=cmd_package)
    return parser


_BAD_INPUT_ERRORS = (
    ("mlperf_grpo.checkpoint", "CheckpointError"),
    ("mlperf_grpo.config", "ConfigError"),
    ("mlperf_grpo.evaluate.series", "EvaluationError"),
    ("mlperf_grpo.mllog", "LogWriteError"),
    ("mlperf_grpo.model", "ModelLoadError"),
    ("mlperf_grpo.rundir", "RunDirError"),
)
"""(module, exception) pairs of the library's bad-input errors: exit 2."""


def _bad_input_types() -> tuple[type[BaseException], ...]:
    """:class:`BadInput` and those of :data:`_BAD_INPUT_ERRORS` whose module is already
    imported: an error of a module never loaded cannot have been raised, and importing one
    here would load torch (``checkpoint``, ``model``) on a log tool's error path."""
    loaded = (getattr(sys.modules[module], name) for module, name in _BAD_INPUT_ERRORS if module in sys.modules)
    return (BadInput, *loaded)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (see module docstring)."""
    from mlperf_grpo.train.stop import GracefulStop, Terminated

    args = build_parser().parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        with GracefulStop(), _process_group(args):  # SIGTERM is handled like Ctrl-C for every command
            return args.func(args)
    except BrokenPipeError:  # the reader went away (e.g. `check --json | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM (Terminated)
        terminated = isinstance(err, Terminated)
        _say(f"mlperf-grpo: {_rank_tag()}{_stop_message(args, str(err) or ('stopped by SIGTERM' if terminated else 'interrupted (Ctrl-C)'))}")
        _note_unfinished_run(args)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    except Exception as err:  # noqa: BLE001  (every error becomes one line)
        code = EXIT_BAD_INPUT if isinstance(err, _bad_input_types()) else EXIT_FAILURE
        _say(f"mlperf-grpo: {_rank_tag()}error: {err}")
        _note_unfinished_run(args)
        return code


def _say(line: str) -> None:
    """``line`` and its newline to stderr in one write: torchrun ranks share the
    terminal's stderr, and with ``print`` (text, then newline: two writes when stderr is
    unbuffered) two ranks' error lines could run into one."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _process_group(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """``train``/``run`` under torchrun: the ranks' process group (train/ranks.py);
    ``evaluate``: no process group (its ranks share torchrun's store), rank 0's stdout only."""
    if args.command not in ("train", "run") and not (args.command == "evaluate" and "TORCHELASTIC_RUN_ID" in os.environ):
        return contextlib.nullcontext()  # (evaluate imports nothing before it starts its fork server)
    from mlperf_grpo.train import ranks

    return ranks.process_group() if args.command != "evaluate" else ranks.rank_zero_stdout()


def _torchrun_rank() -> str:
    """This process's ``RANK`` under torchrun, else ``"0"`` (torch is not imported)."""
    return os.environ.get("RANK", "0") if os.environ.get("TORCHELASTIC_RUN_ID") else "0"


def _rank_tag() -> str:
    """``"rank R: "`` in a torchrun worker other than rank 0 (its lines interleave with rank 0's)."""
    rank = _torchrun_rank()
    return "" if rank == "0" else f"rank {rank}: "


def _stop_message(args: argparse.Namespace, what: str) -> str:
    """The one line for a stopped command: during evaluation, that nothing partial was
    logged and how to resume."""
    if getattr(args, "phase", None) != "evaluate":
        return what
    if args.command == "evaluate" and args.checkpoints is not None:
        again = f"mlperf-grpo evaluate --checkpoints {args.checkpoints} --mllog {args.mllog} --config {args.config}"
        again += f" --eval-log {args.eval_log}" if args.eval_log is not None else ""
    else:
        again = f"mlperf-grpo evaluate {args.run_dir if args.command == 'evaluate' else args.output}"
        again += " --follow" if getattr(args, "follow", False) else ""
    return (f"evaluation {what}; the log holds only whole evaluations (no partial one, no run_stop): "
            f"'{again}' resumes it")


def _note_unfinished_run(args: argparse.Namespace) -> None:
    """After training ended early with checkpoints published: how the run is finished, in
    one write. Under torchrun only rank 0 says it: it writes the checkpoints and has
    published those in flight before its stop reaches the CLI, while another rank's view
    of ``checkpoints/`` can be taken before that (a list that is not the final one)."""
    if getattr(args, "phase", None) != "train" or _torchrun_rank() != "0":
        return
    from mlperf_grpo.rundir import RunDir

    run = RunDir(args.output)
    steps = run.published_steps()
    if steps and not run.summary_file.exists():
        kept = " (and keeps them: the run's choice to retain its checkpoints is in run.json)" if getattr(
            args, "retain_recorded", False) else ""
        _say(f"note: training ended early with checkpoints step_{steps[0]}..step_{steps[-1]} published "
             f"and no run_stop: 'mlperf-grpo evaluate {args.output}' evaluates them and writes the run's run_stop{kept}")


if __name__ == "__main__":
    sys.exit(main())
