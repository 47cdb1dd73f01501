"""The GRPO training driver: setup, train (one step at a time), checkpoint, log.

Reads top to bottom like the lifecycle it runs::

    init_start -> load policy, engine, tasks -> init_stop -> run_start
    for step in 1..max_steps:
        block_start
        take rollouts (age 1: generated while the previous step trained; train/async_rollout.py)
        rewards; advantages; loss over micro-batches; clip; optimizer.step() -> weight-update time
        refit engine <- policy (after the generation in flight)
        block_stop
        step >= first eval step: write deferred checkpoint step_N/
    (no run_stop: the offline evaluator writes it; ``aborted`` only if training fails)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from mlperf_logging.mllog import constants as C  # noqa: N812
from tqdm import tqdm

from mlperf_grpo import rules
from mlperf_grpo.checkpoint import TrainingInfo, write_checkpoint
from mlperf_grpo.config import RunConfig
from mlperf_grpo.evaluate.validator import score
from mlperf_grpo.inference.base import SamplingParams
from mlperf_grpo.inference.hf import HFEngine
from mlperf_grpo.mllog import MLLogWriter, now_ms
from mlperf_grpo.model import DTYPES, check_device, check_model_path, load_model
from mlperf_grpo.rundir import RunDir, RunDirError, RunLock
from mlperf_grpo.tasks import SUITES
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
from mlperf_grpo.train.rollout import PromptSampler, RolloutBatch, build_batch


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


@dataclass
class OptimizeResult:
    """What one optimizer step measured (see :func:`optimize_step`)."""

    loss: float
    """Global-batch token-level mean loss."""
    grad_norm: float
    """Pre-clip gradient norm."""
    num_valid_tokens: int
    """Completion tokens of the sequences kept by the log-prob error filter (the normalizer)."""
    num_sequences_masked_by_is: int
    num_sequences_masked_by_logprob_error: int
    importance_weight_mean: float
    """Mean IS weight over valid tokens (1 without the correction)."""


def policy_logprobs(policy: torch.nn.Module, batch: RolloutBatch, micro_batch_size: int, temperature: float) -> torch.Tensor:
    """The ``prev`` log-probs: a no-grad forward pass of the training policy over the batch.

    Returns:
        ``[B, L-1]`` float32 on the CPU, aligned with ``batch.rollout_logprobs``.
    """
    device = next(policy.parameters()).device
    out = []
    with torch.no_grad():
        for start in range(0, batch.input_ids.shape[0], micro_batch_size):
            sl = slice(start, start + micro_batch_size)
            ids = batch.input_ids[sl].to(device)
            logits = policy(input_ids=ids, attention_mask=batch.attention_mask[sl].to(device)).logits
            out.append(token_logprobs(logits[:, :-1], ids[:, 1:], temperature).cpu())
    return torch.cat(out)


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
) -> OptimizeResult:
    """One optimizer step on a global batch, accumulating gradients over micro-batches.

    With ``needs_prev_logprobs`` a no-grad pass first computes the ``prev`` log-probs
    (:func:`policy_logprobs`); ``seq_logprob_error_threshold`` then drops sequences from
    the mask (:func:`~mlperf_grpo.train.grpo.seq_logprob_error_keep`). Without the pass,
    ``prev`` is ``sg(curr)`` under ``force_on_policy_ratio`` and else the rollout's
    generation log-probs (GRPOConfig.needs_prev_logprobs). Each micro-batch's loss sum is
    divided by the global batch's valid-token count, so the accumulated gradient equals
    that of the token-level mean over the whole batch.
    """
    policy.train()
    optimizer.zero_grad(set_to_none=True)
    device = next(policy.parameters()).device  # the batch is built on the CPU
    mask = batch.completion_mask  # [B, L-1]
    prev = policy_logprobs(policy, batch, micro_batch_size, temperature) if needs_prev_logprobs else None
    masked_by_error = 0
    if seq_logprob_error_threshold is not None:
        if prev is None:
            raise ValueError("seq_logprob_error_threshold needs the prev log-prob pass (needs_prev_logprobs=True)")
        keep, _ = seq_logprob_error_keep(prev, batch.rollout_logprobs, mask, seq_logprob_error_threshold)
        masked_by_error = int(((1 - keep) * (mask.sum(dim=-1) > 0)).sum().item())
        mask = mask * keep.unsqueeze(1)
    if prev is None and not options.force_on_policy_ratio:
        prev = batch.rollout_logprobs
    total_tokens = max(int(mask.sum().item()), 1)
    loss_total, weight_sum, masked_by_is = 0.0, 0.0, 0
    for start in range(0, batch.input_ids.shape[0], micro_batch_size):
        sl = slice(start, start + micro_batch_size)
        ids = batch.input_ids[sl].to(device)
        logits = policy(input_ids=ids, attention_mask=batch.attention_mask[sl].to(device)).logits
        curr = token_logprobs(logits[:, :-1], ids[:, 1:], temperature)  # [mb, L-1]
        part = clipped_pg_loss_sum(
            curr,
            None if prev is None else prev[sl].to(device),
            batch.rollout_logprobs[sl].to(device),
            batch.advantages[sl].to(device),
            mask[sl].to(device),
            options,
        )
        loss = part.loss / total_tokens
        loss.backward()
        loss_total += loss.item()
        weight_sum += part.importance_weight_sum
        masked_by_is += part.num_sequences_masked_by_is
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip_norm)
    optimizer.step()
    policy.eval()
    return OptimizeResult(
        loss=loss_total,
        grad_norm=float(grad_norm),
        num_valid_tokens=int(mask.sum().item()),
        num_sequences_masked_by_is=masked_by_is,
        num_sequences_masked_by_logprob_error=masked_by_error,
        importance_weight_mean=weight_sum / total_tokens,
    )


def train(
    config: RunConfig,
    run: RunDir,
    config_filename: str,
    show_progress: bool = True,
    inline_eval: Callable[[int, torch.nn.Module], bool] | None = None,
) -> TrainResult:
    """Run GRPO training with deferred checkpoints; see the module docstring.

    Args:
        config: the run config.
        run: the run directory (created here).
        config_filename: logged as ``config_filename``.
        show_progress: draw a tqdm bar on stderr.
        inline_eval: ``DEFERRED_OFFLINE_EVAL=0``: called as ``inline_eval(step, policy)``
            after each step from the first eval step on, instead of writing a deferred
            checkpoint; training stops when it returns True (it logged ``run_stop``).
    Raises:
        RunDirError: the output cannot be created or already holds a run (RunLockedError:
            another process writes to it).
        ModelLoadError, LogWriteError, CheckpointWriteError, OSError: setup or I/O failed.
        TrainingStopped, KeyboardInterrupt: SIGTERM or Ctrl-C.
        Any failure after ``run_start`` first logs ``run_stop`` with status ``aborted``.
    """
    check_model_path(config.model.path)  # before anything is written
    check_device(config.model.device)
    try:
        run.root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"cannot create run directory {run.root}: {err.strerror}") from None
    with RunLock(run.root, "trainer"), GracefulStop() as stopper:
        return _train(config, run, config_filename, show_progress, inline_eval, stopper)


def _train(
    config: RunConfig,
    run: RunDir,
    config_filename: str,
    show_progress: bool,
    inline_eval: Callable[[int, torch.nn.Module], bool] | None,
    stopper: GracefulStop,
) -> TrainResult:
    log = MLLogWriter(run.create(config))
    log_submission_and_init_start(log, config)

    torch.manual_seed(config.seed)
    suite = SUITES[config.task.name]
    policy = load_model(config.model.path, "float32", config.model.device)
    engine = HFEngine(config.model.path, config.model.dtype, device=config.model.device)
    pad_id = engine.tokenizer.pad_token_id
    g = config.grpo
    optimizer = torch.optim.AdamW(
        policy.parameters(),
        lr=config.learning_rate,
        betas=(config.optimizer.beta_1, config.optimizer.beta_2),
        eps=config.optimizer.epsilon,
        weight_decay=config.optimizer.weight_decay,
    )
    sampler = PromptSampler(
        suite.train_tasks(config.task.num_train_tasks, config.validation.num_tasks, config.seed), config.seed
    )
    first_eval_step = config.first_eval_step
    gbs = config.global_batch_size
    checkpoint_dtype = DTYPES[config.model.dtype]

    log_hyperparameters(log, config, config_filename)
    log.end(C.INIT_STOP)
    log.start(C.RUN_START)
    log.commit()

    result = TrainResult()
    rollout_params = SamplingParams(g.rollout_temperature, g.rollout_top_p, g.max_new_tokens)
    producer = RolloutProducer(
        engine, sampler, g.num_prompts_per_step, g.num_generations_per_prompt, rollout_params,
        config.seed, g.max_trajectory_age_steps, g.max_steps, config.model.device,
    )
    bar = tqdm(total=g.max_steps, desc="train", unit="step", disable=not show_progress)
    completed = 0  # steps whose optimizer step has returned
    try:
        for step in range(1, g.max_steps + 1):
            log.start(C.BLOCK_START, metadata={C.SAMPLES_COUNT: (step - 1) * gbs, "step": step})
            log.commit()
            step_start_s = time.perf_counter()
            rollouts = producer.take(step)  # with age 1, also starts generating step + 1
            tasks, completions = rollouts.tasks, rollouts.completions
            scored = score(suite.reward, [(c.text, t) for t, group in zip(tasks, completions) for c in group])
            rewards = torch.tensor(scored).view(len(tasks), g.num_generations_per_prompt)  # [P, G]
            advantages = group_advantages(rewards)  # [P, G]
            batch = build_batch(completions, rewards, advantages, pad_id)
            train_start_s = time.perf_counter()
            optimized = optimize_step(
                policy, optimizer, batch, g.micro_batch_size, g.rollout_temperature, PGLossOptions.of(g),
                config.gradient_clip_norm, g.seq_logprob_error_threshold, g.needs_prev_logprobs,
            )
            weight_update_time_ms = now_ms()  # right after optimizer.step() returned
            completed = step
            policy_training_s = time.perf_counter() - train_start_s
            weight_sync_s = producer.refit(policy.state_dict(), weights_version=step)  # for the next rollouts
            log.end(C.BLOCK_STOP, metadata={C.SAMPLES_COUNT: step * gbs, "step": step})
            log_tracked_stats(log, step, gbs, {
                "reduced_train_loss": optimized.loss, "reward": float(rewards.mean()), "grad_norm": optimized.grad_norm,
                "global_valid_toks": optimized.num_valid_tokens, "global_valid_seqs": len(batch.advantages) - optimized.num_sequences_masked_by_logprob_error,
                "train_step_time": time.perf_counter() - step_start_s, "policy_training_time": policy_training_s,
                "generation_time": rollouts.generation_s, "exposed_generation_time": rollouts.exposed_generation_s,
                "weight_sync_time": weight_sync_s, "rollout_weights_version": rollouts.weights_version,
                "num_sequences_masked_by_is": optimized.num_sequences_masked_by_is,
            })
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
            if step >= first_eval_step and inline_eval is None:
                info = TrainingInfo(
                    current_step=step,
                    consumed_samples=step * g.num_prompts_per_step,
                    training_step_end_time_ms=weight_update_time_ms,
                    samples_count=rules.samples_count(step, gbs),
                    global_batch_size=gbs,
                    num_generations_per_prompt=g.num_generations_per_prompt,
                    dtype=config.model.dtype,
                    weights={},
                    canary_logits=engine.canary_logits(),
                )
                state = {k: v.to(checkpoint_dtype) for k, v in policy.state_dict().items()}
                with stopper.deferred():  # SIGTERM waits for the checkpoint to be published
                    write_checkpoint(run.checkpoints, state, info)
                result.checkpoint_steps.append(step)
            bar.set_postfix(reward=f"{stats.reward_mean:.3f}", acc=f"{stats.rollout_pass_rate:.3f}", refresh=False)
            bar.update(1)
            if step >= first_eval_step and inline_eval is not None and inline_eval(step, policy):
                break
    except BaseException:
        log.end(C.RUN_STOP, metadata={C.STATUS: C.ABORTED, C.SAMPLES_COUNT: completed * gbs, "step": completed})
        log.commit()
        raise
    finally:
        producer.close()  # waits for a generation in flight (with age 1)
        bar.close()
    return result

