"""The reward of a software-repair trajectory: the task's hidden tests in its final state.

After the last turn, :func:`grade` writes the task's hidden test files into the
trajectory's own sandbox (replacing whatever the agent left at those paths), runs the
test command there under ``timeout_s`` (the benchmark: 60 s), reads the log per test
(:mod:`.test_logs`) and compares:

- R2E-Gym rows (``expected_output_json``): reward 1 when the parsed ``{test: status}``
  equals the expected one exactly: same number of tests, each name (cut at `` - ``)
  with the same status; else 0. Source: R2E-Gym ``DockerRuntime._calculate_reward_r2e``
  (``src/r2egym/agenthub/runtime/docker.py``). Where R2E-Gym raises ``KeyError`` on a
  parsed name missing from the expected set (equal counts, other names), we score 0.
- SWE-bench / SWE-Gym rows (``FAIL_TO_PASS`` / ``PASS_TO_PASS``): reward 1 when every
  named test has status PASSED or XFAIL; else 0 (SWE-bench ``get_eval_tests_report``,
  ``ResolvedStatus.FULL``; NeMo Gym's ``f2p <= passed and p2p <= passed``).

**Invalid sample.** A test run cut by its timeout, or killed by a sandbox limit, gives
``invalid=True`` (reward 0, to be excluded from the advantage and from pass@k, not scored
as a failure). Source: NeMo Gym ``responses_api_agents/swe_agents/app.py``
(``SWEBenchWrapper.run``): ``mask_sample`` is set when the eval container hit
``swebench_tests_timeout`` ("reward is unreliable") or its memory watchdog killed it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from mlperf_grpo.tasks.swe.task import Grading, SweTask
from mlperf_grpo.tasks.swe.test_logs import PARSERS

LOG_TAIL_CHARS = 2000
"""Characters of the test log kept in :class:`Grade` (the end, where the summary is)."""
PASSING = ("PASSED", "XFAIL")
"""Statuses SWE-bench counts as a pass (``swebench.harness.grading.test_passed``)."""
TEST_PATCH_FILE = ".hidden_test_patch.diff"


@dataclass(frozen=True)
class Grade:
    """The outcome of grading one trajectory's final state."""

    reward: float
    """1.0 when the hidden tests pass by the task's rule, else 0.0 (always 0.0 when invalid)."""
    invalid: bool
    """True when the test run timed out or was killed: the sample is masked, not scored."""
    reason: str
    """One line: ``passed``, the first differing test, the timeout, ..."""
    log_tail: str
    """The last :data:`LOG_TAIL_CHARS` characters of the test output."""


def grade(task: SweTask, sandbox, timeout_s: float) -> Grade:
    """Run ``task``'s hidden tests in ``sandbox`` (a :class:`mlperf_grpo.sandbox.Sandbox`
    after the trajectory's last turn) and score them (module docstring).

    Args:
        task: the task; ``task.grading`` says what to write, run and compare.
        sandbox: has ``workdir`` (host path of the repository copy) and
            ``run(command, timeout_s) -> CommandResult``.
        timeout_s: limit of the test run (the benchmark's 60 s).
    """
    grading = task.grading
    try:
        write_hidden_files(Path(sandbox.workdir), grading.test_files)
    except OSError as err:
        return Grade(0.0, True, f"could not write the hidden tests into the sandbox: {err}", "")
    if grading.test_patch is not None:
        base = str(task.metadata.get("base_commit") or "HEAD")
        failed = _apply_test_patch(Path(sandbox.workdir), sandbox, grading.test_patch, base, timeout_s)
        if failed is not None:
            return failed
    result = sandbox.run(grading.test_command, timeout_s=timeout_s)
    tail = result.output[-LOG_TAIL_CHARS:]
    if result.timed_out:
        return Grade(0.0, True, f"the test run timed out after {timeout_s:g} s", tail)
    if result.exit_code is None:
        return Grade(0.0, True, "the test run was killed by a sandbox limit", tail)
    statuses = PARSERS[grading.log_format](result.output)
    passed, reason = compare(grading, statuses)
    return Grade(1.0 if passed else 0.0, False, reason, tail)


def compare(grading: Grading, statuses: dict[str, str]) -> tuple[bool, str]:
    """``(passed, reason)`` of parsed ``statuses`` under ``grading``'s rule (module docstring)."""
    if grading.expected is not None:
        cut = {name.split(" - ")[0]: status for name, status in sorted(statuses.items())}
        expected = {name.split(" - ")[0]: status for name, status in sorted(grading.expected)}
        if len(cut) != len(expected):
            return False, f"{len(cut)} tests ran, {len(expected)} expected"
        for name, status in cut.items():
            if expected.get(name) != status:
                want = expected.get(name, "no such test")
                return False, f"{name}: {status}, expected {want}"
        return True, "passed"
    for what, names in (("FAIL_TO_PASS", grading.fail_to_pass), ("PASS_TO_PASS", grading.pass_to_pass)):
        for name in names:
            if statuses.get(name) not in PASSING:
                return False, f"{what} {name}: {statuses.get(name, 'did not run')}"
    return True, "passed"


def write_hidden_files(workdir: Path, files: tuple[tuple[str, str], ...]) -> None:
    """Write ``(relative path, text)`` files under ``workdir``, following no link the agent
    may have planted: every parent folder that is a symlink or not a folder is replaced by
    a new folder, and an existing file is unlinked before the new one is created.

    Raises:
        OSError: a path leaves ``workdir`` or cannot be written.
    """
    for relative, text in files:
        parts = PurePosixPath(relative).parts
        if not parts or PurePosixPath(relative).is_absolute() or ".." in parts:
            raise OSError(f"hidden test path {relative!r} is not inside the repository")
        folder = workdir
        for part in parts[:-1]:
            folder = folder / part
            _ensure_real_folder(folder)
        target = folder / parts[-1]
        _remove(target)
        descriptor = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)


def _ensure_real_folder(path: Path) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        os.mkdir(path)
        return
    if stat.S_ISDIR(mode):
        os.chmod(path, stat.S_IMODE(mode) | stat.S_IRWXU)  # the agent may have made it read-only
        return
    _remove(path)
    os.mkdir(path)


def _remove(path: Path) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _apply_test_patch(workdir: Path, sandbox, test_patch: str, base: str, timeout_s: float) -> Grade | None:
    """SWE-bench's order: reset the test files the patch touches to the base commit, then
    ``git apply`` it. None when applied; else the 0-reward (or invalid) grade."""
    write_hidden_files(workdir, ((TEST_PATCH_FILE, test_patch),))
    touched = sorted({line[6:] for line in test_patch.splitlines() if line.startswith("+++ b/")})
    reset = f"git checkout -q {shlex.quote(base)} -- {' '.join(shlex.quote(p) for p in touched)} 2>/dev/null; " if touched else ""
    result = sandbox.run(f"{reset}git apply {TEST_PATCH_FILE} && rm -f {TEST_PATCH_FILE}", timeout_s=timeout_s)
    tail = result.output[-LOG_TAIL_CHARS:]
    if result.timed_out or result.exit_code is None:
        return Grade(0.0, True, "applying the test patch timed out or was killed", tail)
    if result.exit_code != 0:
        return Grade(0.0, False, "the hidden test patch does not apply to the final state", tail)
    return None
