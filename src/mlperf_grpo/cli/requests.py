"""What each ``mlperf-grpo`` subcommand is asked to do: one frozen request per command,
built from the parsed arguments, carrying its own checks (a request that exists is a
consistent command line). Torch-free: building one imports nothing of the library.

Every check raises :class:`~mlperf_grpo.errors.BadInput` (exit 2) with one line naming
the fix; the rules' environment variables are read here, through
:mod:`mlperf_grpo.environment`.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from mlperf_grpo import environment
from mlperf_grpo.errors import BadInput


def torchrun_world_size() -> int:
    """``WORLD_SIZE`` under torchrun (``TORCHELASTIC_RUN_ID`` set), else 0 (no torch import)."""
    return int(os.environ["WORLD_SIZE"]) if "TORCHELASTIC_RUN_ID" in os.environ else 0


@dataclass(frozen=True)
class TrainRequest:
    """``train`` or ``run`` (``evaluate_after``): the run config file (``None``: the
    built-in default), the new run directory (``None``: a new ``runs/YYYYMMDD-HHMMSS``),
    ``deferred`` (``DEFERRED_OFFLINE_EVAL``) and ``retain`` (``--retain-checkpoints`` or
    ``RETAIN_GRPO_CHECKPOINTS=1``; read only for deferred evaluation, recorded in ``run.json``)."""

    config: str | None
    output: Path | None
    evaluate_after: bool
    deferred: bool
    retain: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainRequest:
        """Raises: EnvironmentVariableError: a rules' variable has a bad value."""
        deferred = environment.deferred_offline_eval()
        retain = environment.retain_checkpoints(getattr(args, "retain_checkpoints", False)) if deferred else False
        return cls(args.config, args.output, args.command == "run", deferred, retain)

    @property
    def config_filename(self) -> str:
        """The config's name as ``run.json`` records it."""
        return self.config or "builtin-default"


FOREIGN_FLAGS = ("--checkpoints", "--mllog", "--config", "--eval-log", "--format")


@dataclass(frozen=True)
class EvaluateRequest:
    """``evaluate``: a run directory of ours (``run_dir``; ``follow``: while it trains),
    or another trainer's series (``checkpoints``, ``mllog``, ``config``, optional
    ``eval_log`` and ``format``). ``workers``: engines (``None``: the config's);
    ``torchrun_world``: WORLD_SIZE under torchrun, else 0. Checked on construction, in
    the order a user meets the problems."""

    run_dir: Path | None
    checkpoints: Path | None
    mllog: Path | None
    config: str | None
    eval_log: Path | None
    format: str | None
    workers: int | None
    follow: bool
    stop_training_at_pass: bool
    retain_checkpoints: bool
    torchrun_world: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace, torchrun_world: int = 0) -> EvaluateRequest:
        """Raises: BadInput: the command line is inconsistent (one line naming the fix)."""
        return cls(args.run_dir, args.checkpoints, args.mllog, args.config, args.eval_log, args.format, args.workers,
                   args.follow, args.stop_training_at_pass,
                   environment.retain_checkpoints(args.retain_checkpoints), torchrun_world)

    @property
    def foreign_given(self) -> bool:
        return any(v is not None for v in (self.checkpoints, self.mllog, self.config, self.eval_log, self.format))

    @property
    def mode(self) -> str:
        """``"follow"``, ``"run"`` (a run directory of ours) or ``"foreign"`` (a series)."""
        return "follow" if self.follow else "run" if self.run_dir is not None else "foreign"

    @property
    def where(self) -> Path:
        """The folder evaluated: the run directory, or the series' ``--checkpoints``."""
        return self.run_dir if self.run_dir is not None else self.checkpoints

    def resume_command(self) -> str:
        """The command that resumes this evaluation after a stop."""
        if self.mode == "foreign":
            again = f"mlperf-grpo evaluate --checkpoints {self.checkpoints} --mllog {self.mllog} --config {self.config}"
            return again + (f" --eval-log {self.eval_log}" if self.eval_log is not None else "")
        return f"mlperf-grpo evaluate {self.run_dir}" + (" --follow" if self.follow else "")

    def __post_init__(self) -> None:
        if not environment.deferred_offline_eval():
            raise BadInput("DEFERRED_OFFLINE_EVAL=0 evaluates inline during training; 'evaluate' is the deferred driver: "
                           "unset it or set it to 1")
        if self.stop_training_at_pass and not self.follow:
            raise BadInput("--stop-training-at-pass stops a training the evaluator follows: add --follow")
        if self.torchrun_world:
            self._check_torchrun()
        {"follow": self._check_follow, "run": self._check_run, "foreign": self._check_foreign}[self.mode]()

    def _check_torchrun(self) -> None:
        """Under torchrun the evaluation workers are its ranks (one: the serial evaluator),
        for a run directory or another trainer's series alike."""
        world = self.torchrun_world
        if self.workers not in (None, world):
            raise BadInput(f"under torchrun the evaluation workers are its {world} rank(s) (WORLD_SIZE {world}): leave "
                           f"out --workers, or give --workers {world}")
        if world == 1:
            return
        if self.follow:
            raise BadInput(f"--follow evaluates with one worker, not torchrun's {world} ranks: run it without torchrun "
                           "(or with one rank)")

    def _check_follow(self) -> None:
        if self.run_dir is None:
            raise BadInput("--follow follows a run our trainer is writing: give its RUN_DIR (the --output of "
                           "'mlperf-grpo train')")
        if self.foreign_given:
            raise BadInput(f"--follow follows a run directory of ours: leave out {'/'.join(FOREIGN_FLAGS)}")
        if self.workers not in (None, 1):
            raise BadInput("--follow evaluates with one worker (checkpoints arrive one per training step); leave out "
                           "--workers, or evaluate the finished run with 'mlperf-grpo evaluate RUN_DIR --workers N'")

    def _check_run(self) -> None:
        if self.foreign_given:
            raise BadInput("give RUN_DIR (a run our trainer wrote) or --checkpoints/--mllog/--config (another "
                           "trainer's series), not both")

    def _check_foreign(self) -> None:
        given = (("--checkpoints", self.checkpoints), ("--mllog", self.mllog), ("--config", self.config))
        missing = [flag for flag, v in given if v is None]
        if missing:
            raise BadInput(f"evaluate needs RUN_DIR, or --checkpoints DIR --mllog LOG --config FILE (missing "
                           f"{', '.join(missing)})")
        if self.workers not in (None, 1):
            raise BadInput("--workers applies to RUN_DIR (a run our trainer wrote); another trainer's series is "
                           "evaluated by one worker")
        if self.eval_log is not None and self.eval_log.resolve() == self.mllog.resolve():
            raise BadInput("--eval-log names the training log; leave it out to append to the training log")


