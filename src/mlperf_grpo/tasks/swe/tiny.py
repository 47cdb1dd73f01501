"""The shipped tiny software-repair suite: small Python repositories with a planted bug.

Each task is one hand-written text file under ``assets/swe_tiny/<split>/`` (``train``:
24, ``validation``: 12; file-name order is row order) in sections:

```
=== issue              the issue text the agent sees
=== file PATH          a file of the repository at its base commit (several)
=== test PATH          a hidden test file (``r2e_tests/...``), never in the repository
=== fix PATH           the known fix: text to replace in PATH ...
=== into               ... and its replacement (several fix/into pairs allowed)
```

Tests are standard-library ``unittest`` run by the sandbox's ``python3`` (nothing to
install), laid out like R2E-Gym's (hidden files in ``r2e_tests/``); the expected result
is every hidden test ``PASSED``, compared exactly as R2E-Gym does (:mod:`.grade`). At the
base commit at least one hidden test fails; with the known fix all pass (tests check both
on every task). :func:`tiny_suite` materialises the repositories once per content (a
folder named by the assets' hash, a git repository with one fixed-date commit when
``git`` is installed) and returns the tasks in row order.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from mlperf_grpo.tasks.base import TaskError
from mlperf_grpo.tasks.swe.task import Grading, SweTask

SPLITS = ("train", "validation")
TEST_COMMAND = "python3 -I -B -m unittest discover -v -b -s r2e_tests -t ."
"""The hidden tests' command: ``-I`` keeps the agent's files from shadowing ``unittest``
(the repository joins ``sys.path`` only when discovery starts), ``-b`` keeps test prints
out of the verbose lines the grader reads."""
DATASET_NAME = "mlperf-grpo/swe-tiny"
_GIT_ENV = {"GIT_AUTHOR_NAME": "swe-tiny", "GIT_AUTHOR_EMAIL": "swe-tiny@localhost",
            "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+0000", "GIT_COMMITTER_NAME": "swe-tiny",
            "GIT_COMMITTER_EMAIL": "swe-tiny@localhost", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+0000",
            "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


@dataclass(frozen=True)
class Edit:
    """Replace the one occurrence of ``old`` in ``path`` by ``new`` (the editor tool's
    ``str_replace``: ``path``, ``old_str``, ``new_str``)."""

    path: str
    old: str
    new: str


@dataclass(frozen=True)
class TinySource:
    """One parsed task file."""

    name: str
    issue: str
    files: tuple[tuple[str, str], ...]
    tests: tuple[tuple[str, str], ...]
    fix: tuple[Edit, ...]


def _asset_root() -> Path:
    return Path(str(resources.files("mlperf_grpo") / "assets" / "swe_tiny"))


def read_sources(split: str) -> list[TinySource]:
    """The parsed task files of ``split``, in file-name order.

    Raises:
        TaskError: an unknown split or a malformed task file.
    """
    if split not in SPLITS:
        raise TaskError(f"the tiny swe suite has splits {', '.join(SPLITS)}; got {split!r}")
    return [parse_source(path) for path in sorted((_asset_root() / split).glob("*.task"))]


def parse_source(path: Path) -> TinySource:
    """One task file (module docstring) -> :class:`TinySource`.

    Raises:
        TaskError: a section that is unknown, repeated where it must not be, or missing.
    """
    sections: list[tuple[str, str, list[str]]] = []
    for line in path.read_text(encoding="utf-8").split("\n"):
        if line.startswith("=== "):
            kind, _, target = line[4:].partition(" ")
            sections.append((kind, target, []))
        elif sections:
            sections[-1][2].append(line)
        elif line.strip():
            raise TaskError(f"{path}: text before the first '=== ' section")
    issue, files, tests, fix = None, [], [], []
    for index, (kind, target, lines) in enumerate(sections):
        text = "\n".join(lines).rstrip("\n") + "\n"
        if target.startswith("/") or ".." in target.split("/"):
            raise TaskError(f"{path}: section path {target!r} must stay inside the repository")
        if kind == "issue":
            issue = text.strip()
        elif kind in ("file", "test") and target:
            (files if kind == "file" else tests).append((target, text))
        elif kind == "fix" and target and index + 1 < len(sections) and sections[index + 1][0] == "into":
            new = "\n".join(sections[index + 1][2]).rstrip("\n") + "\n"
            fix.append(Edit(target, text, new))
        elif kind != "into":
            header = f"=== {kind} {target}".strip()
            raise TaskError(f"{path}: bad section {header!r}; sections are issue, file PATH, test PATH, fix PATH + into")
    if issue is None or not files or not tests or not fix:
        raise TaskError(f"{path}: a task needs an issue, files, hidden tests and a fix")
    return TinySource(path.stem, issue, tuple(files), tuple(tests), tuple(fix))


def hidden_test_names(source: TinySource) -> list[str]:
    """The unittest ids of ``source``'s hidden tests (``r2e_tests.test_x.Class.test_y``)."""
    names = []
    for path, text in source.tests:
        module = path.removesuffix(".py").replace("/", ".")
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef):
                names += [f"{module}.{node.name}.{f.name}" for f in node.body
                          if isinstance(f, ast.FunctionDef) and f.name.startswith("test")]
    return names


