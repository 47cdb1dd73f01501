"""Validate one set of weights: generate k completions per task, reward, pass@k."""

from __future__ import annotations

from dataclasses import dataclass

from mlperf_grpo import rules
from mlperf_grpo.inference.base import InferenceEngine, SamplingParams
from mlperf_grpo.tasks import Task


@dataclass(frozen=True)
class TaskResult:
    """One validation task's ``k`` completions and rewards."""

    task_id: str
    prompt: str
    answer: str
    completions: list[str]
    rewards: list[float]

    @property
    def passed(self) -> bool:
        return any(r > 0 for r in self.rewards)


def validate(
    engine: InferenceEngine, tasks: list[Task], reward_fn, generations_per_task: int, params: SamplingParams
) -> tuple[float, list[TaskResult]]:
    """pass@k of the engine's current weights over ``tasks``.

    Args:
        engine: already refit with the weights to validate.
        tasks: the validation tasks (``eval_samples`` of them).
        reward_fn: ``(completion_text, task) -> float``; a reward > 0 is a pass.
        generations_per_task: k.
        params: validation sampling (temperature 0.1, top_p 0.95 in the rules).
    Returns:
        ``(accuracy, per-task results)``; accuracy = mean over tasks of any reward > 0.
    """
    k = generations_per_task
    completions = engine.generate([t.prompt for t in tasks for _ in range(k)], params)
    results = []
    for i, task in enumerate(tasks):
        texts = [c.text for c in completions[i * k:(i + 1) * k]]
        results.append(
            TaskResult(task.task_id, task.prompt, task.answer, texts, [reward_fn(t, task) for t in texts])
        )
    return rules.pass_at_k([r.rewards for r in results]), results
