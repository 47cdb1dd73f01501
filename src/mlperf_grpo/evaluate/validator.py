"""Validate one set of weights: generate k completions per task, reward, pass@k."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlperf_grpo import rules
from mlperf_grpo.inference.base import InferenceEngine, SamplingParams, derive_seed
from mlperf_grpo.tasks import Task
from mlperf_grpo.tasks.base import TaskSuite, is_agentic
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


@dataclass(frozen=True)
class AgentTaskResult(TaskResult):
    """One validation task's ``k`` agent trajectories: ``completions`` their model turns,
    ``rewards`` their graded rewards (0 for an invalid one), ``invalid`` which were invalid
    samples, ``trajectories`` their records (turns with actions and clipped observations,
    end reason, reward, tokens: :meth:`~mlperf_grpo.agent.trajectory.Trajectory.record`)."""

    invalid: list[bool] = field(default_factory=list)
    trajectories: list[dict] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return any(r > 0 and not bad for r, bad in zip(self.rewards, self.invalid))


def validate_suite(engine: InferenceEngine, suite: TaskSuite, tasks: list[Task], generations_per_task: int,
                   params: SamplingParams, seed: int, agent=None) -> tuple[float, list[TaskResult]]:
    """:func:`validate` with ``suite.reward``, or for an agentic suite (``task.name: swe``)
    :func:`validate_agent` with the config's ``agent`` section."""
    if is_agentic(suite):
        from mlperf_grpo.agent.suite import AgentRunner

        return validate_agent(engine, AgentRunner(agent), tasks, generations_per_task, params, seed)
    return validate(engine, tasks, suite.reward, generations_per_task, params, seed)


def validate_agent(engine: InferenceEngine, runner, tasks: list[Task], generations_per_task: int, params: SamplingParams,
                   seed: int) -> tuple[float, list[AgentTaskResult]]:
    """pass@k of the engine's weights over ``tasks`` run by the agent (an
    :class:`~mlperf_grpo.agent.suite.AgentRunner`), ``k`` trajectories a task (seeds
    ``derive_seed("validation", seed, task_id, j)``), all in flight together.

    Invalid samples (a trajectory or its tests timed out) are excluded: they never count
    as a pass, and the accuracy's denominator stays every validation task (the benchmark
    states its target as "174 of 251 tasks": pass@4 > 0.69 over all 251, DESIGN.md), so a
    task whose ``k`` trajectories are all invalid counts as not passed.
    """
    k = generations_per_task
    jobs = [(t, derive_seed("validation", seed, t.task_id, j)) for t in tasks for j in range(k)]
    flat = runner.trajectories(engine, jobs, params).trajectories
    results = []
    for i, task in enumerate(tasks):
        mine = flat[i * k:(i + 1) * k]
        results.append(AgentTaskResult(
            task.task_id, task.prompt, task.answer, [t.text for t in mine],
            [0.0 if t.invalid else float(t.reward) for t in mine], [t.invalid for t in mine], [t.record() for t in mine]))
    return rules.pass_at_k([r.rewards for r in results]), results
