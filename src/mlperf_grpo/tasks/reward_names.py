"""Reward functions by name: the ``"module:qualname"`` by which a reward worker
(``tasks/scoring.py``) imports a module-level function."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from mlperf_grpo.tasks.base import Task

RewardFn = Callable[[str, Task], float]


def reward_ref(reward_fn: RewardFn | str) -> str:
    """The ``"module:qualname"`` by which a worker imports ``reward_fn``.

    Args:
        reward_fn: a module-level function, or its ``"module:qualname"``.
    Raises:
        ValueError: a closure, lambda or bound method, or a name that does not import to a
            callable (one line, naming it).
    """
    if isinstance(reward_fn, str):
        resolve_reward(reward_fn)
        return reward_fn
    module, qualname = getattr(reward_fn, "__module__", None), getattr(reward_fn, "__qualname__", "")
    ref = f"{module}:{qualname}"
    if not module or "<" in qualname:
        raise ValueError(f"reward function {reward_fn!r} is not importable by name; define it at module level")
    try:
        found = resolve_reward(ref)
    except ValueError:
        found = None
    if found is not reward_fn:
        raise ValueError(f"reward function {ref} does not import as the same object; define it at module level")
    return ref


def resolve_reward(ref: str) -> RewardFn:
    """Import ``"module:qualname"`` and return the callable it names.

    Raises:
        ValueError: malformed name, module not importable, no such attribute, or not callable.
    """
    module_name, sep, qualname = ref.partition(":")
    if not sep or not module_name or not qualname:
        raise ValueError(f"reward function name {ref!r} must be 'module:function'")
    try:
        obj = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001  (any import failure is the user's module)
        raise ValueError(f"reward function {ref}: cannot import {module_name}: {type(err).__name__}: {err}") from None
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"reward function {ref}: {module_name} has no attribute {qualname}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward function {ref} is not callable")
    return obj
