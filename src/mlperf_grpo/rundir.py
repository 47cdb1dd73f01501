"""The run directory: where one run's config, log, checkpoints and results live.

    <run>/config.yaml        the resolved config the run was trained with
    <run>/run.json           {"mllog_file": path of the MLPerf log}
    <run>/mlperf.log         the MLPerf log (unless MLPERF_MLLOG_FILE names another)
    <run>/checkpoints/       deferred checkpoints, step_N/ (see checkpoint.py)
    <run>/eval/step_N.jsonl  per-task validation results of each evaluated checkpoint
    <run>/eval/summary.json  the offline evaluation's outcome
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from mlperf_grpo.config import RunConfig, dump_config, load_config

MLLOG_ENV = "MLPERF_MLLOG_FILE"
"""Environment variable of the reference launcher naming the MLPerf log file."""


class RunDirError(ValueError):
    """The run directory is missing or is not a run made by ``mlperf-grpo train``."""


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run directory."""

    root: Path

    @property
    def config_file(self) -> Path:
        return self.root / "config.yaml"

    @property
    def info_file(self) -> Path:
        return self.root / "run.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def eval_dir(self) -> Path:
        return self.root / "eval"

    def create(self, config: RunConfig) -> Path:
        """Make the directory, write ``config.yaml`` and ``run.json``; return the log path.

        The log path is ``$MLPERF_MLLOG_FILE`` when set, else ``<run>/mlperf.log``.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        mllog_file = Path(os.environ.get(MLLOG_ENV) or self.root / "mlperf.log").resolve()
        self.config_file.write_text(dump_config(config))
        self.info_file.write_text(json.dumps({"mllog_file": str(mllog_file)}, indent=2) + "\n")
        return mllog_file

    def load(self) -> tuple[RunConfig, Path]:
        """The run's config and MLPerf log path.

        Raises:
            RunDirError: not a directory, or no ``config.yaml``/``run.json`` in it.
            ConfigError: ``config.yaml`` is invalid.
        """
        if not self.root.is_dir():
            raise RunDirError(f"run directory {self.root} does not exist")
        if not self.info_file.is_file() or not self.config_file.is_file():
            raise RunDirError(f"{self.root} is not a run directory (no run.json/config.yaml); pass the --output of 'mlperf-grpo train'")
        try:
            mllog_file = Path(json.loads(self.info_file.read_text())["mllog_file"])
        except (ValueError, KeyError, TypeError):
            raise RunDirError(f"{self.info_file} is malformed; expected {{\"mllog_file\": PATH}}") from None
        return load_config(self.config_file), mllog_file
