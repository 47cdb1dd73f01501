"""The library entry of each ``mlperf-grpo`` subcommand: one function per request
(:mod:`mlperf_grpo.cli.requests`), which the CLI calls and whose result it prints.
Imports of the library are made inside each entry, so a log tool never loads torch.

:class:`Progress` is what a running command has reached (its phase, the run directory
it made): the CLI reads it to say how a stopped command is resumed; nothing else is
handed back up.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mlperf_grpo.cli.requests import EvaluateRequest, PlanRequest, TrainRequest
from mlperf_grpo.errors import BadInput, outcome_exit_code

RUNS_DIR = Path("runs")


@dataclass
class Progress:
    """How far a command got: ``phase`` (``None``, ``"train"``, ``"evaluate"``), the run
    directory written (``run_dir``; made by this process: ``made_output``) and whether the
    run keeps its checkpoints (``retain_recorded``, in ``run.json``); ``resume``: the
    command that resumes an evaluation (``None``: ``evaluate RUN_DIR``)."""

    phase: str | None = None
    run_dir: Path | None = None
    made_output: bool = False
    retain_recorded: bool = False
    resume: str | None = None
    log_file: Path | None = None
    """The log an evaluation of another trainer's series writes its ``run_stop`` to."""


def new_run_dir() -> Path:
    """The default ``--output``, made now: ``runs/YYYYMMDD-HHMMSS`` (local time), ``-2``,
    ``-3``... appended when that name is taken, each try one atomic ``mkdir``, so two
    runs started in the same second never share a directory.

    Raises:
        RunDirError: ``runs/`` cannot be made or written.
    """
    from mlperf_grpo.config.rundir import reserve_new_run_dir

    return reserve_new_run_dir(RUNS_DIR, time.strftime("%Y%m%d-%H%M%S"))


def _start_training(request: TrainRequest, progress: Progress):
    """Check everything cheap (config, layout, model, tokenizer, output), then say what
    differs from closed; returns ``(config, inputs)`` (the checked
    :class:`~mlperf_grpo.train.inputs.TrainingInputs`, handed to the trainer: checked once).
    Nothing is written; a missing ``--output`` becomes a new ``runs/YYYYMMDD-HHMMSS`` (made
    by rank 0, its name on every rank)."""
    from mlperf_grpo.config.load import load_config
    from mlperf_grpo.config.rundir import RunDir
    from mlperf_grpo.errors import RunDirError
    from mlperf_grpo.plan.closed import format_differences
    from mlperf_grpo.train import collectives, ranks
    from mlperf_grpo.train.inputs import check_training_inputs

    config = load_config(request.config)
    ranks.check_layout(config, deferred=request.deferred)
    inputs = check_training_inputs(config, RunDir(request.output or RUNS_DIR), check_output=request.output is not None)
    output = request.output
    if output is None:
        output = collectives.broadcast_object(new_run_dir() if ranks.is_writer() else None)
        progress.made_output = ranks.is_writer()
        if progress.made_output:
            try:
                RunDir(output).check_log_path()  # $MLPERF_MLLOG_FILE, before the note
            except RunDirError:
                RunDir(output).remove_if_unwritten()
                raise
    progress.run_dir, progress.retain_recorded = output, request.retain
    if config.division == "open" and (text := format_differences(config)):
        print(f"note: {text}")  # after every check: never before an error
    print(f"run directory: {output}")
    progress.phase = "train"
    return config, inputs


@contextlib.contextmanager
def _removed_if_unwritten(progress: Progress):
    """A default ``--output`` this process made (:func:`new_run_dir`) is removed again
    when training fails before writing any file of the run (a setup failure leaves no
    run behind); an ``--output`` given by the user is the trainer's to judge."""
    try:
        yield
    except BaseException:
        if progress.made_output:
            from mlperf_grpo.config.rundir import RunDir

            RunDir(progress.run_dir).remove_if_unwritten()
        raise


def train(request: TrainRequest, progress: Progress):
    """``train`` (and the training of ``run``): deferred checkpoints, no ``run_stop``
    (returns ``train.trainer.TrainResult``); with ``DEFERRED_OFFLINE_EVAL=0`` inline
    evaluation, which writes ``run_stop`` itself (returns the ``EvalOutcome``).

    Raises: the errors of ``train.trainer.train`` and ``train.inline_eval.train_with_inline_eval``.
    """
    from mlperf_grpo.config.rundir import RunDir

    config, inputs = _start_training(request, progress)
    with _removed_if_unwritten(progress):
        if not request.deferred:
            from mlperf_grpo.train.inline_eval import train_with_inline_eval

            return train_with_inline_eval(config, RunDir(progress.run_dir), config_filename=request.config_filename,
                                          inputs=inputs)
        from mlperf_grpo.train.trainer import train as run_trainer

        return run_trainer(config, RunDir(progress.run_dir), config_filename=request.config_filename,
                           retain_checkpoints=request.retain, inputs=inputs)


