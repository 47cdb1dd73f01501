"""Task suites: prompts, validation sets and reward functions, chosen by ``task.name``."""

from __future__ import annotations

from dataclasses import dataclass

from mlperf_grpo.tasks import arithmetic
from mlperf_grpo.tasks.base import Task, TaskError, TaskSuite

SUITES = {"arithmetic": arithmetic}
"""Built-in ``task.name`` -> module with ``validation_tasks``, ``train_tasks``, ``reward``."""


def load_suite(config) -> TaskSuite:
    """The task suite of a run config (:class:`mlperf_grpo.config.run.RunConfig`).

    ``arithmetic``: the built-in module. ``jsonl``: :class:`~mlperf_grpo.tasks.jsonl.JsonlSuite`
    over the configured files, prompts from ``messages`` through the model tokenizer's chat
    template when it has one. ``python``: ``factory()`` of ``task.entry_point``, which must
    return a :class:`TaskSuite` whose reward a worker can import by name.

    Raises:
        TaskError: unreadable or malformed task data, or an entry point that does not
            import, fails, or returns something that is not a task suite (one line).
    """
    task = config.task
    if task.name in SUITES:
        return SUITES[task.name]
    if task.name == "swe":
        from mlperf_grpo.tasks.swe.suite import load_swe_suite

        return load_swe_suite(task.suite, task.train_path, task.validation_path)
    if task.name == "jsonl":
        from mlperf_grpo.tasks.jsonl import JsonlSuite

        return JsonlSuite(task.train_path, task.validation_path, task.id_field, task.prompt_field, task.answer_field,
                          chat_template=_chat_template(config.model.path))
    return _suite_from_entry_point(task.entry_point)


def _chat_template(model_path: str):
    """``messages -> prompt`` with the model tokenizer's chat template, or None without one."""
    from mlperf_grpo.model.load import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    if not getattr(tokenizer, "chat_template", None):
        return None

    def apply(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    return apply


def _suite_from_entry_point(entry_point: str) -> TaskSuite:
    from mlperf_grpo.tasks.scoring import resolve_reward, reward_ref

    try:
        factory = resolve_reward(entry_point)
    except ValueError as err:
        raise TaskError(f"task.entry_point: {str(err).replace('reward function', 'entry point', 1)}") from None
    try:
        suite = factory()
    except Exception as err:  # noqa: BLE001  (the user's factory: any failure is reported in one line)
        raise TaskError(f"task.entry_point {entry_point}: factory() raised {type(err).__name__}: {err}") from None
    if not isinstance(suite, TaskSuite):
        raise TaskError(f"task.entry_point {entry_point}: factory() returned {type(suite).__name__}, not a task suite "
                        "(validation_tasks, train_tasks, reward: see mlperf_grpo.tasks.base.TaskSuite)")
    try:
        reward_ref(suite.reward)
    except ValueError as err:
        raise TaskError(f"task.entry_point {entry_point}: {err}") from None
    return suite


def validation_tasks(suite: TaskSuite, num_tasks: int) -> list[Task]:
    """``suite.validation_tasks(num_tasks)``, checked: exactly ``num_tasks`` tasks, distinct ids.

    Raises:
        TaskError: any other count, a non-:class:`Task` item or a repeated id.
    """
    return _checked(suite.validation_tasks(num_tasks), num_tasks, "validation_tasks", "validation.num_tasks")


def train_tasks(suite: TaskSuite, num_tasks: int, num_validation_tasks: int, seed: int) -> list[Task]:
    """``suite.train_tasks(...)``, checked like :func:`validation_tasks` against ``task.num_train_tasks``."""
    return _checked(suite.train_tasks(num_tasks, num_validation_tasks, seed), num_tasks, "train_tasks", "task.num_train_tasks")


@dataclass(frozen=True)
class ValidationSet:
    """A run's task suite and its checked validation tasks, loaded once per process
    (:func:`load_validation_set`) and handed to every part of an evaluation that needs
    them: the settings check, the engine's warm-up, each checkpoint's validation."""

    suite: TaskSuite
    """The suite (its ``reward`` scores the validation completions)."""
    tasks: list[Task]
    """``validation.num_tasks`` tasks with distinct ids (:func:`validation_tasks`)."""


def load_validation_set(config) -> ValidationSet:
    """The :class:`ValidationSet` of a run config (:class:`mlperf_grpo.config.run.RunConfig`).

    Raises:
        TaskError: as :func:`load_suite` and :func:`validation_tasks`.
    """
    suite = load_suite(config)
    return ValidationSet(suite, validation_tasks(suite, config.validation.num_tasks))


def _checked(tasks: object, num_tasks: int, what: str, key: str) -> list[Task]:
    from mlperf_grpo.tasks.swe.task import SweTask

    if not isinstance(tasks, list) or not all(isinstance(t, (Task, SweTask)) for t in tasks):
        raise TaskError(f"the task suite's {what}() must return a list of mlperf_grpo.tasks.Task "
                        "(or, for task.name swe, mlperf_grpo.tasks.swe.SweTask)")
    if len(tasks) != num_tasks:
        raise TaskError(f"the task suite's {what}() returned {len(tasks)} tasks; {key} is {num_tasks}")
    ids = [t.task_id for t in tasks]
    if len(set(ids)) != len(ids):
        raise TaskError(f"the task suite's {what}() returned repeated task ids; ids must be distinct")
    return tasks


__all__ = ["SUITES", "Task", "TaskError", "TaskSuite", "ValidationSet", "load_suite", "load_validation_set", "train_tasks",
           "validation_tasks"]
