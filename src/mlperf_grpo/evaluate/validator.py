"""Validate one set of weights: generate k completions per task, reward, pass@k."""

from __future__ import annotations

from dataclasses import dataclass

from mlperf_grpo import rules
from mlperf_grpo.inference.base import InferenceEngine, SamplingParams, derive_seed
from mlperf_grpo.tasks import Task
from mlperf_grpo.tasks.scoring import score


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
    engine: InferenceEngine,
    tasks: list[Task],
    reward_fn,
    generations_per_task: int,
    params: SamplingParams,
    seed: int,
) -> tuple[float, list[TaskResult]]:
    """pass@k of the engine's current weights over ``tasks``.

    Args:
        engine: already refit with the weights to validate.
        tasks: the validation tasks (``eval_samples`` of them).
        reward_fn: ``(completion_text, task) -> float``, module-level (or its
            ``"module:qualname"``: it runs in a scoring worker); a reward > 0 is a pass.
        generations_per_task: k.
        params: validation sampling (temperature 0.1, top_p 0.95 in the rules).
        seed: generation ``j`` of a task uses ``derive_seed("validation", seed, task_id, j)``,
            so re-validating the same weights gives the same completions.
    Returns:
        ``(accuracy, per-task results)``; accuracy = mean over tasks of any reward > 0.
    Raises:
        VerifierError: a reward call raised or timed out (no accuracy is computed).
    """
    k = generations_per_task
    flat_tasks = [t for t in tasks for _ in range(k)]
    seeds = [derive_seed("validation", seed, t.task_id, j) for t in tasks for j in range(k)]
    completions = engine.generate([t.prompt for t in flat_tasks], params, seeds)
    rewards = score(reward_fn, [(c.text, t) for c, t in zip(completions, flat_tasks)])
    results = []
    for i, task in enumerate(tasks):
        texts = [c.text for c in completions[i * k:(i + 1) * k]]
        results.append(TaskResult(task.task_id, task.prompt, task.answer, texts, rewards[i * k:(i + 1) * k]))
    return rules.pass_at_k([r.rewards for r in results]), results
