"""Benchmark constants and closed-division formulas for ``qwen35_397b_grpo``.

Pure functions, no I/O. Every number here comes from the MLPerf Training rules
(ruleset 6.1.0) as encoded in ``mlperf_logging/compliance_checker/training_6.1.0/
closed_qwen35_397b_grpo.yaml`` and summarized in ``shared/DESIGN.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

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

REFERENCE_RECIPE_FILE = "qwen_35/configs/grpo_qwen35_397b_swe_openhands_async.yaml"
"""Where the reference algorithm's values come from (its ``loss_fn``, ``grpo`` and
``grpo.async_grpo`` sections): the recipe file in NVIDIA-NeMo/RL branch
``mlperf-training-qwen35-main`` (the same text as ``docker/mlperf/conf/``'s copy; its ``_gbs256/_gbs512/_gbs1024`` children set only
batch-dependent values)."""

REFERENCE_ALGORITHM_KEYS: dict[str, str] = {
    "ratio_clip_min": "loss_fn.ratio_clip_min",
    "ratio_clip_max": "loss_fn.ratio_clip_max",
    "force_on_policy_ratio": "loss_fn.force_on_policy_ratio",
    "use_importance_sampling_correction": "loss_fn.use_importance_sampling_correction",
    "truncated_importance_sampling_type": "loss_fn.truncated_importance_sampling_type",
    "truncated_importance_sampling_ratio": "loss_fn.truncated_importance_sampling_ratio",
    "truncated_importance_sampling_ratio_min": "loss_fn.truncated_importance_sampling_ratio_min",
    "seq_logprob_error_threshold": "grpo.seq_logprob_error_threshold",
    "max_trajectory_age_steps": "grpo.async_grpo.max_trajectory_age_steps",
    "use_leave_one_out_baseline": "grpo.use_leave_one_out_baseline",
    "normalize_rewards": "grpo.normalize_rewards",
    "overlong_filtering": "grpo.overlong_filtering",
}
"""Where each :data:`REFERENCE_ALGORITHM` key sits in :data:`REFERENCE_RECIPE_FILE`."""

REFERENCE_ALGORITHM: dict[str, object] = {
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.28,
    "force_on_policy_ratio": True,
    "use_importance_sampling_correction": True,
    "truncated_importance_sampling_type": "seq-mask-tis",
    "truncated_importance_sampling_ratio": 1.002,
    "truncated_importance_sampling_ratio_min": 0.999,
    "seq_logprob_error_threshold": 2.0,
    "max_trajectory_age_steps": 1,
    "use_leave_one_out_baseline": True,
    "normalize_rewards": True,
    "overlong_filtering": True,
}
"""Closed division: the reference's GRPO algorithm, as ``grpo.<key>`` values of our config
(same names as the recipe's keys; their places in the recipe: :data:`REFERENCE_ALGORITHM_KEYS`).
Also fixed there and in our trainer: token-level loss, no KL penalty, no dual clip,
token-level (not sequence-level) importance ratios, dynamic sampling off, no advantage
clipping, reward shaping and scaling off."""

REFERENCE_AGENT: dict[str, object] = {
    "max_turns": 30,
    "max_context_tokens": MAX_SEQUENCE_LENGTH,
    "max_new_tokens_per_turn": None,
    "trajectory_timeout_s": 1800.0,
    "command_timeout_s": 60.0,
    "test_timeout_s": 60.0,
    "tools": ["execute_bash", "str_replace_editor", "finish"],
}
"""Closed division, ``task.name: swe``: the reference agent's limits as ``agent.<key>``
values. Source: the benchmark's reference README (mlcommons/training PR #904/#906,
NeMo-RL ``mlperf-training-qwen35`` line; DESIGN.md "The benchmark's workload"): up to 30
turns, context and max generation 65,536 tokens (so a turn may generate up to the
context: ``max_new_tokens_per_turn`` null), timeouts 1,800 s a trajectory, 60 s a
command, 60 s the tests; the tools of OpenHands' CodeAct agent as NeMo Gym runs it
(``agent/tools.py``). The observation truncation (``agent.max_observation_chars``) is not
fixed here: its reference value was not found."""

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



# --- Closed-division conformance -------------------------------------------------------

PROMPT_GROUP = NUM_GENERATIONS_PER_PROMPT
"""A closed GBS is ``num_prompts_per_step * 16``, so it must be a positive multiple of 16."""


def check_closed_global_batch_size(global_batch_size: object) -> int:
    """Return ``global_batch_size`` if it can be a closed-division GBS.

    Raises:
        ValueError: not an integer, not positive, or not a multiple of 16 (one line).
    """
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int):
        raise ValueError(f"global batch size must be an integer, got {global_batch_size!r}")
    if global_batch_size <= 0:
        raise ValueError(f"global batch size must be positive, got {global_batch_size}")
    if global_batch_size % PROMPT_GROUP:
        raise ValueError(
            f"global batch size must be a multiple of {PROMPT_GROUP} (num_prompts_per_step x "
            f"{PROMPT_GROUP} generations), got {global_batch_size}"
        )
    return global_batch_size


FIRST_EVAL_STEP_FORMULA = "ceil(2.5 + 3840/GBS)"
LEARNING_RATE_FORMULA = "1e-6*sqrt(GBS/256)"
GRADIENT_CLIP_FORMULA = "0.125*sqrt(256/GBS)"
DERIVED_TOLERANCE = 1e-9
"""The 6.1.0 compliance checker accepts a derived float within this absolute distance."""


@dataclass(frozen=True)
class Violation:
    """One value that departs from the closed-division rules.

    ``field`` is the config key path, ``given`` the value in the config, ``required`` the
    closed value, ``formula`` where the required value comes from; ``must_omit``: a
    derived value that a closed config must leave out (or write null), even when equal.
    """

    field: str
    given: object
    required: object
    formula: str
    must_omit: bool = False
    """A derived value typed in a closed config: wrong even when equal to ``required``."""

    def __str__(self) -> str:
        if not self.must_omit:
            return f"{self.field}: given {self.given!r}, required {self.required!r} ({self.formula})"
        if abs(self.given - self.required) <= DERIVED_TOLERANCE:
            return (f"{self.field}: omit the key or write null; a closed config never types a derived value, "
                    f"even an equal one (given {self.given!r}; {self.formula})")
        return f"{self.field}: given {self.given!r}, required {self.required!r} ({self.formula}; omit the key or write null)"


def _fixed_rules(config) -> list[tuple[str, object, object, str]]:
    """``(field, given, required, source)`` for every fixed closed value of a RunConfig."""
    g, o, v = config.grpo, config.optimizer, config.validation
    return [
        ("grpo.num_generations_per_prompt", g.num_generations_per_prompt, NUM_GENERATIONS_PER_PROMPT, "fixed"),
        ("grpo.max_sequence_length", g.max_sequence_length, MAX_SEQUENCE_LENGTH, "fixed"),
        ("grpo.rollout_temperature", g.rollout_temperature, ROLLOUT_TEMPERATURE, "fixed: training rollouts"),
        ("grpo.rollout_top_p", g.rollout_top_p, ROLLOUT_TOP_P, "fixed: training rollouts"),
        *((f"grpo.{key}", getattr(g, key), value, "reference algorithm") for key, value in REFERENCE_ALGORITHM.items()),
        ("optimizer.beta_1", o.beta_1, ADAMW_BETA_1, "fixed: AdamW"),
        ("optimizer.beta_2", o.beta_2, ADAMW_BETA_2, "fixed: AdamW"),
        ("optimizer.epsilon", o.epsilon, ADAMW_EPSILON, "fixed: AdamW"),
        ("optimizer.weight_decay", o.weight_decay, ADAMW_WEIGHT_DECAY, "fixed: AdamW"),
        ("validation.num_tasks", v.num_tasks, EVAL_SAMPLES, "fixed: eval_samples"),
        ("validation.generations_per_task", v.generations_per_task, EVAL_GENERATIONS_PER_TASK, "fixed: pass@4"),
        ("validation.temperature", v.temperature, VALIDATION_TEMPERATURE, "fixed: validation rollouts"),
        ("validation.top_p", v.top_p, VALIDATION_TOP_P, "fixed: validation rollouts"),
        *((f"agent.{key}", getattr(config.agent, key), value, "reference agent")
          for key, value in REFERENCE_AGENT.items() if config.task.name == "swe"),
    ]


def _derived_rules(config) -> list[tuple[str, object, object, str]]:
    """``(field, typed value or None, derived value, formula)`` of the GBS-derived values."""
    gbs = config.global_batch_size
    return [
        ("grpo.first_eval_step", config.grpo.first_eval_step, first_eval_step(gbs), FIRST_EVAL_STEP_FORMULA),
        ("optimizer.learning_rate", config.optimizer.learning_rate, closed_learning_rate(gbs), LEARNING_RATE_FORMULA),
        ("optimizer.gradient_clip_norm", config.optimizer.gradient_clip_norm, closed_gradient_clip_norm(gbs), GRADIENT_CLIP_FORMULA),
    ]


def closed_violations(config) -> list[Violation]:
    """Every value of a run config that departs from the closed-division rules.

    Args:
        config: a :class:`mlperf_grpo.config.run.RunConfig` (read only; any division).
    Returns:
        One :class:`Violation` per departing value, in config order; empty when the
        config conforms. Derived values (first eval step, learning rate, gradient clip)
        are never typed in a closed config: any explicit value, even an equal one, is a
        violation there (the config must omit the key or write ``null``). For an open
        config the same list tells which values differ from closed, a derived value
        counting when it differs from the formula by more than 1e-9.
    Source: ``mlperf_logging/compliance_checker/training_6.1.0/closed_qwen35_397b_grpo.yaml``
    (and the GBS rule: ``num_generations_per_prompt`` 16, ``GBS = prompts x 16``); the
    algorithm's values from :data:`REFERENCE_RECIPE_FILE` (:data:`REFERENCE_ALGORITHM`).
    """
    closed = config.division == "closed"
    found = [Violation(f, given, req, src) for f, given, req, src in _fixed_rules(config) if given != req]
    gbs = config.global_batch_size
    for field, typed, derived, formula in _derived_rules(config):
        if typed is None:
            continue
        if closed:
            found.append(Violation(field, typed, derived, f"derived: {formula} at GBS {gbs}", must_omit=True))
        elif abs(typed - derived) > DERIVED_TOLERANCE:
            found.append(Violation(field, typed, derived, f"derived: {formula} at GBS {gbs}"))
    s0 = config.first_eval_step
    if config.grpo.max_steps < s0:
        found.append(Violation("grpo.max_steps", config.grpo.max_steps, f">= {s0}", "first eval step: no checkpoint is evaluated before it"))
    return found


def closed_plan(global_batch_size: int, num_later_evals: int = 5) -> dict[str, object]:
    """Every closed-division value for one GBS, in the order ``mlperf-grpo plan`` prints.

    Args:
        global_batch_size: a positive multiple of 16.
        num_later_evals: how many eval ``samples_count`` values after the first to list.
    Returns:
        name -> value (JSON-serializable).
    Raises:
        ValueError: the GBS is not a positive multiple of 16.
    """
    gbs = check_closed_global_batch_size(global_batch_size)
    s0 = first_eval_step(gbs)
    return {
        "benchmark": BENCHMARK,
        "ruleset": RULESET,
        "global_batch_size": gbs,
        "num_prompts_per_step": gbs // NUM_GENERATIONS_PER_PROMPT,
        "num_generations_per_prompt": NUM_GENERATIONS_PER_PROMPT,
        "first_eval_step": s0,
        "first_eval_step_formula": FIRST_EVAL_STEP_FORMULA,
        "first_eval_samples_count": samples_count(s0, gbs),
        "later_eval_samples_count": [samples_count(s0 + i, gbs) for i in range(1, num_later_evals + 1)],
        "eval_samples_count_rule": "step * GBS; each next eval + GBS, contiguous, in step order",
        "opt_name": "adamw",
        "opt_base_learning_rate": closed_learning_rate(gbs),
        "opt_base_learning_rate_formula": LEARNING_RATE_FORMULA,
        "opt_gradient_clip_norm": closed_gradient_clip_norm(gbs),
        "opt_gradient_clip_norm_formula": GRADIENT_CLIP_FORMULA,
        "opt_adamw_beta_1": ADAMW_BETA_1,
        "opt_adamw_beta_2": ADAMW_BETA_2,
        "opt_adamw_epsilon": ADAMW_EPSILON,
        "opt_adamw_weight_decay": ADAMW_WEIGHT_DECAY,
        "opt_learning_rate_warmup_steps": LEARNING_RATE_WARMUP_STEPS,
        "opt_learning_rate_decay_schedule": LEARNING_RATE_DECAY_SCHEDULE,
        "generation_training_rollout_temperature": ROLLOUT_TEMPERATURE,
        "generation_training_rollout_top_p": ROLLOUT_TOP_P,
        "generation_validation_rollout_temperature": VALIDATION_TEMPERATURE,
        "generation_validation_rollout_top_p": VALIDATION_TOP_P,
        "eval_samples": EVAL_SAMPLES,
        "eval_generations_per_task": EVAL_GENERATIONS_PER_TASK,
        "max_sequence_length": MAX_SEQUENCE_LENGTH,
        "init_checkpoint_step": INIT_CHECKPOINT_STEP,
        "target": f"eval_accuracy > {TARGET_ACCURACY}",
        **REFERENCE_ALGORITHM,
        **{f"agent_{key}": value for key, value in REFERENCE_AGENT.items()},
        "reference_algorithm_source": f"NVIDIA-NeMo/RL mlperf-training-qwen35-main {REFERENCE_RECIPE_FILE}",
        "reference_algorithm_keys": dict(REFERENCE_ALGORITHM_KEYS),
        "runs_per_submission": 3,
    }
