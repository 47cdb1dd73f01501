"""The run directory: where one run's config, log, checkpoints and results live.

    <run>/config.yaml        the resolved config the run was trained with
    <run>/run.json           {"mllog_file": path of the MLPerf log, "retain_checkpoints":
                             true when the run was started to keep its checkpoints}
    <run>/mlperf.log         the MLPerf log (unless MLPERF_MLLOG_FILE names another)
    <run>/checkpoints/       deferred checkpoints, step_N/ (see checkpoint.py)
    <run>/eval/step_N.jsonl  per-task validation results of each evaluated checkpoint
    <run>/eval/summary.json  the offline evaluation's outcome
    <run>/eval/mlperf_eval.log  the evaluator's own log while it follows a running training
                             (evaluate --follow); merged into the MLPerf log once training ended
    <run>/eval/.lock         held (flock) by the one evaluator writing eval/mlperf_eval.log
    <run>/stop_training.json written by evaluate --follow --stop-training-at-pass at a pass;
                             the trainer stops after the step it is on
    <run>/.lock              held (flock) by the one process writing to the run
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mlperf_grpo import environment
from mlperf_grpo.config.load import dump_config, load_config
from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.errors import RunDirError
from mlperf_grpo.step_dirs import published_steps

"""Environment variable of the reference launcher naming the MLPerf log file."""


class RunLockedError(RunDirError):
    """Another process (trainer or evaluator) is writing to this run."""


def reserve_new_run_dir(parent: Path, name: str) -> Path:
    """Create and return a new, empty directory ``parent/name``, or ``name-2``,
    ``name-3``... when that one exists: each try is one ``mkdir`` without ``exist_ok``,
    atomic in the kernel, so two processes (or threads) reserving the same name at once
    get two directories (``parent`` is made when missing).

    Raises:
        RunDirError: ``parent`` (or a folder above it) is a file, or cannot be written.
    """
    try:
        parent.mkdir(parents=True, exist_ok=True)
        n = 1
        while True:
            candidate = parent / (name if n == 1 else f"{name}-{n}")
            try:
                candidate.mkdir()
                return candidate
            except FileExistsError:
                n += 1
    except OSError as err:
        raise RunDirError(f"cannot create a run directory in {parent}: {err.strerror}; pass --output DIR") from None


class RunLock:
    """An exclusive ``flock`` on ``<run>/.lock`` for as long as the context is open.

    One writer per run: a trainer and an evaluator, or two evaluators, never write the
    same run at once. The kernel drops the lock when the holder exits, even on SIGKILL,
    so a killed process never leaves a stale lock.

    Raises:
        RunLockedError: on entry, when another process holds the lock.
        RunDirError: on entry, when the lock file cannot be made or opened (a read-only
            directory, a ``.lock`` that is a directory): one line naming the path.
    """

    def __init__(self, root: Path, role: str) -> None:
        self.path = Path(root) / ".lock"
        self.role = role
        self._fd: int | None = None

    def __enter__(self) -> "RunLock":
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise RunDirError(
                f"cannot write the run's lock file {self.path}: {err.strerror}; give a directory this user may "
                "write (a new --output for run/train)"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunLockedError(
                f"run {self.path.parent} is being written by {holder}; wait for it to finish "
                f"(one trainer or evaluator per run)"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"the {self.role} (pid {os.getpid()})".encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None


def check_path_length(path: Path, what: str) -> None:
    """Raises RunDirError when a folder name of ``path`` is longer than the file system
    allows (``NAME_MAX``, 255 bytes on Linux) or the whole path longer than ``PATH_MAX``
    (the OS's ``File name too long``, errno 36, as one line naming the limit)."""
    base = next((p for p in (path.absolute(), *path.absolute().parents) if _exists(p)), Path("/"))
    name_max, path_max = (os.pathconf(base, key) for key in ("PC_NAME_MAX", "PC_PATH_MAX"))
    long = next((part for part in path.parts if len(os.fsencode(part)) > name_max), None)
    if long is not None:
        raise RunDirError(f"{what} {str(path)[:60]}...: the name {long[:20]}... is {len(os.fsencode(long))} bytes, "
                          f"more than the file system's {name_max}; pass a shorter {what}")
    if len(os.fsencode(str(path.absolute()))) >= path_max:
        raise RunDirError(f"{what} {str(path)[:60]}...: the path is longer than the file system's {path_max} bytes; "
                          f"pass a shorter {what}")


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # ENAMETOOLONG: not a usable base
        return False


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

    @property
    def summary_file(self) -> Path:
        return self.eval_dir / "summary.json"

    @property
    def follow_log(self) -> Path:
        """``eval/mlperf_eval.log``: the log of an evaluator that followed the training
        (the training log belongs to the trainer until it ends)."""
        return self.eval_dir / "mlperf_eval.log"

    @property
    def stop_request_file(self) -> Path:
        """``stop_training.json``: the evaluator's request that training stop (a pass)."""
        return self.root / "stop_training.json"

    def request_training_stop(self, passing_step: int, time_ms: int) -> None:
        """Ask the trainer to stop after the step it is on: write ``stop_training.json``
        (``{"requested_by": "evaluator", "passing_step": N, "time_ms": Unix ms}``) with a
        rename, so the trainer reads it whole or not at all. Idempotent.

        Raises:
            OSError: the file cannot be written.
        """
        record = {"requested_by": "evaluator", "passing_step": passing_step, "time_ms": time_ms}
        fd, tmp = tempfile.mkstemp(prefix=".stop_training.", dir=self.root)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.stop_request_file)

    def training_stop_request(self) -> dict | None:
        """The evaluator's stop request (see :meth:`request_training_stop`), or ``None``.
        A file that is not such a record is not a request (``None``)."""
        try:
            record = json.loads(self.stop_request_file.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or not isinstance(record.get("passing_step"), int):
            return None
        return record

    def remove_if_unwritten(self) -> None:
        """Remove the directory when it holds nothing but ``.lock``: a run whose setup
        failed before any of its files was written (nothing else is touched)."""
        try:
            if [p.name for p in self.root.iterdir()] in ([], [".lock"]):
                (self.root / ".lock").unlink(missing_ok=True)
                self.root.rmdir()
        except OSError:
            pass  # not there, or something appeared in it: leave it

    def published_steps(self) -> list[int]:
        """Steps of the published ``checkpoints/step_N/`` directories, ascending (names
        only: a ``tmp_step_N/`` is unfinished and not counted)."""
        return published_steps(self.checkpoints)

    def check_unused(self) -> None:
        """Raises RunDirError when the path or a folder above it is a file (the directory
        cannot be made), the nearest existing one cannot be written (a read-only file
        system or folder; its ``.lock`` not a file), or the directory already holds a run
        (a second run there would mix two runs in one log); the message says how to
        finish or replace it."""
        check_path_length(self.root, "--output")
        existing = next((p for p in (self.root, *self.root.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            raise RunDirError(f"output {self.root}: {existing} is a file, not a directory; pass a new --output directory")
        lock = self.root / ".lock"
        if existing is not None and (not os.access(existing, os.W_OK | os.X_OK) or (lock.exists() and not lock.is_file())):
            why = f"{lock} is not a file" if lock.exists() else f"{existing} is not writable"
            raise RunDirError(f"output {self.root}: {why}; pass an --output this user may write")
        if self.info_file.exists() or self.config_file.exists() or self.checkpoints.exists():
            raise RunDirError(
                f"{self.root} already holds a run; pass another --output or delete it. If its training "
                f"stopped early, 'mlperf-grpo evaluate {self.root}' finishes it: it evaluates the published "
                "checkpoints, or closes a run stopped before its first checkpoint as aborted"
            )
        self.check_log_path()

    def check_log_path(self) -> None:
        """Raises RunDirError when the log (``$MLPERF_MLLOG_FILE``, else ``<run>/mlperf.log``)
        is a directory, lies under a file, or already holds MLPerf lines."""
        log = environment.mllog_file(self.root / "mlperf.log")
        blocker = next((p for p in log.parents if p.exists()), None)
        if log.is_dir() or (blocker is not None and not blocker.is_dir()):
            why = "Is a directory" if log.is_dir() else f"{blocker} is a file"
            raise RunDirError(f"cannot write MLPerf log {log}: {why}; set {environment.MLLOG_ENV} to a new file's path")
        if log.is_file() and ":::MLLOG" in log.read_text(errors="replace"):
            raise RunDirError(f"MLPerf log {log.resolve()} already holds a run's lines; use a new log file")

    def create(self, config: RunConfig, retain_checkpoints: bool = False) -> Path:
        """Make the directory, write ``config.yaml`` and ``run.json``; return the log path.

        The log path is ``$MLPERF_MLLOG_FILE`` when set, else ``<run>/mlperf.log``.
        ``retain_checkpoints`` (``run --retain-checkpoints``, ``RETAIN_GRPO_CHECKPOINTS=1``)
        is recorded in ``run.json``, so every later ``evaluate`` of the run keeps them
        (:meth:`retain_recorded`).

        Raises:
            RunDirError: the directory already holds a run, or the log file already holds
                MLPerf lines (a second run would corrupt both); nothing is written.
        """
        self.check_unused()
        mllog_file = environment.mllog_file(self.root / "mlperf.log").resolve()
        if mllog_file.is_file() and ":::MLLOG" in mllog_file.read_text(errors="replace"):
            raise RunDirError(f"MLPerf log {mllog_file} already holds a run's lines; use a new log file")
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            mllog_file.parent.mkdir(parents=True, exist_ok=True)
            with open(mllog_file, "a"):
                pass
        except OSError as err:
            raise RunDirError(f"cannot write MLPerf log {mllog_file}: {err.strerror}") from None
        # A log inside the run is recorded relative to it, so the run can be moved or copied.
        try:
            recorded = str(mllog_file.relative_to(self.root.resolve()))
        except ValueError:
            recorded = str(mllog_file)
        self.config_file.write_text(dump_config(config))
        info = {"mllog_file": recorded, **({"retain_checkpoints": True} if retain_checkpoints else {})}
        self.info_file.write_text(json.dumps(info, indent=2) + "\n")
        return mllog_file

    def retain_recorded(self) -> bool:
        """Whether the run was started to keep its checkpoints (``run.json``'s
        ``retain_checkpoints``; absent: no).

        Raises:
            RunDirError: ``run.json`` is unreadable, or the value is not true or false.
        """
        try:
            value = json.loads(self.info_file.read_text()).get("retain_checkpoints", False)
        except (OSError, ValueError, AttributeError):
            raise RunDirError(f"{self.info_file} is unreadable or malformed; expected {{\"mllog_file\": PATH}}") from None
        if not isinstance(value, bool):
            raise RunDirError(f"{self.info_file}: retain_checkpoints must be true or false, got {value!r}")
        return value

    def load(self) -> tuple[RunConfig, Path]:
        """The run's config and MLPerf log path.

        Raises:
            RunDirError: not a directory, or no ``config.yaml``/``run.json`` in it.
            ConfigError: ``config.yaml`` is invalid.
        """
        if not self.root.is_dir():
            raise RunDirError(f"run directory {self.root} does not exist or is not a directory")
        if not self.info_file.is_file() or not self.config_file.is_file():
            raise RunDirError(f"{self.root} is not a run directory (no run.json/config.yaml); pass the --output of 'mlperf-grpo train'")
        try:
            mllog_file = self.root / json.loads(self.info_file.read_text())["mllog_file"]  # relative or absolute
        except (ValueError, KeyError, TypeError):
            raise RunDirError(f"{self.info_file} is malformed; expected {{\"mllog_file\": PATH}}") from None
        return load_config(self.config_file), mllog_file
