"""The MLPerf events the trainer logs before ``run_start`` (ruleset 6.1.0)."""

from __future__ import annotations

from mlperf_logging.mllog import constants as C  # noqa: N812

from mlperf_grpo import rules
from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.logs.mllog import MLLogWriter

PRECISION = {"float32": "fp32", "bfloat16": "bfloat16"}


def micro_batch_size(config: RunConfig, data_parallel_size: int = 1) -> int:
    """The logged completions per pass: ``grpo.micro_batch_size``; with
    ``grpo.micro_batch_tokens`` the most one pass can hold: the rows of a rank's share
    (``GBS / N``), or the row cap ``micro_batch_size`` where it is fewer, so the logged
    accumulation steps (:func:`gradient_accumulation_steps`) are the fewest a step takes
    (the passes follow the completions' lengths: ``train/packing.py``)."""
    g = config.grpo
    share = config.global_batch_size // data_parallel_size
    if g.micro_batch_tokens is None:
        return g.micro_batch_size
    return share if g.micro_batch_size is None else min(g.micro_batch_size, share)


def gradient_accumulation_steps(config: RunConfig, data_parallel_size: int = 1) -> int:
    """Passes a rank makes a step, at least: its ``GBS / N`` rows over
    :func:`micro_batch_size` rows a pass, rounded up (a row cap of 3 over 32 rows: 11
    passes, not 10; a cap above the share: 1, not 0)."""
    share = config.global_batch_size // data_parallel_size
    return -(-share // micro_batch_size(config, data_parallel_size))


def hyperparameters(config: RunConfig, config_filename: str, data_parallel_size: int = 1) -> dict[str, object]:
    """Every hyperparameter key the 6.1.0 checker requires for ``qwen35_397b_grpo``, and
    ``data_parallelism`` (the torchrun world size; the checker neither requires nor refuses it).

    ``gradient_accumulation_steps`` is per rank: ``GBS / (data_parallel_size x micro_batch_size)``
    rounded up (:func:`gradient_accumulation_steps`; with a token budget the passes a step
    vary, see :func:`micro_batch_size`).
    Returns:
        key -> value, in the order they are logged. Tensor, pipeline, context and expert
        parallelism are 1 (the policy is sharded data-parallel only: FSDP).
    """
    g = config.grpo
    micro = micro_batch_size(config, data_parallel_size)
    return {
        C.SEED: config.seed,
        C.GLOBAL_BATCH_SIZE: config.global_batch_size,
        "num_prompts_per_step": g.num_prompts_per_step,
        "num_generations_per_prompt": g.num_generations_per_prompt,
        C.TRAIN_SAMPLES: config.task.num_train_tasks,
        C.EVAL_SAMPLES: config.validation.num_tasks,
        "max_sequence_length": g.max_sequence_length,
        "init_checkpoint_step": rules.INIT_CHECKPOINT_STEP,
        "max_steps": g.max_steps,
        C.OPT_NAME: "adamw",
        C.OPT_BASE_LR: config.learning_rate,
        C.OPT_ADAMW_BETA_1: config.optimizer.beta_1,
        C.OPT_ADAMW_BETA_2: config.optimizer.beta_2,
        C.OPT_ADAMW_EPSILON: config.optimizer.epsilon,
        C.OPT_ADAMW_WEIGHT_DECAY: config.optimizer.weight_decay,
        C.OPT_GRADIENT_CLIP_NORM: config.gradient_clip_norm,
        C.OPT_LR_WARMUP_STEPS: rules.LEARNING_RATE_WARMUP_STEPS,
        "opt_learning_rate_decay_schedule": rules.LEARNING_RATE_DECAY_SCHEDULE,
        "generation_training_rollout_temperature": g.rollout_temperature,
        "generation_training_rollout_top_p": g.rollout_top_p,
        "generation_validation_rollout_temperature": config.validation.temperature,
        "generation_validation_rollout_top_p": config.validation.top_p,
        C.GRADIENT_ACCUMULATION_STEPS: gradient_accumulation_steps(config, data_parallel_size),
        "micro_batch_size": micro,
        "micro_batch_tokens": g.micro_batch_tokens,
        "lowest_numerical_precision_in_linear": PRECISION[config.model.dtype],
        "lowest_numerical_precision_in_attn": PRECISION[config.model.dtype],
        "lowest_numerical_precision_in_comm": PRECISION[config.model.dtype],
        "data_parallelism": data_parallel_size,
        "tensor_parallelism": 1,
        "pipeline_parallelism": 1,
        "context_parallelism": 1,
        "expert_parallelism": 1,
        "config_filename": config_filename,
        **truncated_importance_sampling(config),
    }


def log_submission_and_init_start(log: MLLogWriter, config: RunConfig, time_ms: int | None = None) -> None:
    """``cache_clear``, ``init_start`` and the ``submission_*`` keys, committed.

    ``time_ms`` (Unix ms, default now): when initialization began, for a caller that
    loads the model before the run directory and its log exist.
    """
    log.event(C.CACHE_CLEAR, True, time_ms=time_ms)
    log.start(C.INIT_START, time_ms=time_ms)
    log.event(C.SUBMISSION_BENCHMARK, rules.BENCHMARK, time_ms=time_ms)
    log.event(C.SUBMISSION_ORG, config.submission.org, time_ms=time_ms)
    log.event(C.SUBMISSION_DIVISION, config.division, time_ms=time_ms)
    log.event(C.SUBMISSION_STATUS, "onprem", time_ms=time_ms)
    log.event(C.SUBMISSION_PLATFORM, config.submission.platform, time_ms=time_ms)
    log.commit()


def truncated_importance_sampling(config: RunConfig) -> dict[str, object]:
    """The reference's ``truncated_importance_sampling_{ratio_min,ratio,type}`` keys.

    Logged, as NeMo-RL's ``mlperf_grpo_logging.py`` does, only when a truncation type is
    set (the reference skips ``None`` values). The 6.1.0 checker neither requires nor
    refuses them.
    """
    g = config.grpo
    if g.truncated_importance_sampling_type is None:
        return {}
    return {
        "truncated_importance_sampling_ratio_min": g.truncated_importance_sampling_ratio_min,
        "truncated_importance_sampling_ratio": g.truncated_importance_sampling_ratio,
        "truncated_importance_sampling_type": g.truncated_importance_sampling_type,
    }


def log_tracked_stats(log: MLLogWriter, step: int, global_batch_size: int, stats: dict[str, object]) -> None:
    """One ``tracked_stats`` event for a finished training step, committed (not yet fsynced:
    see :class:`~mlperf_grpo.logs.mllog.MLLogWriter`; the trainer syncs before publishing).

    ``stats`` uses the reference's names (``reduced_train_loss``, ``reward``,
    ``grad_norm``, ``global_valid_toks``, ``global_valid_seqs``, ``train_step_time``,
    ``policy_training_time``, ``generation_time``, ``exposed_generation_time``,
    ``weight_sync_time``; times in seconds) plus ours (``exposed_reward_time``: seconds the
    step waited for its rewards after its generation, ``rollout_weights_version``,
    ``num_sequences_masked_by_is``, ``reward_timeouts``: completions whose verification
    timed out and scored 0, ``entropy``: the policy's token-mean entropy over the loss's
    tokens before the update, in nats). Metadata: ``samples_count`` and ``step``, as NeMo-RL.
    """
    log.event("tracked_stats", stats, metadata={C.SAMPLES_COUNT: rules.samples_count(step, global_batch_size), "step": step})
    log.commit(durable=False)



def log_hyperparameters(log: MLLogWriter, config: RunConfig, config_filename: str, data_parallel_size: int = 1) -> None:
    """All of :func:`hyperparameters`, committed."""
    for key, value in hyperparameters(config, config_filename, data_parallel_size).items():
        log.event(key, value)
    log.commit()
