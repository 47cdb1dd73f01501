"""The ``mlperf-grpo`` argument parser (built without importing the library: ``--help``
and a bad flag cost no torch import). A bad value, a missing or an unknown argument is
one line on stderr, ``mlperf-grpo: error: COMMAND: ...`` naming the ``--help`` to read,
exit 2 (:class:`OneLineParser`), not argparse's usage block."""

from __future__ import annotations

import argparse
from pathlib import Path

from mlperf_grpo.cli.requests import MODEL_SHAPE_NAMES
from mlperf_grpo.errors import BadInput

RUNS_DIR = Path("runs")

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


class UsageError(BadInput):
    """A command line argparse refuses (exit 2); the message is one line."""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose refusals raise :class:`UsageError` with one line (the
    subcommand, argparse's reason, the ``--help`` to read) instead of printing the usage
    block and exiting."""

    def error(self, message: str):
        command = self.prog.removeprefix("mlperf-grpo").strip()
        where = f"{command}: " if command else ""
        raise UsageError(f"{where}{message} (see 'mlperf-grpo {command + ' ' if command else ''}--help')")


def parse_args_one_line(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args(argv)`` for a script's own parser (``benchmarks/``): a refusal,
    and any ``parser.error`` call, prints ``PROG: error: REASON (see PROG --help)`` on
    stderr and exits 2, without the usage block."""

    def error(message: str):
        parser.exit(2, f"{parser.prog}: error: {message} (see {parser.prog} --help)\n")

    parser.error = error
    return parser.parse_args(argv)


def _path(text: str) -> Path:
    """argparse type: a path that is not empty (``Path("")`` is the working directory:
    ``--output ''`` trained into it)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty: give a path (the working directory is '.')")
    return Path(text)


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse reports anything else with exit 2)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``mlperf-grpo`` argument parser: one subcommand per workflow (``args.command``).

    ``parse_args`` raises :class:`UsageError` for a command line it refuses.
    """
    from mlperf_grpo import __version__

    parser = OneLineParser(
        prog="mlperf-grpo", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)
    for add in (_add_run_and_train, _add_evaluate, _add_check, _add_merge_and_report, _add_plan, _add_package):
        add(sub)
    return parser


def _add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="run config (YAML); default: the built-in default run")
    p.add_argument("--output", type=_path, default=None, metavar="DIR",
                   help=f"new run directory (default: a new {RUNS_DIR}/YYYYMMDD-HHMMSS); "
                        "one that already holds a run is refused")


def _add_retain(p: argparse.ArgumentParser) -> None:
    p.add_argument("--retain-checkpoints", action="store_true",
                   help="keep the deferred checkpoints (also RETAIN_GRPO_CHECKPOINTS=1)")


def _add_run_and_train(sub) -> None:
    """``run`` and ``train``."""

    p = sub.add_parser("run", help="train then evaluate offline (the benchmark run)", description="train then evaluate offline (the benchmark run)")
    _add_train_args(p)
    _add_retain(p)

    p = sub.add_parser("train", help="train and write deferred checkpoints", description="train and write deferred checkpoints")
    _add_train_args(p)


