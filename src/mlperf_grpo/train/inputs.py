"""What training checks before anything is loaded or written, once per run.

:func:`check_training_inputs` is the one place a training run's inputs are checked
(task data, model files and tokenizer, device, kernels, planned memory, engine, output):
the CLI calls it before it names the run directory and hands the result
(:class:`TrainingInputs`: the task suite loaded once) to
:func:`mlperf_grpo.train.trainer.train`, which checks only when it is given nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlperf_grpo import tasks
from mlperf_grpo.agent.suite import AgentRunner
from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.config.rundir import RunDir
from mlperf_grpo.inference.factory import check_engine_available
from mlperf_grpo.model.check import check_model
from mlperf_grpo.model.files import check_device, check_model_path
from mlperf_grpo.model.linear_attention import check_linear_attention_kernels
from mlperf_grpo.model.load import load_tokenizer
from mlperf_grpo.plan import memory as memory_plan
from mlperf_grpo.plan.model_config import load_model_config
from mlperf_grpo.tasks.base import is_agentic
from mlperf_grpo.tasks.lengths import check_prompt_lengths
from mlperf_grpo.train import ranks
from mlperf_grpo.train.memory_fit import StepFit, check_host_batch, plan_step


@dataclass(frozen=True)
class TrainingInputs:
    """A run's checked task data (:func:`check_training_inputs`)."""

    suite: tasks.TaskSuite
    """The task suite (loaded once; its ``reward`` scores the rollouts)."""
    train_pool: list[tasks.Task]
    """The training prompts (``task.num_train_tasks``, none of them a validation task)."""
    validation: list[tasks.Task]
    """The validation tasks (``validation.num_tasks``), recorded in each checkpoint's
    evaluation settings."""
    step_fit: StepFit = StepFit(False)
    """Activation checkpointing resolved, with the planned step memory behind it
    (:func:`~mlperf_grpo.train.memory_fit.plan_step`)."""

    @property
    def validation_set(self) -> tasks.ValidationSet:
        """The suite with the validation tasks (what inline evaluation validates with)."""
        return tasks.ValidationSet(self.suite, self.validation)


def check_training_inputs(config: RunConfig, run: RunDir, check_output: bool = True) -> TrainingInputs:
    """Everything that can be checked before training starts, cheaply (no weights loaded);
    the output only with ``check_output``.

    Returns:
        The :class:`TrainingInputs`.
    Raises:
        TaskError: the task data or entry point is unusable, or a task count is wrong
            (PromptTooLongError: a prompt plus ``grpo.max_new_tokens`` exceeds the model's
            context or ``grpo.max_sequence_length``).
        ModelLoadError: the model directory, its weights' headers or its tokenizer are
            unusable (see :func:`mlperf_grpo.model.check.check_model`), or no CUDA device.
        MemoryPlanError: T does not divide, or the layout's planned bytes exceed the
            device (:func:`check_planned_memory`).
        RunDirError: the output already holds a run.
        ConfigError: ``task.name: swe`` on a machine without a sandbox runtime, prompt
            files that cannot be read, or a model whose tokenizer has no chat template.
        PromptTooLongError: a swe task whose agent prompt fills ``agent.max_context_tokens``.
    """
    suite = tasks.load_suite(config)
    validation = tasks.validation_tasks(suite, config.validation.num_tasks)  # refused now, not at evaluation
    train_pool = tasks.train_tasks(suite, config.task.num_train_tasks, config.validation.num_tasks, config.seed)
    check_model(config.model.path, sample_text=validation[0].prompt)
    longest = check_prompt_lengths(config, {"training": train_pool, "validation": validation}, is_agentic(suite))
    check_device(config.model.device)
    check_linear_attention_kernels(config.model.path, config.model.device)
    step_fit = check_planned_memory(config, longest["training"], is_agentic(suite))
    check_engine_available(config)
    if is_agentic(suite):
        # a sandbox runtime, readable prompt files and a chat tokenizer, before the run directory exists
        runner, tokenizer = AgentRunner(config.agent), load_tokenizer(config.model.path)
        runner.check_tokenizer(tokenizer, config.model.path)
        runner.check_prompt_lengths(tokenizer, {"training": train_pool, "validation": validation})
    if check_output:
        run.check_unused()
    return TrainingInputs(suite, train_pool, validation, step_fit)


def device_memory_bytes() -> int:
    """Total memory of this process's CUDA device, in bytes."""
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def check_planned_memory(config: RunConfig, longest_prompt: int = 0, agentic: bool = False) -> StepFit:
    """Under torchrun or with the ``hf`` engine, refuse an ``inference.tensor_parallel_size``
    that does not divide the world size or the model's heads / vocabulary / experts
    (:func:`~mlperf_grpo.plan.memory.check_tensor_parallel` with the engine's rules); on
    CUDA, refuse a layout whose planned per-rank device bytes (:mod:`mlperf_grpo.plan.memory`:
    FSDP shards and an engine split over T) exceed the device's memory, then one whose
    step does not fit with its sequences (:func:`~mlperf_grpo.train.memory_fit.plan_step`,
    ``longest_prompt`` tokens + ``grpo.max_new_tokens`` a row; ``agentic``: agent
    trajectories of ``agent.max_context_tokens``), which also resolves
    ``model.activation_checkpointing``. Host memory is checked only for the step's rollout
    batch (:func:`~mlperf_grpo.train.memory_fit.check_host_batch`); a model type the
    planner does not count is not planned (on CUDA the step fit's note says so).

    Raises:
        MemoryPlanError: the divisibility or the bytes (the rollout batch's on the host
            too), in one line with the remedy.
    """
    model = load_model_config(check_model_path(config.model.path))
    world_size = ranks.layout().world_size
    check_host_batch(config, longest_prompt, world_size, agentic)
    t, hf = config.inference.tensor_parallel_size, config.inference.engine == "hf"
    if ranks.launched() or hf:  # the hf engine splits over the world's ranks
        memory_plan.check_tensor_parallel(model, world_size, t, config.inference.engine)
    if config.model.device != "cuda":
        return plan_step(config, model, longest_prompt, world_size, None, agentic)
    if not memory_plan.counts(model):  # nothing planned: plan_step says so
        return plan_step(config, model, longest_prompt, world_size, device_memory_bytes(), agentic)
    plan = memory_plan.plan_memory(model, world_size, t if hf else 1, config.model.dtype, config.checkpoint.max_in_flight,
                                   config.inference.engine)
    memory_plan.check_fits(plan, device_memory_bytes(), 1 if hf else t)
    return plan_step(config, model, longest_prompt, world_size, device_memory_bytes(), agentic)
