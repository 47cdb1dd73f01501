"""Benchmark constants and closed-division formulas for ``qwen35_397b_grpo``.

Pure functions, no I/O. Every number here comes from the MLPerf Training rules
(ruleset 6.1.0) as encoded in ``mlperf_logging/compliance_checker/training_6.1.0/
closed_qwen35_397b_grpo.yaml`` and summarized in ``shared/DESIGN.md``.
"""

from __future__ import annotations

BENCHMARK = "qwen35_397b_grpo"
RULESET = "6.1.0"

NUM_GENERATIONS_PER_PROMPT = 16
"""Closed division: completions sampled per prompt in a training rollout."""

TARGET_ACCURACY = 0.69
"""An evaluation passes only when ``eval_accuracy > TARGET_ACCURACY`` (strict)."""

EVAL_SAMPLES = 251
"""Validation tasks evaluated per checkpoint (logged as ``eval_samples``)."""

EVAL_GENERATIONS_PER_TASK = 4
"""Generations per validation task; accuracy is pass@4."""

VALIDATION_TEMPERATURE = 0.1
VALIDATION_TOP_P = 0.95
ROLLOUT_TEMPERATURE = 1.0
ROLLOUT_TOP_P = 1.0

MAX_SEQUENCE_LENGTH = 65536
INIT_CHECKPOINT_STEP = 0

ADAMW_BETA_1 = 0.9
ADAMW_BETA_2 = 0.999
ADAMW_EPSILON = 1e-8
ADAMW_WEIGHT_DECAY = 0.0
LEARNING_RATE_WARMUP_STEPS = 0
LEARNING_RATE_DECAY_SCHEDULE = "constant"

REFERENCE_SAMPLES_TO_CONVERGE = {256: 4608, 512: 5120, 1024: 7168}
"""Reference convergence (samples) of the RCPs of ruleset 6.1.0, from DESIGN.md."""


def _check_global_batch_size(global_batch_size: int) -> None:
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size <= 0:
        raise ValueError(
            f"global batch size must be a positive integer, got {global_batch_size!r}"
        )


def first_eval_step(global_batch_size: int) -> int:
    """First-evaluation step ``S0 = ceil(2.5 + 3840 / GBS)`` (1-based step number).

    Args:
        global_batch_size: completions per optimizer step (prompts x generations).
    Returns:
        The step from which every step is checkpointed and evaluated: 18 at GBS 256,
        10 at 512, 7 at 1024.
    Raises:
        ValueError: GBS is not a positive integer.
    Source: MLPerf Training rules for qwen35_397b_grpo; the compliance checker computes
    ``validation_start_samples = GBS * ceil(2.5 + 3840 / GBS)``.
    """
    _check_global_batch_size(global_batch_size)
    # Exact integer form of ceil(2.5 + 3840/GBS) = ceil((5*GBS + 7680) / (2*GBS)),
    # so no float rounding can move the result.
    return -(-(5 * global_batch_size + 7680) // (2 * global_batch_size))


def samples_count(step: int, global_batch_size: int) -> int:
    """``samples_count`` logged for a step: ``step * GBS`` (completions trained on)."""
    _check_global_batch_size(global_batch_size)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return step * global_batch_size


def closed_learning_rate(global_batch_size: int) -> float:
    """Closed-division AdamW learning rate ``1e-6 * sqrt(GBS / 256)`` (constant)."""
    _check_global_batch_size(global_batch_size)
    return 1.0e-6 * (global_batch_size / 256) ** 0.5


def closed_gradient_clip_norm(global_batch_size: int) -> float:
    """Closed-division gradient-norm clip ``0.125 * sqrt(256 / GBS)``."""
    _check_global_batch_size(global_batch_size)
    return 0.125 * (256 / global_batch_size) ** 0.5


def is_passing(accuracy: float, target: float = TARGET_ACCURACY) -> bool:
    """True when ``accuracy`` beats the target. The comparison is strict: equal fails."""
    return accuracy > target


def pass_at_k(rewards_per_task: list[list[float]]) -> float:
    """pass@k accuracy: mean over tasks of "any of the k rewards > 0".

    Args:
        rewards_per_task: one list of k rewards per task (k may differ per task).
    Returns:
        A float in [0, 1].
    Raises:
        ValueError: no tasks, or a task with no rewards.
    Source: DESIGN.md ("accuracy = pass@4 = mean over tasks of any of the 4 rewards > 0").
    """
    if not rewards_per_task:
        raise ValueError("pass@k needs at least one task")
    passed = 0
    for rewards in rewards_per_task:
        if not rewards:
            raise ValueError("pass@k: a task has no rewards")
        passed += any(r > 0 for r in rewards)
    return passed / len(rewards_per_task)


def is_contiguous_eval_series(steps: list[int], global_batch_size: int) -> bool:
    """True when ``steps`` is ``S0, S0+1, ..., S0+n-1`` (what the closed checker expects)."""
    s0 = first_eval_step(global_batch_size)
    return steps == list(range(s0, s0 + len(steps)))

