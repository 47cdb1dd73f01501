"""The GRPO training driver: setup, train (one step at a time), checkpoint, log.

Reads top to bottom like the lifecycle it runs::

    init_start -> load policy, engine, tasks -> init_stop -> run_start
    for step in 1..max_steps:
        block_start
        take rollouts (age 1: generated while the previous step trained; train/async_rollout.py)
        rewards; advantages; loss over micro-batches; clip; optimizer.step() -> weight-update time
        refit engine <- policy (after the generation in flight)
        block_stop
        step >= first eval step: stage the weights; step_N/ is written in the background
        stop_training.json (a following evaluator's pass): stop after this step
    training's end: wait until every checkpoint is published (checkpoints/training_end.json)
    no run_stop: the offline evaluator writes it

The model, tokenizer and device are checked, and the model loaded, before the run
directory is made, so a setup failure leaves no half-made run. How training ends early
(SIGTERM, Ctrl-C, an error, a failed checkpoint write) decides who closes the run (the
checkpoints in flight are published first):

    a checkpoint is published -> no run_stop here: the run's result belongs to the
                                 offline evaluator, which evaluates the published series
    none is published         -> run_stop aborted at the last trained step (the time of
                                 its block_stop; run_start's when no step finished)
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from mlperf_logging.mllog import constants as C  # noqa: N812
from tqdm import tqdm

from mlperf_grpo import memory_plan, rules
from mlperf_grpo.checkpoint import AsyncCheckpointer, CheckpointTiming, TrainingInfo
from mlperf_grpo.config import GRPOConfig, RunConfig
from mlperf_grpo.eval_settings import evaluation_settings
from mlperf_grpo.fingerprint import canary_logits_in_dtype
from mlperf_grpo.inference.base import Completion, InferenceEngine, SamplingParams, build_engine, check_engine_available
from mlperf_grpo.mllog import DiscardingLogWriter, MLLogWriter, now_ms, read_log
from mlperf_grpo.outcome import log_aborted_run_stop
from mlperf_grpo.linear_attention import check_linear_attention_kernels
from mlperf_grpo.model import (DTYPES, check_device, check_model, check_model_path, compile_decoder_layers,
                               compile_policy_layers, load_model)
from mlperf_grpo.rundir import RunDir, RunDirError, RunLock
from mlperf_grpo import tasks
from mlperf_grpo.tasks.lengths import check_prompt_lengths
from mlperf_grpo.tasks.scoring import score
from mlperf_grpo.train import distributed
from mlperf_grpo.train.async_rollout import RolloutProducer
from mlperf_grpo.train.grpo import (
    PGLossOptions,
    clipped_pg_loss_sum,
    group_advantages,
    seq_logprob_error_keep,
    token_logprobs,
)
from mlperf_grpo.train.mlperf_events import log_hyperparameters, log_submission_and_init_start, log_tracked_stats
from mlperf_grpo.train.stop import GracefulStop
from mlperf_grpo.train.rollout import PromptSampler, RolloutBatch, build_batch, truncated_completions


@dataclass
class StepStats:
    """What one training step measured."""

    step: int
    reward_mean: float
    rollout_pass_rate: float
    """Fraction of prompts with at least one rewarded completion."""
    loss: float
    grad_norm: float
    weight_update_time_ms: int
    rollout_weights_version: int = 0
    """Optimizer steps applied to the weights that generated this step's rollouts
    (``step - 1`` when synchronous, ``step - 2`` with one-step-async from step 2)."""
    num_sequences_masked_by_is: int = 0
    """Sequences ``seq-mask-tis`` dropped from the loss."""


@dataclass
class TrainResult:
    """Outcome of :func:`train`."""

    steps: list[StepStats] = field(default_factory=list)
    checkpoint_steps: list[int] = field(default_factory=list)
    """Steps whose checkpoint was published."""
    checkpoint_timings: list[CheckpointTiming] = field(default_factory=list)
    stop_request: dict | None = None
    """The evaluator's request training stopped at (``stop_training.json``, written by
    ``evaluate --follow --stop-training-at-pass`` at a pass); ``None``: not stopped by it."""


@dataclass
class OptimizeResult:
    """What one optimizer step measured (see :func:`optimize_step`)."""

    loss: float
    """Global-batch token-level mean loss."""
    grad_norm: float
    """Pre-clip gradient norm."""
    num_valid_tokens: int
    """Completion tokens of the sequences kept by the batch's ``sample_mask`` (overlong
    filter) and the log-prob error filter (the normalizer)."""
    num_valid_sequences: int
    """Sequences kept by both (NeMo-RL's ``global_valid_seqs``: the sum of its final ``sample_mask``)."""
    num_sequences_masked_by_is: int
    num_sequences_masked_by_logprob_error: int
    importance_weight_mean: float
    """Mean IS weight over valid tokens (1 without the correction)."""


def training_batch(
    completions: list[list[Completion]], rewards: torch.Tensor, grpo: GRPOConfig, pad_token_id: int,
    eos_token_ids: list[int],
) -> RolloutBatch:
    """The step's batch: ``[P][G]`` completions, their ``[P, G]`` rewards, the advantages
    the config's baseline gives (:func:`~mlperf_grpo.train.grpo.group_advantages`) and,
    with ``overlong_filtering``, sample mask 0 for the truncated completions
    (:func:`~mlperf_grpo.train.rollout.truncated_completions`).

    As NeMo-RL's ``async_grpo_train``: the baseline takes every sample as valid (its
    ``GRPOAdvantageEstimator`` passes ``valid_mask = ones``), so a truncated completion
    still counts in its group's baseline and std; the filter only takes it out of the loss
    and the valid-token and valid-sequence counts.
    """
    advantages = group_advantages(rewards, leave_one_out_baseline=grpo.use_leave_one_out_baseline,
                                  normalize_rewards=grpo.normalize_rewards)  # [P, G]
    sample_mask = (~truncated_completions(completions, eos_token_ids)).float() if grpo.overlong_filtering else None
    return build_batch(completions, rewards, advantages, pad_token_id, eos_token_ids, sample_mask)


COMPILED_WIDTH_MULTIPLE = 8
"""Micro-batch widths of a compiled policy are multiples of this (see :func:`optimize_step`)."""


def compute_autocast(device: torch.device, compute_dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to ``compute_dtype`` for the policy's forward (and so backward)
    passes; a no-op for float32. The weights, their gradients and the optimizer stay float32
    (master weights); log-probabilities are taken in float32 (:func:`token_logprobs`)."""
    if compute_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=compute_dtype)


def optimize_step(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    micro_batch_size: int,
    temperature: float,
    options: PGLossOptions,
    grad_clip_norm: float,
    seq_logprob_error_threshold: float | None = None,
    needs_prev_logprobs: bool = False,
    compute_dtype: torch.dtype = torch.float32,
    width_multiple: int = 1,
    reshard_every_micro_batch: bool = True,
) -> OptimizeResult:
    """One optimizer step on a global batch, accumulating gradients over micro-batches.

    ``prev`` (the training policy's log-probs before the update) is needed with
    ``needs_prev_logprobs`` (GRPOConfig.needs_prev_logprobs). One optimizer step follows
    each rollout batch, so the policy before the update is the policy of this step's loss
    pass: ``prev = sg(curr)``, taken from each micro-batch's own forward, not from a second
    no-grad pass over the batch (NeMo-RL runs one; the values are equal up to kernel
    numerics). ``seq_logprob_error_threshold`` then drops sequences from the mask
    (:func:`~mlperf_grpo.train.grpo.seq_logprob_error_keep`, per row, so per micro-batch).
    Without ``needs_prev_logprobs``, ``prev`` is ``sg(curr)`` under
    ``force_on_policy_ratio`` and else the rollout's generation log-probs. The batch's
    ``sample_mask`` (the overlong filter) multiplies the completion mask first
    (``RolloutBatch.loss_mask``): a row it leaves out still goes through the forward pass
    but adds nothing to the loss, the token count or ``num_valid_sequences``.

    The gradient is that of the token-level mean over the whole batch: without the filter
    each micro-batch's loss sum is divided by the global valid-token count before its
    backward; with the filter that count is known only after the last micro-batch, so the
    summed gradient is divided by it then (equal in exact arithmetic). The forward passes
    run under :func:`compute_autocast` of ``compute_dtype``; below float32 they compute
    logits only from each micro-batch's first completion column on (HF ``logits_to_keep``;
    the same log-probs, a smaller ``[mb, T, V]`` at a real vocabulary). The micro-batch loop
    reads nothing back from the device (its sums are read once, after the optimizer step).
    Under torchrun the batch is this rank's share and the count is the global batch's
    (summed over ranks), as are the returned loss, counts and IS weight mean; the gradient
    norm is over all shards. ``reshard_every_micro_batch=False`` (an FSDP2 policy sharded
    with it, ``distributed.reshard_every_micro_batch``): gradients are reduced once, after
    the last micro-batch (:func:`~mlperf_grpo.train.distributed.sync_after_micro_batch`).

    ``width_multiple``: each micro-batch's width is rounded up to a multiple of it (the
    batch right-padded with masked columns): a compiled policy then never sees a sequence
    length of another alignment, which would recompile each decoder layer (inductor
    guards on ``length % 8``). The masked columns change no value in exact arithmetic.

    Raises:
        ValueError: ``seq_logprob_error_threshold`` without ``needs_prev_logprobs``.
    """
    filtered = seq_logprob_error_threshold is not None
    if filtered and not needs_prev_logprobs:
        raise ValueError("seq_logprob_error_threshold needs the prev log-probs (needs_prev_logprobs=True)")
    policy.train()
    optimizer.zero_grad(set_to_none=True)
    device = next(policy.parameters()).device  # the batch is built on the CPU
    batch = batch.padded_to_multiple(width_multiple)
    mask = batch.loss_mask  # [B, L-1]: completion tokens of the rows sample_mask keeps (overlong filter)
    # the global batch's valid tokens (summed over ranks); with the filter known only after the loop
    num_valid_tokens = 0 if filtered else int(distributed.all_reduce_sum([mask.sum().item()])[0])
    loss_divisor = max(num_valid_tokens, 1)
    # float64 on the device: the same sums as Python floats of each micro-batch's values
    loss_total, weight_sum, masked_by_is, masked_by_error, kept_tokens, kept_sequences = (
        torch.zeros((), dtype=torch.float64, device=device) for _ in range(6))
    # to the device once a step (a copy from pageable host memory waits for the device)
    input_ids, attention_mask, token_mask, rollout_logprobs, advantages, sample_mask = (t.to(device) for t in (
        batch.input_ids, batch.attention_mask, mask, batch.rollout_logprobs, batch.advantages, batch.sample_mask))
    spans = batch.micro_batch_spans(micro_batch_size, width_multiple)  # each micro-batch cut to its longest row
    for index, (rows, width) in enumerate(spans):
        if not reshard_every_micro_batch and index in (0, len(spans) - 1):  # the flags persist in between
            distributed.sync_after_micro_batch(policy, last=index == len(spans) - 1)
        ids = input_ids[rows, :width]
        # Logits from the first completion column on (earlier ones would only score prompt
        # tokens); float32 keeps every position's, the bits the built-in calibration was made with.
        start = 0 if compute_dtype == torch.float32 else batch.first_completion_column(rows)
        with compute_autocast(device, compute_dtype):
            logits = policy(input_ids=ids, attention_mask=attention_mask[rows, :width],
                            logits_to_keep=width - start).logits  # [mb, width-start, V]
        curr = token_logprobs(logits[:, :-1], ids[:, start + 1:], temperature)  # [mb, width-1-start]
        cols = slice(start, width - 1)
        generation = rollout_logprobs[rows, cols]
        rows_mask = token_mask[rows, cols]
        prev = curr.detach() if needs_prev_logprobs else None if options.force_on_policy_ratio else generation
        rows_kept = sample_mask[rows]  # [mb]
        if filtered:
            keep, _ = seq_logprob_error_keep(prev, generation, rows_mask, seq_logprob_error_threshold)
            masked_by_error += ((keep == 0) & (rows_mask.sum(dim=-1) > 0)).sum()
            rows_mask = rows_mask * keep.unsqueeze(1)
            rows_kept = rows_kept * keep
            kept_tokens += rows_mask.sum()
        kept_sequences += rows_kept.sum()
        part = clipped_pg_loss_sum(curr, prev, generation, advantages[rows], rows_mask, options)
        loss = part.loss / loss_divisor
        loss.backward()
        loss_total += loss.detach()
        weight_sum += part.importance_weight_sum
        masked_by_is += part.num_sequences_masked_by_is
    if filtered:
        num_valid_tokens = int(distributed.all_reduce_sum([kept_tokens.item()])[0])  # the global batch's
        loss_divisor = max(num_valid_tokens, 1)
        torch._foreach_div_([p.grad for p in policy.parameters() if p.grad is not None], float(loss_divisor))
        loss_total /= loss_divisor
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip_norm)
    optimizer.step()
    policy.eval()
    grad_norm = distributed.full_value(grad_norm)  # over all shards
    local = torch.stack([loss_total, weight_sum, masked_by_is, masked_by_error, kept_sequences]).tolist()  # one read-back
    loss_total, weight_sum, masked_by_is, masked_by_error, kept_sequences = distributed.all_reduce_sum(local)
    return OptimizeResult(
        loss=loss_total,
        grad_norm=grad_norm,
        num_valid_tokens=num_valid_tokens,
        num_valid_sequences=int(kept_sequences),
        num_sequences_masked_by_is=int(masked_by_is),
        num_sequences_masked_by_logprob_error=int(masked_by_error),
        importance_weight_mean=weight_sum / loss_divisor,
    )


def train(
    config: RunConfig,
    run: RunDir,
    config_filename: str,
    show_progress: bool = True,
    inline_eval: Callable[[int, torch.nn.Module], bool] | None = None,
    retain_checkpoints: bool = False,
) -> TrainResult:
    """Run GRPO training with deferred checkpoints; see the module docstring.

    Args:
        config: the run config.
        run: the run directory (created here, after the model is checked and loaded).
        config_filename: logged as ``config_filename``.
        show_progress: draw a tqdm bar on stderr.
        inline_eval: ``DEFERRED_OFFLINE_EVAL=0``: called as ``inline_eval(step, policy)``
            after each step from the first eval step on, instead of writing a deferred
            checkpoint; training stops when it returns True (it logged ``run_stop``).
        retain_checkpoints: recorded in ``run.json``: the evaluation keeps the checkpoints
            (``RunDir.retain_recorded``), however often it is resumed.
    Raises:
        RunDirError: the output cannot be created or already holds a run (RunLockedError:
            another process writes to it).
        TaskError: the task data or entry point is unusable (before anything is written).
        ModelLoadError, LogWriteError, CheckpointWriteError, OSError: setup or I/O failed.
        Terminated, KeyboardInterrupt: SIGTERM or Ctrl-C.
        On a failure during setup nothing of the run is written (a run directory this call
        created is removed). On a failure after ``run_start``: ``run_stop`` aborted when no
        checkpoint is published yet, else no ``run_stop`` (the offline evaluator's).

    Under torchrun every rank calls this; rank 0 alone writes the run directory (see
    ``train/distributed.py``), the others train their share and return the steps' stats.
    """
    distributed.check_layout(config, deferred=inline_eval is None)
    writer = distributed.is_writer()
    suite, train_pool = check_training_inputs(config, run, check_output=writer)
    distributed.barrier()  # every rank has checked the output before rank 0 creates it
    if not writer:
        with GracefulStop() as stopper:
            setup = _setup(config, train_pool)
            return _train(config, None, None, config_filename, False, None, stopper, setup, suite)
    root_existed = run.root.exists()
    try:
        run.root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"cannot create run directory {run.root}: {err.strerror}") from None
    with RunLock(run.root, "trainer"), GracefulStop() as stopper:
        try:
            setup = _setup(config, train_pool)
            mllog_file = run.create(config, retain_checkpoints=retain_checkpoints)
        except BaseException:  # no line of the run was logged yet: leave no trace
            if not root_existed:
                run.remove_if_unwritten()
            raise
        try:
            return _train(config, run, mllog_file, config_filename, show_progress, inline_eval, stopper, setup, suite)
        finally:
            setup.engine.close()


def check_training_inputs(config: RunConfig, run: RunDir, check_output: bool = True) -> tuple[tasks.TaskSuite, list[tasks.Task]]:
    """Everything that can be checked before training starts, cheaply (no weights loaded);
    the output only with ``check_output``.

    Returns:
        ``(suite, train_pool)``: the task suite and its checked training pool.
    Raises:
        TaskError: the task data or entry point is unusable, or a task count is wrong
            (PromptTooLongError: a prompt plus ``grpo.max_new_tokens`` exceeds the model's
            context or ``grpo.max_sequence_length``).
        ModelLoadError: the model directory, its weights' headers or its tokenizer are
            unusable (see :func:`mlperf_grpo.model.check_model`), or no CUDA device.
        MemoryPlanError: T does not divide, or the layout's planned bytes exceed the
            device (:func:`check_planned_memory`).
        RunDirError: the output already holds a run.
    """
    suite = tasks.load_suite(config)
    validation = tasks.validation_tasks(suite, config.validation.num_tasks)  # refused now, not at evaluation
    train_pool = tasks.train_tasks(suite, config.task.num_train_tasks, config.validation.num_tasks, config.seed)
    check_model(config.model.path, sample_text=validation[0].prompt)
    check_prompt_lengths(config, {"training": train_pool, "validation": validation})
    check_device(config.model.device)
    check_linear_attention_kernels(config.model.path, config.model.device)
    check_planned_memory(config)
    check_engine_available(config)
    if check_output:
        run.check_unused()
    return suite, train_pool


def device_memory_bytes() -> int:
    """Total memory of this process's CUDA device, in bytes."""
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def check_planned_memory(config: RunConfig) -> None:
    """Under torchrun, refuse an ``inference.tensor_parallel_size`` that does not divide the
    world size or the model's heads / experts; on CUDA, refuse a layout whose planned
    per-rank device bytes (:mod:`mlperf_grpo.memory_plan`, today's replica engine) exceed
    the device's memory. CPU memory is not checked, nor a model type the planner does not count.

    Raises:
        MemoryPlanError: the divisibility or the bytes, in one line with the remedy.
    """
    model = memory_plan.load_model_config(check_model_path(config.model.path))
    world_size = distributed.layout().world_size
    if distributed.launched():
        memory_plan.check_tensor_parallel(model, world_size, config.inference.tensor_parallel_size)
    if config.model.device != "cuda" or not memory_plan.counts(model):
        return
    plan = memory_plan.plan_memory(model, world_size, 1, config.model.dtype, config.checkpoint.max_in_flight)
    engine_shards = config.inference.tensor_parallel_size if config.inference.engine == "vllm" else 1
    memory_plan.check_fits(plan, device_memory_bytes(), engine_shards)


@dataclass
class _Setup:
    """What training needs in memory; built before the run directory is written."""

    init_start_ms: int
    policy: torch.nn.Module
    engine: InferenceEngine
    optimizer: torch.optim.Optimizer
    sampler: PromptSampler
    compiled: bool  # the policy's decoder layers are compiled (model.compile resolved for this model)


def _setup(config: RunConfig, train_pool: list[tasks.Task]) -> _Setup:
    init_start_ms = now_ms()  # init_start is logged with this time once the run exists
    torch.manual_seed(config.seed)
    compiled, note = compile_policy_layers(config.model.compile, config.model.compile_policy, config.model.path)
    if note is not None and distributed.layout().rank == 0:
        print(f"mlperf-grpo: {note}", file=sys.stderr)
    if distributed.layout().distributed:  # built sharded (fp32 master weights); compute in the rollout dtype on CUDA
        compute_dtype = DTYPES[config.model.dtype] if config.model.device == "cuda" else None
        policy = distributed.load_sharded_policy(config.model.path, config.model.device, compute_dtype,
                                                 config.distributed.activation_checkpointing,
                                                 compile_layers=compiled,
                                                 reshard_every_micro_batch=config.distributed.reshard_every_micro_batch)
        engine = distributed.engine_from_policy(config, policy)
    else:
        policy = load_model(config.model.path, "float32", config.model.device)
        policy.config.use_cache = False  # the policy only scores (the engine generates)
        if compiled:
            compile_decoder_layers(policy)
        engine = build_engine(config)
    optimizer = torch.optim.AdamW(
        policy.parameters(),
        lr=config.learning_rate,
        betas=(config.optimizer.beta_1, config.optimizer.beta_2),
        eps=config.optimizer.epsilon,
        weight_decay=config.optimizer.weight_decay,
        # one kernel for the whole update on the bf16 CUDA path; the float32 paths keep the
        # foreach kernels their measured runs used (the CPU calibration, the GPU default run)
        fused=config.model.device == "cuda" and config.model.train_compute_dtype != "float32",
    )
    sampler = PromptSampler(train_pool, config.seed)
    return _Setup(init_start_ms, policy, engine, optimizer, sampler, compiled)


def _train(
    config: RunConfig,
    run: RunDir | None,
    mllog_file: Path | None,
    config_filename: str,
    show_progress: bool,
    inline_eval: Callable[[int, torch.nn.Module], bool] | None,
    stopper: GracefulStop,
    setup: _Setup,
    suite: tasks.TaskSuite,
) -> TrainResult:
    here = distributed.layout()
    log = MLLogWriter(mllog_file) if mllog_file is not None else DiscardingLogWriter()  # rank 0 writes
    log_submission_and_init_start(log, config, time_ms=setup.init_start_ms)

    policy, engine, optimizer, sampler = setup.policy, setup.engine, setup.optimizer, setup.sampler
    pad_id = engine.tokenizer.pad_token_id
    g = config.grpo
    first_eval_step = config.first_eval_step
    gbs = config.global_batch_size
    checkpoint_dtype = DTYPES[config.model.dtype]
    evaluation = evaluation_settings(config, tasks.validation_tasks(suite, config.validation.num_tasks))
    # the non-weight files are snapshotted (and fingerprinted) now, at training start
    checkpointer = None if inline_eval is not None or run is None else AsyncCheckpointer(
        run.checkpoints, check_model_path(config.model.path), config.checkpoint.max_in_flight,
        before_publish=log.sync,  # a step_N/ never outlives its step's log lines
    )

    if checkpointer is not None:
        checkpointer.prepare(_rollout_weights(engine, policy, checkpoint_dtype))  # host staging buffers, off the clock
    log_hyperparameters(log, config, config_filename, here.world_size)
    log.end(C.INIT_STOP)
    run_start_ms = now_ms()
    log.start(C.RUN_START, time_ms=run_start_ms)
    log.commit()

    result = TrainResult()
    rollout_params = SamplingParams(g.rollout_temperature, g.rollout_top_p, g.max_new_tokens)
    producer = RolloutProducer(
        engine, sampler, g.num_prompts_per_step, g.num_generations_per_prompt, rollout_params,
        config.seed, g.max_trajectory_age_steps, g.max_steps, config.model.device,
        prompt_share=distributed.prompt_share(g.num_prompts_per_step, here),
    )
    bar = tqdm(total=g.max_steps, desc="train", unit="step", disable=not show_progress)
    completed, completed_ms = 0, run_start_ms  # the last trained step and its block_stop time
    try:
        for step in range(1, g.max_steps + 1):
            if checkpointer is not None:
                checkpointer.raise_if_failed()  # a failed background write stops training here
            log.start(C.BLOCK_START, metadata={C.SAMPLES_COUNT: (step - 1) * gbs, "step": step})
            log.commit(durable=False)  # no fsync on the clock: see mllog's module docstring
            step_start_s = time.perf_counter()
            rollouts = producer.take(step)  # with age 1, also starts generating step + 1
            prompts, completions = rollouts.tasks, rollouts.completions
            scored = score(suite.reward, [(c.text, t) for t, group in zip(prompts, completions) for c in group])
            rewards = torch.tensor(scored).view(len(prompts), g.num_generations_per_prompt)  # [P/N, G] this rank's
            batch = training_batch(completions, rewards, g, pad_id, engine.eos_token_ids)  # a group never spans ranks
            train_start_s = time.perf_counter()
            optimized = optimize_step(
                policy, optimizer, batch, g.micro_batch_size, g.rollout_temperature, PGLossOptions.of(g),
                config.gradient_clip_norm, g.seq_logprob_error_threshold, g.needs_prev_logprobs,
                DTYPES[config.model.train_compute_dtype], width_multiple=COMPILED_WIDTH_MULTIPLE if setup.compiled else 1,
                reshard_every_micro_batch=config.distributed.reshard_every_micro_batch,
            )
            distributed.barrier()  # every rank's optimizer.step() has returned
            weight_update_time_ms = now_ms()  # right after optimizer.step() returned
            policy_training_s = time.perf_counter() - train_start_s
            # for the next rollouts; a sharded policy's parameters are gathered one at a time
            weight_sync_s = producer.refit(distributed.policy_weights(policy), weights_version=step)
            rewards = distributed.all_gather_rows(rewards)  # [P, G] the step's, for its stats
            block_stop_ms = now_ms()
            log.end(C.BLOCK_STOP, metadata={C.SAMPLES_COUNT: step * gbs, "step": step}, time_ms=block_stop_ms)
            log_tracked_stats(log, step, gbs, {  # commits the block_stop too
                "reduced_train_loss": optimized.loss, "reward": float(rewards.mean()), "grad_norm": optimized.grad_norm,
                "global_valid_toks": optimized.num_valid_tokens, "global_valid_seqs": optimized.num_valid_sequences,
                "train_step_time": time.perf_counter() - step_start_s, "policy_training_time": policy_training_s,
                "generation_time": rollouts.generation_s, "exposed_generation_time": rollouts.exposed_generation_s,
                "weight_sync_time": weight_sync_s, "rollout_weights_version": rollouts.weights_version,
                "num_sequences_masked_by_is": optimized.num_sequences_masked_by_is,
            })
            completed, completed_ms = step, block_stop_ms
            stats = StepStats(
                step=step,
                reward_mean=float(rewards.mean()),
                rollout_pass_rate=float((rewards > 0).any(dim=1).float().mean()),
                loss=optimized.loss,
                grad_norm=optimized.grad_norm,
                weight_update_time_ms=weight_update_time_ms,
                rollout_weights_version=rollouts.weights_version,
                num_sequences_masked_by_is=optimized.num_sequences_masked_by_is,
            )
            result.steps.append(stats)
            if step >= first_eval_step and checkpointer is not None:
                def info(step: int = step, weight_update_time_ms: int = weight_update_time_ms) -> TrainingInfo:
                    return TrainingInfo(  # called by save() while the weights are copied to the host
                        current_step=step,
                        consumed_samples=step * g.num_prompts_per_step,
                        training_step_end_time_ms=weight_update_time_ms,
                        samples_count=rules.samples_count(step, gbs),
                        global_batch_size=gbs,
                        num_generations_per_prompt=g.num_generations_per_prompt,
                        dtype=config.model.dtype,
                        canary_logits=engine.canary_logits() if not engine.canary_is_log_softmax  # raw logits recorded
                        else canary_logits_in_dtype(policy, policy.config.vocab_size, checkpoint_dtype),
                        evaluation=evaluation,
                    )

                # the engine holds the rollout-dtype weights of this step (refit above)
                with stopper.deferred():  # SIGTERM waits for the staging copy, then stops
                    checkpointer.save(_rollout_weights(engine, policy, checkpoint_dtype), info)
            bar.set_postfix(reward=f"{stats.reward_mean:.3f}", acc=f"{stats.rollout_pass_rate:.3f}", refresh=False)
            bar.update(1)
            if step >= first_eval_step and inline_eval is not None and inline_eval(step, policy):
                break
            # a pass needs a published checkpoint: no request (and no collective) before S0
            if inline_eval is None and step >= first_eval_step and (request := _stop_request(run)) is not None:
                result.stop_request = request  # a following evaluator passed: no step after this one
                break
        if checkpointer is not None:  # training's end waits for every write
            checkpointer.finish("finished" if result.stop_request is None else "stopped_by_evaluator")
        log.commit()  # durable: the whole log is on disk before training returns
        distributed.barrier()  # past every rank's last collective: see distributed.barrier
    except BaseException as err:
        if checkpointer is not None:  # publish what is in flight (SIGTERM, Ctrl-C, errors)
            checkpointer.finish(type(err).__name__, raise_error=False)
        # The run's one run_stop: once a checkpoint is published it is the offline
        # evaluator's (it evaluates the published series, however training ended).
        if run is not None and not run.published_steps() and not read_log(log.path).find(C.RUN_STOP):
            log_aborted_run_stop(log, completed, completed * gbs, completed_ms)
            log.commit()
        raise
    finally:
        producer.close()  # waits for a generation in flight (with age 1)
        bar.close()
        if checkpointer is not None:
            result.checkpoint_steps = list(checkpointer.published_steps)
            result.checkpoint_timings = [checkpointer.timings[s] for s in sorted(checkpointer.timings)]
    return result


def _stop_request(run: RunDir | None) -> dict | None:
    """The following evaluator's stop request (``<run>/stop_training.json``), read by
    rank 0 at a step boundary and given to every rank, so all stop after the same step."""
    return distributed.broadcast_object(run.training_stop_request() if run is not None else None)


def _rollout_weights(engine: InferenceEngine, policy: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The rollout-dtype weights a checkpoint stores: the engine's own tensors where it
    hands them out (the HF engine's, refit already, so nothing is cast on the clock;
    under torchrun the only full copy), else the (unsharded) policy's cast to ``dtype``."""
    held = engine.weights()
    if held is not None:
        return held
    return {name: t.detach().to(dtype) for name, t in policy.state_dict().items()}
