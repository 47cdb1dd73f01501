"""The reward of a software-repair trajectory: the task's hidden tests in its final state.

After the last turn, :func:`grade` first makes the sandbox quiet (``sandbox.quiesce()``:
nothing the agent left running in the background may rewrite the hidden tests or the code
under test once they are written; a sandbox that cannot be confirmed quiet is graded 0),
then writes the task's hidden test files into the
trajectory's own sandbox (replacing whatever the agent left at those paths; a SWE-bench
test patch applied after the files it touches are reset to their base versions, read on
the host from the task's pristine repository: :mod:`.base_files`), runs the test command
there under ``timeout_s`` (the benchmark: 60 s), reads the log per test
(:mod:`.log_parsers`) and compares:

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

import io
import shlex
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from mlperf_grpo.tasks.base import TaskError
from mlperf_grpo.tasks.swe.base_files import BaseFile, diff_paths, fast_import_stream, read_base_files, touched_files
from mlperf_grpo.tasks.swe.log_parsers import PARSERS
from mlperf_grpo.tasks.swe.task import Grading, SweTask

LOG_TAIL_CHARS = 2000
"""Characters of the test log kept in :class:`Grade` (the end, where the summary is)."""
PASSING = ("PASSED", "XFAIL")
"""Statuses SWE-bench counts as a pass (``swebench.harness.grading.test_passed``)."""
TEST_PATCH_FILE = ".hidden_test_patch.diff"
BASE_FILES_FILE = ".hidden_base_files.fi"
"""The touched files' base versions as a ``git fast-import`` stream (:mod:`.base_files`)."""
BASE_REF = "refs/heads/grading-base"
GRADING_GIT_DIR = "/tmp/grading.git"
"""The git directory grading's git uses: made fresh in the command's private ``/tmp``."""
GIT_ISOLATED = f"GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null GIT_DIR={GRADING_GIT_DIR} GIT_NO_REPLACE_OBJECTS=1"
GIT = f'{GIT_ISOLATED} GIT_WORK_TREE="$PWD" git'
"""git as the grader runs it. The agent controls the repository, ``.git`` included, and
git runs code or changes what it writes on the word of ``.git/config`` (``core.fsmonitor``,
``core.hooksPath``, a ``filter.*.smudge`` named by ``.gitattributes``, ``core.autocrlf``,
``core.worktree``, ``apply.*``, ``include.path``), ``.git/hooks``, the index
(``skip-worktree`` bits) and its objects (a base commit deleted or replaced). So grading's
git reads none of them: its git directory is :data:`GRADING_GIT_DIR` (no config but ``git
init``'s, no hooks, a fresh index), whose only objects are the touched files' base
versions, read on the host from the task's pristine repository (:mod:`.base_files`); no
system or global config, no replace refs. Still the agent's: the work tree's
``.gitattributes`` (without a configured filter driver they only convert text: line
ends, ``$Id$``, encodings; run nothing)."""
GIT_SETUP = f"rm -rf {GRADING_GIT_DIR} && mkdir -m 700 {GRADING_GIT_DIR} && {GIT_ISOLATED} git init -q --template="
"""Makes :data:`GRADING_GIT_DIR` anew (a container's ``/tmp`` outlives a command: ``git init``
keeps the config of one the agent left there)."""


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


def grade(task: SweTask, sandbox, timeout_s: float, base_files: tuple[BaseFile, ...] | None = None) -> Grade:
    """Run ``task``'s hidden tests in ``sandbox`` (a :class:`mlperf_grpo.sandbox.Sandbox`
    after the trajectory's last turn) and score them (module docstring).

    The hidden files reach the final state through the sandbox itself (one ``tar``
    stream on a command's stdin), never by a host write under ``sandbox.workdir``, where
    the agent may have planted links: ``r2e_tests/`` is removed first, so nothing the
    agent left there runs.

    Args:
        task: the task; ``task.grading`` says what to write, run and compare.
        sandbox: has ``quiesce() -> str`` ("" when nothing the agent started still runs)
            and ``run(command, timeout_s, input_bytes) -> CommandResult``.
        timeout_s: limit of the test run (the benchmark's 60 s), and of the writing.
        base_files: :func:`pristine_base_files` of the task, read before the agent ran;
            None reads them now from ``task.repo_dir``.

    Raises:
        TaskError: a test patch whose base files cannot be read (:func:`pristine_base_files`).
    """
    grading = task.grading
    base = pristine_base_files(task) if base_files is None else base_files
    noisy = sandbox.quiesce()
    if noisy:
        return Grade(0.0, False, f"the sandbox is not quiet before grading: {noisy}", "")
    failed = _install_hidden_files(task, sandbox, timeout_s, base)
    if failed is not None:
        return failed
    result = sandbox.run(test_run_command(grading, sandbox), timeout_s=timeout_s)
    tail = result.output[-LOG_TAIL_CHARS:]
    if result.timed_out:
        return Grade(0.0, True, f"the test run timed out after {timeout_s:g} s", tail)
    if result.exit_code is None:
        why = getattr(result, "kill_reason", "") or "a sandbox limit"
        return Grade(0.0, True, f"the test run was killed ({why})", tail)
    statuses = PARSERS[grading.log_format](result.output)
    passed, reason = compare(grading, statuses)
    return Grade(1.0 if passed else 0.0, False, reason, tail)


