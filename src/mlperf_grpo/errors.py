"""The errors the ``mlperf-grpo`` command line maps to its exit codes, and the codes.
Torch-free and at the bottom of the imports, so the CLI names them without loading the
library.

Each is raised by the module it is also importable from (``config.load.ConfigError``,
``checkpoint.CheckpointError``, ...). Every type in :data:`BAD_INPUT_ERRORS`, and its
subclasses, is wrong input: exit 2 with its one-line message, nothing written.
"""

from __future__ import annotations

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT, EXIT_ABORTED = 0, 1, 2, 3
"""Exit codes: success, anything else gone wrong, bad input, aborted (no checkpoint passed)."""
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143  # 128 + SIGINT / SIGTERM, as a shell reports them


def outcome_exit_code(status: str) -> int:
    """The exit code of a run's outcome ``status`` (``run_stop``'s): ``EXIT_OK`` for
    ``success``, else ``EXIT_ABORTED``."""
    return EXIT_OK if status == "success" else EXIT_ABORTED


class BadInput(Exception):
    """Wrong input from the user (a flag, a combination of flags): exit 2 with the message."""


class EnvironmentVariableError(BadInput):
    """A rules' environment variable (``DEFERRED_OFFLINE_EVAL``, ``RETAIN_GRPO_CHECKPOINTS``)
    has a value other than those it takes."""


class ConfigError(ValueError):
    """A config file or value is wrong; the message names field and fix, one line per field."""


class CheckpointError(ValueError):
    """A checkpoint or the checkpoint series is missing, incomplete or inconsistent."""


class EvaluationError(ValueError):
    """The run cannot be evaluated as it is (bad series, bad log); nothing was logged."""


class LogWriteError(OSError):
    """The MLPerf log cannot be written (path, permissions, disk)."""


class ModelLoadError(ValueError):
    """The model directory is missing or is not a loadable Hugging Face causal LM."""


class RunDirError(ValueError):
    """The run directory is missing or is not a run made by ``mlperf-grpo train``."""


BAD_INPUT_ERRORS: tuple[type[Exception], ...] = (
    BadInput, ConfigError, CheckpointError, EvaluationError, LogWriteError, ModelLoadError, RunDirError,
)
"""The library's bad-input errors (and their subclasses): exit 2."""
