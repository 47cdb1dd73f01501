"""Every prompt plus its new tokens must fit the model's context, checked before a run starts.

A sequence is a prompt's tokens (as the engines encode it: ``model.encode_prompts``)
followed by at most ``grpo.max_new_tokens`` generated ones, in rollouts and in
validation alike. Its length is bounded by the model's context (``config.json``'s
``max_position_embeddings`` or ``n_positions``: past it a learned position embedding
has no row, and the run would crash mid-way with ``index out of range``), by
``grpo.max_sequence_length`` (the logged ``max_sequence_length``) and, with the vLLM
engine, by ``inference.max_model_len`` when set.
"""

from __future__ import annotations

from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.model.files import context_length
from mlperf_grpo.model.load import encode_prompts, load_tokenizer
from mlperf_grpo.tasks.base import Task, TaskError


class PromptTooLongError(TaskError):
    """A prompt plus ``grpo.max_new_tokens`` exceeds a sequence-length limit (exit 2)."""


def sequence_limits(config: RunConfig) -> dict[str, int]:
    """The limits on one sequence's tokens (prompt + completion), by what sets them.

    Returns:
        limit's description -> tokens: the model's context when ``config.json`` gives one
        (:func:`~mlperf_grpo.model.files.context_length`), ``grpo.max_sequence_length``, and
        ``inference.max_model_len`` with ``inference.engine: vllm`` when it is set.
    Raises:
        ModelLoadError: the model's ``config.json`` does not load.
    """
    limits = {}
    context, key = context_length(config.model.path)
    if context is not None:
        limits[f"the model's context ({key} {context} in config.json)"] = context
    limits[f"grpo.max_sequence_length {config.grpo.max_sequence_length}"] = config.grpo.max_sequence_length
    if config.inference.engine == "vllm" and config.inference.max_model_len is not None:
        limits[f"inference.max_model_len {config.inference.max_model_len}"] = config.inference.max_model_len
    return limits


def check_prompt_lengths(config: RunConfig, task_sets: dict[str, list[Task]], agentic: bool = False) -> dict[str, int]:
    """Refuse a run in which any prompt plus ``grpo.max_new_tokens`` exceeds a limit of
    :func:`sequence_limits`, before anything is written; return each set's longest prompt
    in tokens (0 for an empty set).

    Args:
        config: the run config (model, ``grpo.max_new_tokens``, the limits).
        task_sets: what each list is (``"training"``, ``"validation"``) -> its tasks.
        agentic: the samples are agent trajectories (``task.name: swe``), which run to
            ``agent.max_context_tokens``: that must be within the limits too.
    Raises:
        PromptTooLongError: one line naming the longest offending prompt's task id and set,
            its tokens, ``max_new_tokens``, the limit exceeded, how many prompts exceed it,
            and what to change; or ``agent.max_context_tokens`` and the limit it exceeds.
        ModelLoadError: the model's tokenizer or ``config.json`` does not load.
    """
    limits = sequence_limits(config)
    what, limit = min(limits.items(), key=lambda item: item[1])
    # a setting's limit is raised in the config; the model's context only by another model
    longer = "use a model with a longer context" if what.startswith("the model's") else f"raise {what.split()[0]}"
    if agentic and config.agent.max_context_tokens > limit:  # a trajectory would run past it
        raise PromptTooLongError(
            f"agent.max_context_tokens {config.agent.max_context_tokens} is over {what}: an agent trajectory runs to "
            f"it; lower agent.max_context_tokens to at most {limit}, or {longer}")
    new_tokens = config.grpo.max_new_tokens
    tokenizer = load_tokenizer(config.model.path)
    longest = {}
    for kind, task_list in task_sets.items():
        lengths = [len(ids) for ids in encode_prompts(tokenizer, [t.prompt for t in task_list])]
        longest[kind] = max(lengths, default=0)
        over = [i for i, n in enumerate(lengths) if n + new_tokens > limit]
        if not over:
            continue
        worst = max(over, key=lambda i: lengths[i])
        raise PromptTooLongError(
            f"{kind} task {task_list[worst].task_id!r}: its prompt is {lengths[worst]} tokens, + grpo.max_new_tokens "
            f"{new_tokens} = {lengths[worst] + new_tokens} tokens, over {what} ({len(over)} of {len(task_list)} "
            f"{kind} prompts are over it); shorten or drop those prompts, lower grpo.max_new_tokens, or {longer}"
        )
    return longest