def evaluate_trained(request: TrainRequest, progress: Progress):
    """``run``'s second half: evaluate the run just trained. Under torchrun rank 0 alone
    evaluates it (``None`` on the other ranks), except with a tensor-parallel ``hf`` engine
    (``inference.tensor_parallel_size`` T > 1): then every rank is a worker's rank, as in
    ``evaluate RUN_DIR`` under torchrun (world / T workers of T ranks). Returns the
    ``EvalOutcome`` (rank 0).
    """
    from mlperf_grpo.config.rundir import RunDir
    from mlperf_grpo.evaluate.offline import evaluate_run
    from mlperf_grpo.train import ranks

    here = ranks.layout()
    progress.phase = "evaluate"
    if here.world_size > 1 and RunDir(progress.run_dir).load()[0].inference.tensor_parallel_size > 1:
        return _evaluate_on_every_rank(progress.run_dir, request.retain)
    if here.rank != 0:
        return None  # under torchrun rank 0 alone evaluates the run it wrote
    return evaluate_run(progress.run_dir, retain_checkpoints=request.retain)


def _evaluate_on_every_rank(run_dir: Path, retain: bool):
    """Every torchrun rank evaluates ``run_dir`` (rank 0 plans, commits and returns the
    ``EvalOutcome``; the others join its plan and return ``None``)."""
    from mlperf_grpo.evaluate.launch import joined_ranks
    from mlperf_grpo.evaluate.offline import evaluate_run
    from mlperf_grpo.evaluate.worker import join_evaluation

    with joined_ranks() as torchrun_ranks:
        if torchrun_ranks.rank != 0:
            join_evaluation(run_dir, torchrun_ranks)
            return None
        outcome = evaluate_run(run_dir, retain_checkpoints=retain, workers=torchrun_ranks.world_size,
                               ranks=torchrun_ranks)
        torchrun_ranks.conclude(outcome_exit_code(outcome.status))
        return outcome


def evaluate(request: EvaluateRequest, progress: Progress, ranks=None):
    """``evaluate``: follow a training, evaluate a run directory of ours (with
    ``request.workers`` engines, or the torchrun ``ranks`` this process is rank 0 of), or
    another trainer's series. Returns the ``EvalOutcome``.

    Raises:
        BadInput: the series' training log is not usable (check's message).
        The errors of ``evaluate.offline.evaluate_run``, ``follow.follow_run`` and
        ``foreign.evaluate_checkpoints``.
    """
    if request.mode == "run" and (request.workers or 1) > 1 and not request.torchrun_world:
        from mlperf_grpo.evaluate.prestart import prestart_rank_server

        prestart_rank_server("mlperf_grpo.evaluate.worker")  # the ranks' imports run while ours do
    if request.mode == "follow":
        from mlperf_grpo.evaluate.follow import follow_run

        progress.phase, progress.run_dir = "evaluate", request.run_dir
        return follow_run(request.run_dir, retain_checkpoints=request.retain_checkpoints,
                          stop_training_at_pass=request.stop_training_at_pass)
    if request.mode == "run":
        from mlperf_grpo.evaluate.offline import evaluate_run

        progress.phase, progress.run_dir = "evaluate", request.run_dir
        return evaluate_run(request.run_dir, retain_checkpoints=request.retain_checkpoints,
                            workers=request.torchrun_world or request.workers, ranks=ranks)
    return _evaluate_foreign(request, progress, ranks)


def _evaluate_foreign(request: EvaluateRequest, progress: Progress, ranks=None):
    """Another trainer's series: validate its training log (check's messages), then
    evaluate the series through the offline evaluator."""
    from mlperf_grpo.config.load import load_config
    from mlperf_grpo.evaluate.foreign_series import CheckpointsRequest, evaluate_checkpoints
    from mlperf_grpo.evaluate.foreign_source import build_source
    from mlperf_grpo.evaluate.worker_group import check_worker_groups
    from mlperf_grpo.logs.check.training_log import TrainingLogError, check_training_log

    retain = request.retain_checkpoints
    config = load_config(request.config)
    check_worker_groups(config, request.torchrun_world or None,  # under torchrun: workers of T ranks
                        f"evaluate --checkpoints {request.checkpoints} ...")
    steps = build_source(request.checkpoints, request.format or "auto", config).published_steps()
    try:
        check_training_log(request.mllog, config.global_batch_size, max(steps, default=None))
    except TrainingLogError as err:
        raise BadInput(str(err)) from None
    progress.phase, progress.run_dir = "evaluate", request.checkpoints
    progress.log_file = request.eval_log or request.mllog
    return evaluate_checkpoints(CheckpointsRequest(request.checkpoints, request.mllog, request.format or "auto",
                                                   request.eval_log, retain, config_file=request.config), config, ranks)