def tiny_suite(split: str, root: Path | None = None) -> list[SweTask]:
    """The tiny suite's ``split`` (``train`` | ``validation``) as tasks, row order kept.

    Args:
        root: folder for the materialised repositories (default: the system temp folder);
            they go to ``root/swe-tiny-<hash of the assets>/<task>/``, made once.
    """
    sources = read_sources(split)
    folder = materialise(sources, (root or Path(tempfile.gettempdir())) / f"swe-tiny-{assets_digest()[:16]}" / split)
    return [to_task(source, split, folder / source.name, _head(folder / source.name)) for source in sources]


def known_fix(task_id: str) -> tuple[Edit, ...]:
    """The known fix of a tiny task (tests and scripted policies apply it with the editor tool).

    Raises:
        KeyError: ``task_id`` is not a tiny-suite task.
    """
    return _fixes()[task_id]


@functools.lru_cache(maxsize=1)
def _fixes() -> dict[str, tuple[Edit, ...]]:
    return {task_id_of(source): source.fix for split in SPLITS for source in read_sources(split)}


def apply_edits(workdir: Path, edits: tuple[Edit, ...]) -> None:
    """Apply ``edits`` to the files under ``workdir`` (each ``old`` must occur once)."""
    for edit in edits:
        path = workdir / edit.path
        text = path.read_text(encoding="utf-8")
        if text.count(edit.old) != 1:
            raise ValueError(f"{edit.path}: the text to replace occurs {text.count(edit.old)} times, not once")
        path.write_text(text.replace(edit.old, edit.new), encoding="utf-8")


def task_id_of(source: TinySource) -> str:
    return f"swe-tiny__{source.name}"


def to_task(source: TinySource, split: str, repo_dir: Path | None, base_commit: str | None) -> SweTask:
    """The :class:`SweTask` of a task file whose repository is at ``repo_dir``."""
    tests = source.tests + (("r2e_tests/__init__.py", ""),)
    grading = Grading(test_files=tests, test_command=TEST_COMMAND, log_format="unittest",
                      expected=tuple(sorted((name, "PASSED") for name in hidden_test_names(source))))
    metadata = {"repo": f"swe-tiny/{source.name}", "base_commit": base_commit, "dataset_name": DATASET_NAME,
                "split": split, "repo_language": "Python"}
    return SweTask(task_id_of(source), source.issue, repo_dir, None, grading, metadata)


def assets_digest() -> str:
    """SHA-256 over the task files' names and bytes (names the materialised folder)."""
    digest = hashlib.sha256()
    for split in SPLITS:
        for path in sorted((_asset_root() / split).glob("*.task")):
            digest.update(f"{split}/{path.name}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def materialise(sources: list[TinySource], folder: Path) -> Path:
    """Write each source's repository to ``folder/<name>/`` unless ``folder`` exists
    (built in a sibling temp folder and renamed, so concurrent runs never see half a suite)."""
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        for source in sources:
            repo = staging / source.name
            for relative, text in source.files:
                (repo / relative).parent.mkdir(parents=True, exist_ok=True)
                (repo / relative).write_text(text, encoding="utf-8")
            _git_commit(repo)
        os.rename(staging, folder)
    except OSError:
        if not folder.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _git_commit(repo: Path) -> None:
    """One commit with a fixed author and date (same hash everywhere), when git exists."""
    if shutil.which("git") is None:
        return
    env = {**os.environ, **_GIT_ENV}
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "--no-gpg-sign", "-m", "base commit"]):
        subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True)


def _head(repo: Path) -> str | None:
    """The base commit's hash (``.git/refs/heads/main``), or None without git."""
    ref = repo / ".git" / "refs" / "heads" / "main"
    return ref.read_text(encoding="ascii").strip() if ref.is_file() else None
