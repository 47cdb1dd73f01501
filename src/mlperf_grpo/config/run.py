"""The typed run config: :class:`RunConfig`, the whole of a run's YAML (its sections in
``config/sections.py``), the values derived from the global batch size, the rules
across sections and the closed division's omitted keys.

Every field has a default, so an empty file (or no file) gives the built-in default
run; YAML in and the errors' wording: ``config/load.py``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from mlperf_grpo import rules
from mlperf_grpo.config.sections import (
    AgentConfig,
    CheckpointConfig,
    DistributedConfig,
    GRPOConfig,
    InferenceConfig,
    ModelConfig,
    OptimizerConfig,
    Strict,
    SubmissionConfig,
    TaskConfig,
    ValidationConfig,
)


class RunConfig(Strict):
    """A whole run: what ``mlperf-grpo run|train|evaluate`` read from ``--config``."""

    division: Literal["open", "closed"] = "open"
    seed: int = Field(1, ge=0, lt=2**63)
    """The run's seed: 0 .. 2^63 - 1 (what a torch generator and the rows' seeds, int64, hold)."""
    submission: SubmissionConfig = SubmissionConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    agent: AgentConfig = AgentConfig()
    grpo: GRPOConfig = GRPOConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    validation: ValidationConfig = ValidationConfig()
    inference: InferenceConfig = InferenceConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    distributed: DistributedConfig = DistributedConfig()

    @property
    def global_batch_size(self) -> int:
        """Completions per optimizer step (``grpo.num_prompts_per_step`` x generations)."""
        return self.grpo.global_batch_size

    @property
    def learning_rate(self) -> float:
        """Configured learning rate, or the closed formula ``1e-6*sqrt(GBS/256)``."""
        lr = self.optimizer.learning_rate
        return rules.closed_learning_rate(self.global_batch_size) if lr is None else lr

    @property
    def gradient_clip_norm(self) -> float:
        """Configured clip, or the closed formula ``0.125*sqrt(256/GBS)``."""
        clip = self.optimizer.gradient_clip_norm
        return rules.closed_gradient_clip_norm(self.global_batch_size) if clip is None else clip

    @property
    def first_eval_step(self) -> int:
        """``grpo.first_eval_step`` when set (open division), else ``ceil(2.5 + 3840/GBS)``."""
        s0 = self.grpo.first_eval_step
        return rules.first_eval_step(self.global_batch_size) if s0 is None else s0

    @model_validator(mode="before")
    @classmethod
    def _closed_learning_rate_is_derived(cls, data: object) -> object:
        """In a closed config an omitted ``optimizer.learning_rate`` means derived (null).

        (The open default is :data:`~mlperf_grpo.config.sections.DEFAULT_LEARNING_RATE`.) An explicit value stays, so
        :func:`rules.closed_violations` can refuse it.
        """
        if not isinstance(data, dict) or data.get("division") != "closed":
            return data
        optimizer = data.get("optimizer")
        if optimizer is None:
            optimizer = {}
        if isinstance(optimizer, dict) and "learning_rate" not in optimizer:
            return {**data, "optimizer": {**optimizer, "learning_rate": None}}
        if isinstance(optimizer, OptimizerConfig) and "learning_rate" not in optimizer.model_fields_set:
            return {**data, "optimizer": optimizer.model_copy(update={"learning_rate": None})}
        return data

    @model_validator(mode="before")
    @classmethod
    def _closed_algorithm_is_the_reference(cls, data: object) -> object:
        """In a closed config an omitted algorithm key takes the reference's value.

        (:data:`rules.REFERENCE_ALGORITHM`; the open defaults are today's synchronous
        loss.) An explicit value stays, so :func:`rules.closed_violations` can refuse it.
        """
        if not isinstance(data, dict) or data.get("division") != "closed":
            return data
        grpo = data.get("grpo")
        if grpo is None:
            grpo = {}
        if isinstance(grpo, dict):
            return {**data, "grpo": {**rules.REFERENCE_ALGORITHM, **grpo}}
        if isinstance(grpo, GRPOConfig):
            update = {k: v for k, v in rules.REFERENCE_ALGORITHM.items() if k not in grpo.model_fields_set}
            return {**data, "grpo": GRPOConfig.model_validate({**grpo.model_dump(exclude_unset=True), **update})}
        return data

    @model_validator(mode="after")
    def _rollout_logprobs_match_the_loss(self) -> "RunConfig":
        # vLLM returns log-probabilities after top-p (logprobs_mode processed_logprobs);
        # the loss recomputes them before top-p: equal only at top_p 1.
        if self.inference.engine == "vllm" and self.grpo.rollout_top_p < 1.0:
            raise ValueError(
                f"grpo.rollout_top_p={self.grpo.rollout_top_p}: with inference.engine vllm the rollout log-probabilities "
                "are taken after top-p truncation, which the GRPO ratio's recomputation does not apply; set "
                "grpo.rollout_top_p: 1.0 (the closed value) or inference.engine: hf"
            )
        return self

    @model_validator(mode="after")
    def _reaches_first_eval_step(self) -> "RunConfig":
        # (closed configs get this in their list of closed-rule violations instead)
        if self.division == "open" and self.grpo.max_steps < self.first_eval_step:
            raise ValueError(
                f"grpo.max_steps={self.grpo.max_steps} is below the first eval step {self.first_eval_step}: "
                "no checkpoint would be written or evaluated; raise max_steps"
            )
        return self

    def closed_violations(self) -> list[rules.Violation]:
        """Values departing from the closed rules (see :func:`rules.closed_violations`)."""
        return rules.closed_violations(self)
