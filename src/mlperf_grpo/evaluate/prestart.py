"""Start the process that evaluation ranks are forked from, before the evaluator's own
imports, so the ranks start with theirs done.

``evaluate --workers N`` launches its ranks with torchrun's launcher and the
``forkserver`` start method (``multiprocessing``): a fork server (a fresh interpreter)
imports the ranks' module once, then forks each rank from itself. Started here, at the
top of ``evaluate``, the server's imports (torch, transformers, ours: seconds) run while
the evaluator imports, takes the run's lock and checks the series; with ``spawn`` every
rank would import everything again after the launch. The server imports modules only:
it never touches CUDA, so each forked rank initialises its own device.

Stdlib only (importing this costs nothing). Lifetimes: the fork server imports this
module first, which has the kernel SIGKILL it when the evaluator's thread that started
it ends (Linux ``PR_SET_PDEATHSIG``; elsewhere it exits once the evaluator and its ranks
are gone, when it reads EOF on a pipe from them); a rank dies with the evaluator too
(``workers.die_with_launcher``).

The ranks inherit the environment the evaluator had when it started the server; the
launcher adds the rank's own variables (``RANK``, ``MASTER_ADDR``...).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import sys

RANK_START_METHOD = "forkserver"
"""The ``multiprocessing`` start method the evaluation ranks are launched with."""

_SERVER_PARENT_ENV = "MLPERF_GRPO_RANK_SERVER_PARENT_PID"
"""Set only while the fork server is started: the evaluator's pid, read (and removed) by
this module's import in the server."""


def prestart_rank_server(module: str) -> None:
    """Start the fork server (idempotent: one per process) with ``module`` imported in
    it; returns at once, the imports go on in the server. A server already running keeps
    the modules it was started with. The server is killed when the calling thread ends
    (the evaluator's main thread: when the evaluator exits or is killed)."""
    context = multiprocessing.get_context(RANK_START_METHOD)
    context.set_forkserver_preload([__name__, module])
    multiprocessing.resource_tracker.ensure_running()  # started first: only the server gets the variable
    os.environ[_SERVER_PARENT_ENV] = str(os.getpid())
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        del os.environ[_SERVER_PARENT_ENV]


def die_with_parent(parent_pid: int | None = None) -> None:
    """Linux: the kernel SIGKILLs this process when the thread that started it ends
    (``prctl(PR_SET_PDEATHSIG)``; its parent exiting or being killed). With
    ``parent_pid``: SIGKILLed now if its parent is no longer that process (it died before
    the ``prctl``). No-op where ``prctl`` is missing."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def _tie_fork_server_to_evaluator() -> None:
    """In the fork server (the only process started with ``_SERVER_PARENT_ENV`` set): die
    with the evaluator, so it neither outlives it nor keeps forked ranks' parent alive."""
    parent_pid = os.environ.pop(_SERVER_PARENT_ENV, None)
    if parent_pid is not None and sys.platform.startswith("linux"):
        die_with_parent(int(parent_pid))


_tie_fork_server_to_evaluator()