def plan(request: PlanRequest) -> str:
    """``plan``: the text (or JSON) of the closed values of a GBS or a config, or with
    ``--memory`` of the per-rank memory of a layout.

    Raises:
        BadInput: the GBS is not a closed one, or T does not divide the model (naming the flag).
        ConfigError: the config is not usable.
    """
    import json

    if request.memory:
        return _plan_memory(request)
    from mlperf_grpo.config.load import load_config
    from mlperf_grpo.plan.closed import build_plan, format_differences, format_plan

    config = load_config(request.config) if request.config else None
    gbs = _parse_gbs(request.global_batch_size) if config is None else config.global_batch_size
    try:
        values = build_plan(gbs)
    except ValueError as err:
        raise BadInput(f"{request.config}: {err}") from None
    if config is not None:
        values["config"] = {"file": request.config, "division": config.division,
                            "differences_from_closed": [vars(v) for v in config.closed_violations()]}
    if request.json:
        return json.dumps(values, indent=2, default=str)
    if config is None:
        return format_plan(values)
    return format_plan(values) + "\n" + (format_differences(config) or f"{request.config}: every value matches the closed rules")


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


def _plan_memory(request: PlanRequest) -> str:
    """``plan --memory``: per-rank bytes of a model shape at N ranks and T (memory_plan.py)."""
    import json

    from mlperf_grpo.plan import memory as memory_plan
    from mlperf_grpo.plan.model_config import load_model_config

    model = (memory_plan.MODEL_SHAPES[request.model_shape] if request.model_shape
             else load_model_config(request.model_config))
    result = memory_plan.plan_memory(model, request.world_size, request.tensor_parallel_size, request.dtype,
                                     request.max_in_flight, tensor_parallel_name="--tensor-parallel-size")
    out, lines = result.to_json(), [memory_plan.format_memory_plan(result)]
    if request.trajectory_tokens is not None:
        out["sequences"], text = _plan_sequences(request, model, result)
        lines.append(text)
    return json.dumps(out, indent=2) if request.json else "\n".join(lines)


def _plan_sequences(request: PlanRequest, model: dict, result: object) -> tuple[dict | None, str]:
    """``plan --memory --trajectory-tokens``: the sequences' per-rank bytes (plan/sequences.py)
    without and with activation checkpointing, as JSON and text."""
    from mlperf_grpo.config.sections import DEFAULT_MICRO_BATCH_TOKENS
    from mlperf_grpo.plan import hybrid_cache
    from mlperf_grpo.plan import memory as memory_plan
    from mlperf_grpo.plan import sequences as plan_sequences

    hybrid = hybrid_cache.plans_hybrid_cache(model)
    if not plan_sequences.plans_sequences(model) and not hybrid:
        return None, f"sequences: not counted for model_type {model.get('model_type')!r} (llama, qwen3, qwen3_5_moe only)"
    from mlperf_grpo.model.files import config_context_length

    context, key = config_context_length(model)
    if context and request.trajectory_tokens > context:
        given = key if key in model else (f"{key}: the default for model_type {model.get('model_type')!r}, which "
                                          "the config leaves out, as the trainer loads it")
        raise BadInput(f"--trajectory-tokens {request.trajectory_tokens:,} is over the model's context of "
                       f"{context:,} tokens ({given}): give at most {context}")
    rows = request.rows or max(1, 256 // request.world_size)
    bytes_ = memory_plan.DTYPE_BYTES[request.dtype]
    if hybrid:
        cache = hybrid_cache.hybrid_cache(model, request.tensor_parallel_size, bytes_)
        return hybrid_cache.format_hybrid_cache(model, cache, request.trajectory_tokens, rows)
    tokens = request.micro_batch_tokens or DEFAULT_MICRO_BATCH_TOKENS
    shape = plan_sequences.step_shape(request.trajectory_tokens, rows, tokens, compute_bytes=bytes_,
                                      rollout_bytes=bytes_, prompt=request.prompt_tokens)
    static = (memory_plan.static_device_bytes(result, 1)
              + plan_sequences.autocast_copy_bytes(result.parameters, request.world_size, bytes_))
    figures = {"shape": shape.__dict__, "static_device_bytes": static,
               **{name: plan_sequences.sequence_memory(model, shape, c).to_json()
                  for name, c in (("no_checkpointing", False), ("checkpointing", True))}}
    return figures, "\n".join(plan_sequences.format_sequences(model, shape, static))


def say(line: str) -> None:
    """``line`` and its newline to stderr in one write: torchrun ranks share the
    terminal's stderr, and with ``print`` (text, then newline: two writes when stderr is
    unbuffered) two ranks' error lines could run into one."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
