"""``mlperf-grpo`` command line: one short function per subcommand.

Each builds the command's request (:mod:`mlperf_grpo.cli.requests`, which checks
it), calls its one library entry (:mod:`mlperf_grpo.cli.commands`, or the log tool's) and
prints the result. Exit codes: 0 success, 3 aborted (no checkpoint passed), 2 bad input,
1 anything else, 130 Ctrl-C, 143 SIGTERM. Errors are one line on stderr,
``mlperf-grpo: error: ...``, without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from mlperf_grpo.cli import commands
from mlperf_grpo.cli.commands import Progress, say
from mlperf_grpo.cli.parser import build_parser
from mlperf_grpo.cli.requests import CheckRequest, EvaluateRequest, PlanRequest, TrainRequest, torchrun_world_size
from mlperf_grpo.errors import (
    BAD_INPUT_ERRORS,
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
    BadInput,
    outcome_exit_code,
)


def _print_outcome(outcome, where: str) -> int:
    """The outcome's lines; ``where``: the ``run directory: DIR`` (or ``checkpoints: DIR``) line."""
    status = outcome.status
    print(f"status: {status}")
    print(f"passing step: {outcome.passing_step if outcome.passing_step is not None else 'none'}")
    if status == "success":
        print(f"time-to-train: {outcome.time_to_train_ms / 60000:.3f} min (run_start to run_stop, from the log)")
    else:
        print("time-to-train: none (an aborted run has no score)")
    print(f"log: {outcome.mllog_file}")
    print(where)
    return outcome_exit_code(status)


def cmd_train(args: argparse.Namespace, progress: Progress) -> int:
    """Train and write deferred checkpoints; no run_stop. DEFERRED_OFFLINE_EVAL=0: inline eval.
    ``run``: then evaluate the checkpoints offline."""
    request = TrainRequest.from_args(args)
    result = commands.train(request, progress)
    if not request.deferred:  # inline evaluation: training wrote run_stop itself
        return _print_outcome(result, f"run directory: {progress.run_dir}")
    steps, output = result.checkpoint_steps, progress.run_dir
    published = f"step_{steps[0]}..step_{steps[-1]}" if steps else "none"
    print(f"trained {len(result.steps)} steps; checkpoints {published} in {output}/checkpoints")
    if result.stop_request is not None:
        print(f"training stopped by the evaluator's pass at step_{result.stop_request['passing_step']} "
              f"({output}/stop_training.json); the run_stop is the evaluator's ('evaluate --follow' merges it)")
    if request.evaluate_after:
        outcome = commands.evaluate_trained(request, progress)
        return EXIT_OK if outcome is None else _print_outcome(outcome, f"run directory: {output}")
    return EXIT_OK


def cmd_evaluate(args: argparse.Namespace, progress: Progress) -> int:
    """Offline evaluation of a trained run (or of another trainer's series); writes run_stop.
    Under torchrun with WORLD_SIZE > 1 every rank is a worker: rank 0 does all the rest as
    ``evaluate RUN_DIR --workers WORLD_SIZE`` does, publishing the plan through torchrun's
    store; the others check nothing themselves, evaluate what rank 0 planned, print
    nothing and exit 0, or exit 1 with one line when rank 0 is gone
    (``evaluate.launch.TorchrunRanks``)."""
    world = torchrun_world_size()
    if world <= 1:
        return _evaluate(EvaluateRequest.from_args(args, world), progress)
    from mlperf_grpo.evaluate.launch import joined_ranks
    from mlperf_grpo.evaluate.worker import join_evaluation

    with joined_ranks() as ranks:
        if ranks.rank != 0:
            return join_evaluation(args.run_dir, ranks)
        exit_code = _evaluate(EvaluateRequest.from_args(args, world), progress, ranks)
        ranks.conclude(exit_code)
        return exit_code


def _evaluate(request: EvaluateRequest, progress: Progress, ranks=None) -> int:
    progress.resume = request.resume_command()
    outcome = commands.evaluate(request, progress, ranks)
    kind = "checkpoints" if request.mode == "foreign" else "run directory"
    return _print_outcome(outcome, f"{kind}: {request.where}")


def cmd_check(args: argparse.Namespace, progress: Progress) -> int:
    """Official checkers plus the offline-eval lint: 0 clean, 1 not clean, 2 a log unreadable.

    Every readable log is reported even when another is unreadable; an unreadable log is
    one ``mlperf-grpo: error:`` line on stderr (with ``--json``: an entry with ``error``).
    """
    import json

    from mlperf_grpo.logs.check import UnreadableLog, check_log
    from mlperf_grpo.logs.check.render import format_reports, to_json

    request = CheckRequest.from_args(args)
    if (problem := request.problem()) is not None:
        if request.json:
            print(json.dumps({"clean": False, "error": problem, "logs": []}, indent=2))
        raise BadInput(problem)
    reports, errors = [], []
    for path in request.logs:
        try:
            reports.append(check_log(path, run_dir=request.run_dir, auto_run_dir=not request.no_run_dir,
                                     time_limit_s=request.time_limit_s))
        except UnreadableLog as err:
            errors.append((path, str(err)))
    if request.json:
        print(to_json(reports, errors))
    elif reports:
        print(format_reports(reports))
    for _, message in errors:
        say(f"mlperf-grpo: error: {message}")
    if errors:
        return EXIT_BAD_INPUT
    return EXIT_OK if all(r.clean for r in reports) else EXIT_FAILURE


def cmd_merge(args: argparse.Namespace, progress: Progress) -> int:
    """Append an evaluator's log to the training log, atomically and idempotently."""
    from mlperf_grpo.logs.merge import MergeError, OutputWriteError, merge_logs

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


