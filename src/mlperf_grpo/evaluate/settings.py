"""The settings that decide what an evaluation measures: part of a run's identity.

Recorded by the trainer in every checkpoint's ``training_info.json`` (``evaluation``), as
the non-weight files are fingerprinted there, and compared with the config an evaluator
is given before anything is evaluated (``evaluate/series.py``); for a series another
trainer wrote, the config is compared with what its MLPerf log recorded
(:func:`logged_differences`). A changed temperature, seed or validation set would give
another passing step under the same log.

Part of the identity: ``seed`` (it seeds every validation completion), the validation
settings (``num_tasks``, ``generations_per_task``, ``temperature``, ``top_p``),
``grpo.max_new_tokens`` (the completions' length), the task
(``task.name`` and ``task.entry_point``, which choose the reward) and the validation
tasks themselves (a sha256 of their ids, prompts and answers: the task files' content);
for ``task.name: swe`` also the agent's limits, tools and prompt (:data:`AGENT_KEYS`).
Not part of it: ``validation.target_accuracy`` (it decides the verdict, not what is
measured, and every config accepts only the rules' target, ``rules.TARGET_ACCURACY``);
and, since they change how fast, not what, is evaluated: ``validation.workers``,
``validation.batch_size`` (each completion is sampled from its own seed), ``model.device``,
``model.path`` (a run may move; its files are fingerprinted apart), ``model.dtype`` (the
rules allow evaluation in BF16 or in the rollout format), the ``inference`` engine and
its arguments (hf and vllm both evaluate), checkpoint and distributed settings.
"""

from __future__ import annotations

import hashlib
import json

from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.tasks import Task

AGENT_KEYS = ("max_turns", "max_context_tokens", "max_new_tokens_per_turn", "trajectory_timeout_s", "command_timeout_s",
              "test_timeout_s", "max_observation_chars", "tools", "prompt_style")
"""``task.name: swe``: the ``agent`` keys that are part of the identity (not ``tool_threads``
or ``sandbox_root``: how fast and where, not what; not ``prompt_files``: their paths may
move with a run, and their content is not fingerprinted yet)."""

TASKS_KEY = "validation tasks (sha256 of ids, prompts, answers)"
"""The key of the validation tasks' digest in the record."""

LOGGED_KEYS = {
    "seed": "seed",
    "eval_samples": "validation.num_tasks",
    "generation_validation_rollout_temperature": "validation.temperature",
    "generation_validation_rollout_top_p": "validation.top_p",
}
"""MLPerf log key -> the config key it records (``train/mlperf_events.hyperparameters``;
the NeMo-RL reference logs the same keys)."""


def tasks_digest(validation_tasks: list[Task]) -> str:
    """Hex sha256 of the JSON list ``[[task_id, prompt, answer], ...]`` in the given order."""
    rows = [[t.task_id, t.prompt, t.answer] for t in validation_tasks]
    return hashlib.sha256(json.dumps(rows, ensure_ascii=False).encode()).hexdigest()


def _config_value(config: RunConfig, key: str) -> object:
    value: object = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


def evaluation_settings(config: RunConfig, validation_tasks: list[Task]) -> dict[str, object]:
    """The record: config key -> value for every setting of the identity (module
    docstring), plus :data:`TASKS_KEY` -> :func:`tasks_digest` of ``validation_tasks``."""
    keys = ("seed", "validation.num_tasks", "validation.generations_per_task", "validation.temperature",
            "validation.top_p", "grpo.max_new_tokens", "task.name", "task.entry_point")
    if config.task.name == "swe":  # the agent's limits and tools decide what a trajectory can do
        keys += tuple(f"agent.{key}" for key in AGENT_KEYS)
    return {**{key: _config_value(config, key) for key in keys}, TASKS_KEY: tasks_digest(validation_tasks)}


def settings_difference(recorded: dict, current: dict) -> str | None:
    """The first key (in ``current``'s order) whose value differs, as ``"KEY is NEW, but
    the checkpoints were trained with OLD"``; a key missing from ``recorded`` reads as
    ``None``; ``None`` when every key agrees."""
    for key, value in current.items():
        if recorded.get(key) != value:
            return f"{key} is {value!r}, but the checkpoints were trained with {recorded.get(key)!r}"
    return None


def logged_differences(config: RunConfig, logged: dict[str, object]) -> list[str]:
    """Each config value differing from the value the MLPerf log recorded for it
    (``logged``: log key -> its first value; keys the log lacks are not compared), as
    ``"KEY is NEW, but the log's LOG_KEY is OLD"``."""
    out = []
    for log_key, key in LOGGED_KEYS.items():
        if log_key in logged and logged[log_key] != _config_value(config, key):
            out.append(f"{key} is {_config_value(config, key)!r}, but the log's {log_key} is {logged[log_key]!r}")
    return out
