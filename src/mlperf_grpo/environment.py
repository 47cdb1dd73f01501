"""The one parser of the rules' environment variables (the reference launcher's).

- ``DEFERRED_OFFLINE_EVAL``: ``1`` (default) trains with deferred checkpoints and
  evaluates them afterwards; ``0`` evaluates inline during training.
- ``RETAIN_GRPO_CHECKPOINTS``: ``1`` keeps the checkpoints after evaluation; ``0``
  (default) deletes them.
- ``MLPERF_MLLOG_FILE``: the MLPerf log's path instead of ``<run>/mlperf.log``.

An empty or unset variable (or one of spaces only) takes its default. Torch-free; each
reader raises :class:`~mlperf_grpo.errors.EnvironmentVariableError` (exit 2) for any
other value, a value with spaces around it included (``" 0 "`` is not ``0``: a launcher
that writes it is refused, not read one way here and another elsewhere).
"""

from __future__ import annotations

import os
from pathlib import Path

from mlperf_grpo.errors import EnvironmentVariableError

DEFERRED_ENV = "DEFERRED_OFFLINE_EVAL"
RETAIN_ENV = "RETAIN_GRPO_CHECKPOINTS"
MLLOG_ENV = "MLPERF_MLLOG_FILE"


def _switch(name: str, default: str, meaning: dict[str, str]) -> bool:
    """``name``'s value as a 0/1 switch (unset or blank: ``default``); True for ``1``."""
    raw = os.environ.get(name, "")
    value = raw if raw.strip() else default
    if value not in meaning:
        raise EnvironmentVariableError(f"{name} must be 0 ({meaning['0']}) or 1 ({meaning['1']}), got {value!r}")
    return value == "1"


def deferred_offline_eval() -> bool:
    """``DEFERRED_OFFLINE_EVAL``: unset or ``1`` -> True (deferred), ``0`` -> False (inline).

    Raises:
        EnvironmentVariableError: any other value.
    """
    return _switch(DEFERRED_ENV, "1", {"0": "inline evaluation", "1": "deferred"})


def retain_checkpoints(flag: bool = False) -> bool:
    """``--retain-checkpoints`` (``flag``) or ``RETAIN_GRPO_CHECKPOINTS=1`` (unset or
    ``0``: delete). The variable is read, and checked, also when ``flag`` is set.

    Raises:
        EnvironmentVariableError: ``RETAIN_GRPO_CHECKPOINTS`` is anything but 0 or 1.
    """
    keep = _switch(RETAIN_ENV, "0", {"0": "delete checkpoints after evaluation", "1": "keep them"})
    return flag or keep


def mllog_file(default: Path) -> Path:
    """``MLPERF_MLLOG_FILE`` when set (and not blank), else ``default``.

    Raises:
        EnvironmentVariableError: the value has spaces around it.
    """
    value = os.environ.get(MLLOG_ENV, "")
    if value.strip() and value != value.strip():
        raise EnvironmentVariableError(f"{MLLOG_ENV} has spaces around its value {value!r}; set the path alone")
    return Path(value) if value.strip() else default