@dataclass(frozen=True)
class CheckRequest:
    """``check``: the logs, ``--run-dir`` (or none with ``no_run_dir``), ``--json``, the
    official checkers' time limit in s."""

    logs: list[Path]
    run_dir: Path | None
    no_run_dir: bool
    json: bool
    time_limit_s: float

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CheckRequest:
        return cls(args.logs, args.run_dir, args.no_run_dir, args.json, args.time_limit_s)

    def problem(self) -> str | None:
        """What makes the request unusable (one line), else ``None`` (``--json`` reports
        it in the JSON too, so it is returned rather than raised)."""
        if self.run_dir is not None and self.no_run_dir:
            return "--run-dir and --no-run-dir contradict each other; pass one"
        if self.run_dir is not None and not self.run_dir.is_dir():
            return f"--run-dir {self.run_dir} is not a directory"
        if not self.time_limit_s > 0:
            return f"--time-limit-s must be a positive number of seconds, got {self.time_limit_s}"
        return None


MEMORY_FLAGS = ("model_shape", "model_config", "world_size", "trajectory_tokens", "micro_batch_tokens", "rows",
                "prompt_tokens")
MODEL_SHAPE_NAMES = ("qwen3.5-397b-a17b",)
"""``plan --memory --model-shape`` choices (``memory_plan.MODEL_SHAPES``: the parser is built
without importing the library; a test keeps the two equal)."""


@dataclass(frozen=True)
class PlanRequest:
    """``plan``: closed values of a GBS (``--global-batch-size`` or a config's), or with
    ``memory`` the per-rank memory of a layout (model shape or config, ranks, tensor
    parallel size T, dtype, checkpoints in flight K)."""

    global_batch_size: str | None
    config: str | None
    json: bool
    memory: bool
    model_shape: str | None
    model_config: Path | None
    world_size: int | None
    tensor_parallel_size: int
    dtype: str
    max_in_flight: int
    trajectory_tokens: int | None = None
    micro_batch_tokens: int | None = None
    rows: int | None = None
    prompt_tokens: int | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PlanRequest:
        return cls(args.global_batch_size, args.config, args.json, args.memory, args.model_shape, args.model_config,
                   args.world_size, args.tensor_parallel_size, args.dtype, args.max_in_flight,
                   args.trajectory_tokens, args.micro_batch_tokens, args.rows, args.prompt_tokens)

    def __post_init__(self) -> None:
        memory_options = [f"--{name.replace('_', '-')}" for name in MEMORY_FLAGS if getattr(self, name) is not None]
        if self.memory:
            if self.global_batch_size is not None or self.config is not None:
                raise BadInput("plan --memory plans memory, not a GBS: drop --global-batch-size / --config")
            if (self.model_shape is None) == (self.model_config is None):
                raise BadInput(f"plan --memory: give exactly one of --model-shape {{{','.join(MODEL_SHAPE_NAMES)}}} "
                               "and --model-config PATH")
            if self.world_size is None:
                raise BadInput("plan --memory: give --world-size N (the ranks, one accelerator each)")
            for name, value in (("--rows", self.rows), ("--micro-batch-tokens", self.micro_batch_tokens),
                                ("--prompt-tokens", self.prompt_tokens)):
                if value is not None and self.trajectory_tokens is None:
                    raise BadInput(f"plan --memory: {name} sizes the sequences: add --trajectory-tokens L")
            if (self.prompt_tokens or 0) > (self.trajectory_tokens or 0):
                raise BadInput(f"plan --memory: --prompt-tokens {self.prompt_tokens:,} is over --trajectory-tokens "
                               f"{self.trajectory_tokens:,}, which counts the prompt: give at most {self.trajectory_tokens}")
            return
        if memory_options:
            raise BadInput(f"{' '.join(memory_options)} belong{'s' * (len(memory_options) == 1)} to plan --memory: add --memory")
        if (self.global_batch_size is None) == (self.config is None):
            raise BadInput("give exactly one of --global-batch-size N and --config FILE")
