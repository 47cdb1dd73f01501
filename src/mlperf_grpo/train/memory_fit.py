"""Whether a training step's sequences fit the device, decided before ``run_start``:
``model.activation_checkpointing: auto`` resolved, and a step that cannot fit refused.

The figures are :mod:`mlperf_grpo.plan.sequences`' (activations, log-prob chunks, the
packed attention mask, the engine's KV cache and largest prefill) on top of the weights, gradients, AdamW
moments and engine weights of :mod:`mlperf_grpo.plan.memory`, for the step's shape
(:func:`step_shape`): the longest training prompt plus ``grpo.max_new_tokens`` (agent
trajectories: ``agent.max_context_tokens``), the
largest training pass the token budget allows, the rows the engine decodes at once.
Planned on CUDA for the dense decoders the planner counts; elsewhere nothing is planned
(``auto`` is off).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.plan import memory as memory_plan
from mlperf_grpo.plan import sequences
from mlperf_grpo.plan.sequences import Fit, SequenceShape
from mlperf_grpo.train import ranks


def step_shape(config: RunConfig, longest_prompt: int, world_size: int, agentic: bool = False) -> SequenceShape:
    """The shape of one rank's step (see the module docstring): ``GBS / N`` rows of the
    longest prompt + ``grpo.max_new_tokens`` (``agentic``: agent trajectories, whose turns,
    tool output and prompt fill up to ``agent.max_context_tokens``, as does each engine
    call's row and the prompt a turn prefills), passes by the config's budget."""
    g = config.grpo
    longest = config.agent.max_context_tokens if agentic else longest_prompt + g.max_new_tokens
    return sequences.step_shape(longest, max(1, config.global_batch_size // world_size),
                                g.micro_batch_tokens, g.micro_batch_size,
                                2 if config.model.train_compute_dtype == "bfloat16" else 4,
                                memory_plan.DTYPE_BYTES[config.model.dtype], config.inference.prefill_graphs,
                                None if agentic else longest_prompt)


BATCH_BYTES_PER_TOKEN = 8 + 8 + 4 + 4
"""Host bytes a step's rollout batch holds per row position (``train/rollout.py``:
``input_ids`` and ``attention_mask`` int64, ``completion_mask`` and ``rollout_logprobs``
float32, ``[rows, width]`` each)."""

HOST_BYTES_PER_ROW = 4096
"""Host bytes a rollout row holds besides its batch tensors, at least (its completion and
prompt as Python objects: 80,000 rows of 13 tokens took 0.61 GB more than 32 rows, about
7.6 KB a row; half of it counted, so that no step that fits is refused)."""


def host_memory_bytes() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_host_batch(config: RunConfig, longest_prompt: int, world_size: int, agentic: bool = False,
                     host_bytes: int | None = None, ranks_on_host: int | None = None) -> None:
    """Refuse a step whose rollout batches alone, at their planned shape (:func:`step_shape`'s
    rows of a rank, each as wide as the longest, times ``ranks_on_host``), exceed the
    host's memory (``host_bytes``, default :func:`host_memory_bytes`): it could not be
    right (a ``grpo.num_prompts_per_step`` of 1e11 spent minutes drawing prompts, then ran
    out of memory). Counted: the batch's tensors and :data:`HOST_BYTES_PER_ROW` a row.
    ``ranks_on_host``: default :func:`~mlperf_grpo.train.ranks.ranks_on_host` (torchrun's
    ``LOCAL_WORLD_SIZE``; 1 outside torchrun).

    Raises:
        MemoryPlanError: one line with the rows, the bytes and the fix.
        LayoutError: under torchrun, a ``LOCAL_WORLD_SIZE`` that is not a positive whole number.
    """
    g = config.grpo
    width = config.agent.max_context_tokens if agentic else longest_prompt + g.max_new_tokens
    rows = math.ceil(config.global_batch_size / world_size)
    local = ranks.ranks_on_host() if ranks_on_host is None else ranks_on_host
    need = local * rows * (width * BATCH_BYTES_PER_TOKEN + HOST_BYTES_PER_ROW)
    have = host_memory_bytes() if host_bytes is None else host_bytes
    if need > have:
        raise memory_plan.MemoryPlanError(
            f"a step's rollout batch of {rows:,} rows a rank (grpo.num_prompts_per_step {g.num_prompts_per_step:,} x "
            f"num_generations_per_prompt {g.num_generations_per_prompt:,}"
            f"{f' / {world_size} ranks' if world_size > 1 else ''}) of up to {width:,} tokens needs "
            f"{memory_plan.size_text(need)} of host memory{f' for the {local} ranks on this host' if local > 1 else ''} "
            f"({BATCH_BYTES_PER_TOKEN} bytes a token, {HOST_BYTES_PER_ROW:,} a row) and this machine has "
            f"{memory_plan.size_text(have)}; lower grpo.num_prompts_per_step")


def static_bytes(config: RunConfig, model: dict, world_size: int) -> int:
    """Weights, gradients, AdamW moments (FSDP2 shards), the engine's weights
    (:func:`~mlperf_grpo.plan.memory.static_device_bytes`) and, in one process under
    bfloat16 compute, the compute-dtype copies of the weights
    (:func:`~mlperf_grpo.plan.sequences.autocast_copy_bytes`)."""
    t, hf = config.inference.tensor_parallel_size, config.inference.engine == "hf"
    plan = memory_plan.plan_memory(model, world_size, t if hf else 1, config.model.dtype,
                                   config.checkpoint.max_in_flight, config.inference.engine)
    compute_bytes = 2 if config.model.train_compute_dtype == "bfloat16" else 4
    return (memory_plan.static_device_bytes(plan, 1 if hf else t)
            + sequences.autocast_copy_bytes(plan.parameters, world_size, compute_bytes))


@dataclass(frozen=True)
class StepFit:
    """:func:`plan_step`'s answer: ``checkpointing`` on or off, and the plan behind it
    (None where nothing is planned)."""

    checkpointing: bool
    verdict: Fit | None = None
    auto: bool = True
    """``model.activation_checkpointing`` was ``auto``."""

    @property
    def release_engine_memory(self) -> bool:
        """Whether the engine frees its KV cache and graphs while the policy trains."""
        return self.verdict is not None and self.verdict.released

    engine_rows = sequences.ENGINE_BATCH_SIZE
    """Rows the ``hf`` engine decodes at once (its slots; its KV cache is bounded by
    :attr:`kv_cache_bytes`, not by fewer rows)."""

    @property
    def kv_cache_bytes(self) -> int | None:
        """The bytes the engine's KV cache may take (``DecodeOptions.kv_cache_bytes``):
        what the device has left beside the rest; None where nothing is planned."""
        return None if self.verdict is None else self.verdict.kv_budget_bytes

    def note(self) -> str | None:
        """One line saying what the plan turned on (the KV cache freed while training,
        checkpointing under ``auto``, the KV cache bounded below all rows at full
        length), or, on CUDA, that the model's sequences are not planned; else None."""
        if self.verdict is None:
            return self._unplanned_note()
        v, said = self.verdict, []
        if v.released:
            said.append("the engine's KV cache and graphs freed while the policy trains (synchronous rollouts)")
        if self.checkpointing and self.auto:
            said.append("activation checkpointing on (model.activation_checkpointing: auto: without it a training pass "
                        "does not fit)")
        if v.bounded:
            said.append(f"the engine's KV cache bounded to {memory_plan.size_text(v.kv_budget_bytes)}, not all "
                        f"{v.shape.engine_rows} rows at full length (it grows with the rows' lengths; rows past it wait "
                        "and are recomputed)")
        if not said:
            return None
        return (f"{'; '.join(said)}: planned peak {memory_plan.size_text(v.peak_bytes)} of the device's "
                f"{memory_plan.size_text(v.device_bytes)} ({memory_plan.size_text(v.memory.activation_bytes)} activations, "
                f"{memory_plan.size_text(v.memory.kv_cache_bytes)} KV cache)")

    rows: int = sequences.ENGINE_BATCH_SIZE
    """A rank's rollout rows a step."""
    unplanned: str | None = None
    """On CUDA, the ``model_type`` whose sequences the planner does not count (None: planned,
    or not on CUDA)."""

    def _unplanned_note(self) -> str | None:
        if self.unplanned is None:
            return None
        auto = (", and model.activation_checkpointing: auto is off (set it on for long rows)"
                if self.auto and not self.checkpointing else "")
        return (f"the sequences of model_type {self.unplanned!r} are not planned (plan/sequences.py counts dense llama / "
                "qwen3): the step is not checked against the device's memory before run_start and the engine keeps its "
                f"KV cache while the policy trains{auto}")


