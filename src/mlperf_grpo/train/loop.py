"""The GRPO training driver: setup, train (one step at a time), checkpoint, log.

Reads top to bottom like the lifecycle it runs::

    init_start -> load policy, engine, tasks -> init_stop -> run_start
    for step in 1..max_steps:
        block_start
        refit engine <- policy; rollouts; rewards; advantages
        loss over micro-batches; clip; optimizer.step()   -> weight-update time
        block_stop
        step >= first eval step: stage the weights; step_N/ is written in the background
    training's end: wait until every checkpoint is published (checkpoints/training_end.json)
    (no run_stop: the offline evaluator writes it; ``aborted`` only if training fails)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from mlperf_logging.mllog import constants as C  # noqa: N812
from tqdm import tqdm

from mlperf_grpo import rules
from mlperf_grpo.checkpoint import AsyncCheckpointer, CheckpointTiming, TrainingInfo
from mlperf_grpo.config import RunConfig
from mlperf_grpo.evaluate.validator import score
from mlperf_grpo.inference.base import SamplingParams
from mlperf_grpo.inference.hf import HFEngine
from mlperf_grpo.mllog import MLLogWriter, now_ms
from mlperf_grpo.model import check_device, check_model_path, load_model
from mlperf_grpo.rundir import RunDir, RunDirError, RunLock
from mlperf_grpo.tasks import SUITES
from mlperf_grpo.train.grpo import clipped_pg_loss_sum, group_advantages, token_logprobs
from mlperf_grpo.train.mlperf_events import log_hyperparameters, log_submission_and_init_start
from mlperf_grpo.train.stop import GracefulStop
from mlperf_grpo.train.rollout import PromptSampler, RolloutBatch, build_batch, generate_rollouts


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


@dataclass
class TrainResult:
    """Outcome of :func:`train`."""

    steps: list[StepStats] = field(default_factory=list)
    checkpoint_steps: list[int] = field(default_factory=list)
    """Steps whose checkpoint was published."""
    checkpoint_timings: list[CheckpointTiming] = field(default_factory=list)


def optimize_step(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    micro_batch_size: int,
    temperature: float,
    clip_eps: float,
    grad_clip_norm: float,
) -> tuple[float, float]:
    """One optimizer step on a global batch, accumulating gradients over micro-batches.

    Each micro-batch's loss sum is divided by the global batch's valid-token count, so
    the accumulated gradient equals that of the token-level mean over the whole batch.
    Returns:
        ``(loss, grad_norm)``: the global-batch mean loss and the pre-clip gradient norm.
    """
    policy.train()
    optimizer.zero_grad(set_to_none=True)
    total_tokens = max(batch.num_tokens, 1)
    device = next(policy.parameters()).device  # the batch is built on the CPU
    loss_total = 0.0
    for start in range(0, batch.input_ids.shape[0], micro_batch_size):
        sl = slice(start, start + micro_batch_size)
        ids = batch.input_ids[sl].to(device)
        logits = policy(input_ids=ids, attention_mask=batch.attention_mask[sl].to(device)).logits
        logprobs = token_logprobs(logits[:, :-1], ids[:, 1:], temperature)  # [mb, L-1]
        loss = clipped_pg_loss_sum(
            logprobs,
            batch.rollout_logprobs[sl].to(device),
            batch.advantages[sl].to(device),
            batch.completion_mask[sl].to(device),
            clip_eps,
        ) / total_tokens
        loss.backward()
        loss_total += loss.item()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip_norm)
    optimizer.step()
    policy.eval()
    return loss_total, float(grad_norm)


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
    # the non-weight files are snapshotted (and fingerprinted) now, at training start
    checkpointer = None if inline_eval is not None else AsyncCheckpointer(
        run.checkpoints, check_model_path(config.model.path), config.checkpoint.max_in_flight
    )

    if checkpointer is not None:
        checkpointer.prepare(engine.model.state_dict())  # host staging buffers, off the clock
    log_hyperparameters(log, config, config_filename)
    log.end(C.INIT_STOP)
    log.start(C.RUN_START)
    log.commit()

    result = TrainResult()
    bar = tqdm(total=g.max_steps, desc="train", unit="step", disable=not show_progress)
    completed = 0  # steps whose optimizer step has returned
    try:
        for step in range(1, g.max_steps + 1):
            if checkpointer is not None:
                checkpointer.raise_if_failed()  # a failed background write stops training here
            log.start(C.BLOCK_START, metadata={C.SAMPLES_COUNT: (step - 1) * gbs, "step": step})
            log.commit()
            tasks = sampler.sample(g.num_prompts_per_step)
            params = SamplingParams(g.rollout_temperature, g.rollout_top_p, g.max_new_tokens)
            completions = generate_rollouts(engine, tasks, g.num_generations_per_prompt, params, config.seed, step)
            scored = score(suite.reward, [(c.text, t) for t, group in zip(tasks, completions) for c in group])
            rewards = torch.tensor(scored).view(len(tasks), g.num_generations_per_prompt)  # [P, G]
            advantages = group_advantages(rewards)  # [P, G]
            batch = build_batch(completions, rewards, advantages, pad_id)
            loss, grad_norm = optimize_step(
                policy, optimizer, batch, g.micro_batch_size, g.rollout_temperature, g.ratio_clip_eps, config.gradient_clip_norm
            )
            weight_update_time_ms = now_ms()  # right after optimizer.step() returned
            completed = step
            engine.load_weights(policy.state_dict())  # refit for the next rollouts
            log.end(C.BLOCK_STOP, metadata={C.SAMPLES_COUNT: step * gbs, "step": step})
            log.commit()
            stats = StepStats(
                step=step,
                reward_mean=float(rewards.mean()),
                rollout_pass_rate=float((rewards > 0).any(dim=1).float().mean()),
                loss=loss,
                grad_norm=grad_norm,
                weight_update_time_ms=weight_update_time_ms,
            )
            result.steps.append(stats)
            if step >= first_eval_step and checkpointer is not None:
                info = TrainingInfo(
                    current_step=step,
                    consumed_samples=step * g.num_prompts_per_step,
                    training_step_end_time_ms=weight_update_time_ms,
                    samples_count=rules.samples_count(step, gbs),
                    global_batch_size=gbs,
                    num_generations_per_prompt=g.num_generations_per_prompt,
                    dtype=config.model.dtype,
                    canary_logits=engine.canary_logits(),
                )
                # the engine holds the rollout-dtype weights of this step (refit above)
                with stopper.deferred():  # SIGTERM waits for the staging copy, then stops
                    checkpointer.save(engine.model.state_dict(), info)
            bar.set_postfix(reward=f"{stats.reward_mean:.3f}", acc=f"{stats.rollout_pass_rate:.3f}", refresh=False)
            bar.update(1)
            if step >= first_eval_step and inline_eval is not None and inline_eval(step, policy):
                break
        if checkpointer is not None:
            checkpointer.finish("finished")  # training's end waits for every write
    except BaseException as err:
        if checkpointer is not None:  # publish what is in flight (SIGTERM, Ctrl-C, errors)
            checkpointer.finish(type(err).__name__, raise_error=False)
        log.end(C.RUN_STOP, metadata={C.STATUS: C.ABORTED, C.SAMPLES_COUNT: completed * gbs, "step": completed})
        log.commit()
        raise
    finally:
        bar.close()
        if checkpointer is not None:
            result.checkpoint_steps = list(checkpointer.published_steps)
            result.checkpoint_timings = [checkpointer.timings[s] for s in sorted(checkpointer.timings)]
    return result

