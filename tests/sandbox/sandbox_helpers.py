"""Shared by tests/sandbox and tests/agent: a usable bwrap or a clean skip, a small
repository, and the processes that descend from this one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mlperf_grpo.errors import ConfigError
from mlperf_grpo.sandbox import backend_name


def require_bwrap() -> None:
    """Skip (with the reason) where bubblewrap cannot make a sandbox; .ci/run installs it."""
    try:
        backend_name()
    except ConfigError as error:
        pytest.skip(str(error))


def make_repo(folder: Path) -> Path:
    """A two-file repository at ``folder``."""
    folder.mkdir(parents=True)
    (folder / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (folder / "README").write_text("calc\n")
    return folder


def descendants(pid: int) -> list[int]:
    """Live pids whose parent chain reaches ``pid`` (zombies count: they are not reaped)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                text = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(text[text.rindex(")") + 2:].split()[1])
    found, frontier = [], {pid}
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = set(children)
    return found


def processes_with(marker: str) -> list[int]:
    """Pids of the processes whose command line contains ``marker``, this one left out."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline:
                found.append(int(entry))
    return found


def new_descendants(before: set[int]) -> list[int]:
    """This process's live descendants that were not among ``before`` (the suite's own
    long-lived children, e.g. reward workers of earlier tests, are not the sandbox's)."""
    return [pid for pid in descendants(os.getpid()) if pid not in before]