def cmd_report(args: argparse.Namespace, progress: Progress) -> int:
    """Timeline report of one log as PNG or HTML."""
    from mlperf_grpo.logs.check import UnreadableLog
    from mlperf_grpo.logs.merge import OutputWriteError
    from mlperf_grpo.logs.report.write import ReportError, write_report

    try:
        print(f"report: {write_report(args.log, args.output)}")
    except (UnreadableLog, ReportError, OutputWriteError) as err:
        raise BadInput(str(err)) from None
    return EXIT_OK


def cmd_plan(args: argparse.Namespace, progress: Progress) -> int:
    """Closed-division values derived from a GBS (or a config's GBS, with its
    differences), or with ``--memory`` the per-rank memory of a layout."""
    print(commands.plan(PlanRequest.from_args(args)))
    return EXIT_OK


def cmd_package(args: argparse.Namespace, progress: Progress) -> int:
    """Submission layout for >= 3 runs, then package_checker, rcp_checker, summarizer."""
    from mlperf_grpo.logs.package import PackageError, build_package, format_result

    try:
        result = build_package(args.run_dirs, args.system, args.output)
    except PackageError as err:
        raise BadInput(str(err)) from None
    print(format_result(result))
    return EXIT_OK if result.passed else EXIT_FAILURE


COMMANDS = {"run": cmd_train, "train": cmd_train, "evaluate": cmd_evaluate, "check": cmd_check, "merge": cmd_merge,
            "report": cmd_report, "plan": cmd_plan, "package": cmd_package}
"""The function of each subcommand: ``(args, progress) -> exit code``."""


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (see module docstring)."""
    from mlperf_grpo.graceful_stop import GracefulStop, Terminated

    try:
        args = build_parser().parse_args(argv)
    except BadInput as err:  # argparse's refusal, in one line
        say(f"mlperf-grpo: error: {err}")
        return EXIT_BAD_INPUT
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    progress = Progress()
    try:
        with GracefulStop(), _process_group(args):  # SIGTERM is handled like Ctrl-C for every command
            return COMMANDS[args.command](args, progress)
    except BrokenPipeError:  # the reader went away (e.g. `check --json | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM (Terminated)
        terminated = isinstance(err, Terminated)
        what = str(err) or ("stopped by SIGTERM" if terminated else "interrupted (Ctrl-C)")
        say(f"mlperf-grpo: {_rank_tag()}{_stop_message(progress, what)}{_removed_run_dir(progress)}")
        _note_unfinished_run(progress)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    except Exception as err:  # noqa: BLE001  (every error becomes one line)
        code = EXIT_BAD_INPUT if isinstance(err, BAD_INPUT_ERRORS) else EXIT_FAILURE
        say(f"mlperf-grpo: {_rank_tag()}error: {err}{_removed_run_dir(progress)}")
        _note_unfinished_run(progress)
        return code


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


def _stop_message(progress: Progress, what: str) -> str:
    """The one line for a stopped command: during evaluation, that nothing partial was
    logged and how to resume."""
    if progress.phase != "evaluate":
        return what
    again = progress.resume or f"mlperf-grpo evaluate {progress.run_dir}"
    if _run_stop_logged(progress):  # stopped in the teardown: the result stands
        return (f"evaluation {what} after the run_stop was logged (the result stands): '{again}' finishes the "
                "teardown and reports it")
    return (f"evaluation {what}; the log holds only whole evaluations (no partial one, no run_stop): "
            f"'{again}' resumes it")


def _removed_run_dir(progress: Progress) -> str:
    """What the stop or error line adds when training printed ``run directory: DIR`` and
    its set-up then failed and removed DIR again (nothing of the run was written in it);
    else ""."""
    if progress.phase != "train" or progress.run_dir is None or os.path.lexists(progress.run_dir):
        return ""
    return f" (run directory {progress.run_dir} removed: the run wrote nothing in it)"


def _run_stop_logged(progress: Progress) -> bool:
    """Whether the log the evaluation writes (``progress.log_file``, else the run's: its
    ``run.json``'s log and a follower's ``eval/mlperf_eval.log``) holds a ``run_stop``;
    False when it cannot be read (the message then stays the cautious one)."""
    from mlperf_grpo.config.rundir import RunDir
    from mlperf_grpo.logs.mllog import read_log

    try:
        if progress.log_file is not None:
            logs = [progress.log_file]
        elif progress.run_dir is None:
            return False
        else:
            run = RunDir(progress.run_dir)
            logs = [run.load()[1], run.follow_log]
        return any(path.is_file() and read_log(path).find("run_stop") for path in logs)
    except (OSError, ValueError, *BAD_INPUT_ERRORS):
        return False


def _note_unfinished_run(progress: Progress) -> None:
    """After training ended early with checkpoints published: how the run is finished, in
    one write. Under torchrun only rank 0 says it: it writes the checkpoints and has
    published those in flight before its stop reaches the CLI, while another rank's view
    of ``checkpoints/`` can be taken before that (a list that is not the final one)."""
    if progress.phase != "train" or _torchrun_rank() != "0":
        return
    from mlperf_grpo.config.rundir import RunDir

    run = RunDir(progress.run_dir)
    steps = run.published_steps()
    if steps and not run.summary_file.exists():
        kept = (" (and keeps them: the run's choice to retain its checkpoints is in run.json)"
                if progress.retain_recorded else "")
        say(f"note: training ended early with checkpoints step_{steps[0]}..step_{steps[-1]} published "
            f"and no run_stop: 'mlperf-grpo evaluate {progress.run_dir}' evaluates them and writes the run's run_stop{kept}")


if __name__ == "__main__":
    sys.exit(main())