def _add_evaluate(sub) -> None:
    """``evaluate``: a run directory of ours, or another trainer's series."""

    p = sub.add_parser("evaluate", help="evaluate a run's checkpoints offline and write run_stop",
                       description="evaluate a run's checkpoints offline and write run_stop: RUN_DIR (a run of "
                                   "'train'), or another trainer's series with --checkpoints, --mllog and --config")
    p.add_argument("run_dir", type=_path, nargs="?", metavar="RUN_DIR", help="the --output of 'train' or 'run'")
    p.add_argument("--checkpoints", type=_path, metavar="DIR",
                   help="another trainer's series: NeMo-RL step_N/ dirs, or a manifest.jsonl of Hugging Face dirs")
    p.add_argument("--mllog", type=_path, metavar="LOG", help="the MLPerf log the series was trained with")
    p.add_argument("--config", help="a run config with the series' model, task, validation and batch size")
    p.add_argument("--format", choices=("auto", "ours", "nemo-rl", "hf-dirs"), default=None,
                   help="the series' layout (default: auto, detected)")
    p.add_argument("--eval-log", type=_path, metavar="PATH",
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
    _add_retain(p)


def _add_check(sub) -> None:
    """``check``: the official checkers plus the lint."""

    p = sub.add_parser("check", help="official compliance checker plus the offline-eval lint (exit 0 clean, 1 findings, 2 unreadable)", description="official compliance checker plus the offline-eval lint (exit 0 clean, 1 findings, 2 unreadable)")
    p.add_argument("logs", type=_path, nargs="+", metavar="LOG", help="MLPerf log file(s), e.g. RUN_DIR/mlperf.log")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--run-dir", type=_path, help="run directory with checkpoints/ and eval/ (default: the log's folder when it is one)")
    p.add_argument("--no-run-dir", action="store_true", help="check the log alone, without its run directory")
    from mlperf_grpo.logs.check.official import OFFICIAL_TIME_LIMIT_S

    p.add_argument("--time-limit-s", type=float, default=OFFICIAL_TIME_LIMIT_S, metavar="S",
                   help=f"limit for the official checkers on one log; past it the verdict is TIMEOUT (default {OFFICIAL_TIME_LIMIT_S:g})")


def _add_merge_and_report(sub) -> None:
    """``merge`` and ``report``."""

    p = sub.add_parser("merge", help="append an evaluator's own log to the training log", description="append an evaluator's own log to the training log")
    p.add_argument("--train", type=_path, required=True, metavar="TRAIN_LOG")
    p.add_argument("--eval", type=_path, required=True, metavar="EVAL_LOG")
    p.add_argument("--output", "-o", type=_path, required=True, metavar="OUT")

    p = sub.add_parser("report", help="timeline of a run as PNG or HTML", description="timeline of a run as PNG or HTML")
    p.add_argument("log", type=_path, metavar="LOG", help="MLPerf log file, e.g. RUN_DIR/mlperf.log")
    p.add_argument("-o", "--output", type=_path, required=True, metavar="FILE", help="FILE.png or FILE.html")


def _add_plan(sub) -> None:
    """``plan``: closed values of a GBS, or ``--memory``."""

    p = sub.add_parser("plan", help="closed-division values derived from the global batch size", description="closed-division values derived from the global batch size")
    p.add_argument("--global-batch-size", metavar="N", help="a positive multiple of 16")
    p.add_argument("--config", help="a run config: its GBS, and which of its values differ from closed")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--memory", action="store_true",
                   help="per-rank memory of a training layout instead (with --model-shape or --model-config and "
                        "--world-size)")
    p.add_argument("--model-shape", choices=sorted(MODEL_SHAPE_NAMES), help="--memory: a named model shape")
    p.add_argument("--model-config", type=_path, metavar="PATH", help="--memory: a model's config.json (or its folder)")
    p.add_argument("--world-size", type=_positive_int, metavar="N", help="--memory: ranks, one accelerator each")
    p.add_argument("--tensor-parallel-size", type=_positive_int, default=1, metavar="T",
                   help="--memory: inference.tensor_parallel_size, the sharded engine's group (default 1)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="--memory: model.dtype (default bfloat16)")
    p.add_argument("--max-in-flight", type=_positive_int, default=2, metavar="K",
                   help="--memory: checkpoint.max_in_flight (default 2)")
    p.add_argument("--trajectory-tokens", type=_positive_int, metavar="L",
                   help="--memory: also the sequences' bytes (activations, log-prob chunks, KV cache) for rows of "
                        "L tokens (prompt + completion)")
    p.add_argument("--micro-batch-tokens", type=_positive_int, metavar="B",
                   help="--memory --trajectory-tokens: grpo.micro_batch_tokens (default 16384)")
    p.add_argument("--prompt-tokens", type=_positive_int, metavar="P",
                   help="--memory --trajectory-tokens: the longest prompt the engine prefills (default L: an agent "
                        "turn re-prefills its conversation)")
    p.add_argument("--rows", type=_positive_int, metavar="R",
                   help="--memory --trajectory-tokens: rows a rank trains and its engine decodes (default 256 / N)")


def _add_package(sub) -> None:
    """``package``: a submission of >= 3 runs."""

    p = sub.add_parser("package", help="submission layout of 3 runs, checked by the official checkers", description="submission layout of 3 runs, checked by the official checkers")
    p.add_argument("run_dirs", type=_path, nargs="+", metavar="RUN_DIR", help="finished run directories, 3 or more")
    p.add_argument("--system", required=True, help="system name (systems/<system>.json)")
    p.add_argument("--output", type=_path, required=True, help="new folder for the submission")