def pristine_base_files(task: SweTask, repo: Path | None = None) -> tuple[BaseFile, ...]:
    """The base commit's versions (``metadata["base_commit"]``, else ``HEAD``) of the files
    ``task``'s test patch touches, read on the host from ``repo`` (default ``task.repo_dir``):
    the copy the sandbox was made from, or the sandbox's own copy before the agent's first
    command (an image's ``/testbed``). () without a test patch.

    Raises:
        TaskError: no repository to read, or git cannot read the base commit's files there.
    """
    patch = task.grading.test_patch
    if patch is None:
        return ()
    repo = repo if repo is not None else task.repo_dir
    if repo is None:
        raise TaskError(f"grading {task.task_id}: no repository to read the test patch's base files from; read "
                        "them from the sandbox's copy before the agent runs (pristine_base_files(task, workdir))")
    return read_base_files(Path(repo), str(task.metadata.get("base_commit") or "HEAD"), touched_files(patch))


def test_run_command(grading: Grading, sandbox) -> str:
    """The test command as run: pytest logs are read from their end (the ``-rA`` summary),
    so their output goes to a file in the command's private ``/tmp`` and only its last
    ``limits.output_bytes`` come back (a sandbox keeps the head of longer output);
    unittest's per-test lines come first and are read as printed."""
    limits = getattr(sandbox, "limits", None)
    if not grading.log_format.startswith("pytest") or limits is None:
        return grading.test_command
    log = "/tmp/hidden_tests.log"
    return (f"( {grading.test_command}\n) > {log} 2>&1; status=$?; "
            f"tail -c {int(limits.output_bytes)} {log}; exit $status")


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


def hidden_files_tar(files: tuple[tuple[str, str | bytes], ...]) -> bytes:
    """An uncompressed tar of ``(relative path, text or bytes)`` files (mode 0644, fixed mtime).

    Raises:
        ValueError: a path that is absolute or climbs out with ``..``.
    """
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for relative, text in files:
            parts = PurePosixPath(relative).parts
            if not parts or PurePosixPath(relative).is_absolute() or ".." in parts:
                raise ValueError(f"hidden file path {relative!r} is not inside the repository")
            data = text.encode("utf-8") if isinstance(text, str) else text
            info = tarfile.TarInfo(relative)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _install_hidden_files(task: SweTask, sandbox, timeout_s: float, base_files: tuple[BaseFile, ...]) -> Grade | None:
    """Write the hidden test files (and apply a SWE-bench test patch) inside the sandbox.
    None when done; else the grade that ends grading (0, or invalid when killed)."""
    grading = task.grading
    files: tuple[tuple[str, str | bytes], ...] = grading.test_files
    steps, reset = ["tar --no-same-owner -xf -"], ""
    if grading.test_patch is not None:  # SWE-bench's order: reset the touched files to the base, then apply
        files += ((TEST_PATCH_FILE, grading.test_patch),)
        reset = "".join(" " + shlex.quote(file.path) for file in base_files)  # removed; those the base has come back
        steps.append(GIT_SETUP)
        if any(file.mode for file in base_files):
            files += ((BASE_FILES_FILE, fast_import_stream(base_files, BASE_REF)),)
            steps.append(f"{GIT} fast-import --quiet < {BASE_FILES_FILE} && rm -f {BASE_FILES_FILE} && "
                         f"{GIT} checkout -q {BASE_REF} -- .")
        steps.append(f"{GIT} apply {TEST_PATCH_FILE} && rm -f {TEST_PATCH_FILE}")
    stale = " r2e_tests" if any(path.startswith("r2e_tests/") for path, _ in files) else ""
    command = f"chmod u+w . 2>/dev/null; rm -rf -- {TEST_PATCH_FILE} {BASE_FILES_FILE}{stale}{reset}; " + " && ".join(steps)
    result = sandbox.run(command, timeout_s=timeout_s, input_bytes=hidden_files_tar(files))
    if result.exit_code == 0:
        return None
    tail = result.output[-LOG_TAIL_CHARS:]
    if result.exit_code is None:
        return Grade(0.0, True, "writing the hidden tests timed out or was killed", tail)
    if grading.test_patch is None:
        return Grade(0.0, False, "the hidden tests cannot be written in the final state", tail)
    return Grade(0.0, False, "the hidden test patch does not apply in the final state", tail)


def patched_files(patch: str) -> list[str]:
    """The files a unified diff writes (its ``+++ b/<path>`` lines), sorted."""
    return sorted(diff_paths(patch)[1])