def plan_step(config: RunConfig, model: dict, longest_prompt: int, world_size: int,
              device_bytes: int | None, agentic: bool = False) -> StepFit:
    """Resolve ``model.activation_checkpointing`` and refuse a step that cannot fit.

    Args:
        model: the model's ``config.json`` (:func:`~mlperf_grpo.plan.model_config.load_model_config`).
        longest_prompt: tokens of the longest training prompt.
        world_size: N ranks.
        device_bytes: the CUDA device's memory; None: not on CUDA (nothing planned).
        agentic: the task's samples are agent trajectories (:func:`step_shape`).
    Raises:
        MemoryPlanError: the step does not fit even with checkpointing (or with it off
            when ``off`` is asked), one line with the figures and the remedies.
    """
    asked = config.model.activation_checkpointing
    forced = None if asked == "auto" else asked == "on"
    if device_bytes is None or not sequences.plans_sequences(model):
        unplanned = None if device_bytes is None else str(model.get("model_type"))
        return StepFit(bool(forced), auto=forced is None, unplanned=unplanned)
    shape = step_shape(config, longest_prompt, world_size, agentic)
    can_release = config.grpo.max_trajectory_age_steps == 0 and config.inference.engine == "hf"
    static = static_bytes(config, model, world_size)
    verdict = sequences.fit(model, shape, static, device_bytes, forced, can_release)
    if not verdict.fits:
        line = sequences.refusal(verdict, length_key="agent.max_context_tokens" if agentic else "grpo.max_new_tokens")
        if not verdict.memory.checkpointing:
            line = line.replace(" reserve: ", " reserve: set model.activation_checkpointing: on, or ", 1)
        in_turn = not can_release and config.inference.engine == "hf" and sequences.fit(
            model, shape, static, device_bytes, forced, True)
        if in_turn and in_turn.fits:  # age 1 keeps the next generation's cache live while the policy trains
            line = line.replace(" reserve: ", " reserve: set grpo.max_trajectory_age_steps: 0 (open division: the "
                                "engine's KV cache is then freed while the policy trains, and the step fits), or ", 1)
        raise memory_plan.MemoryPlanError(line)
    return StepFit(verdict.memory.checkpointing, verdict, forced is None, max(1, config.global_batch_size // world_size))
