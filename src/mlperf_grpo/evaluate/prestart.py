"""Start the process that evaluation ranks are forked from, before the evaluator's own
imports, so the ranks start with theirs done.

``evaluate --workers N`` launches its ranks with torchrun's launcher and the
``forkserver`` start method (``multiprocessing``): a fork server (a fresh interpreter)
imports the ranks' module once, then forks each rank from itself. Started here, at the
top of ``evaluate``, the server's imports (torch, transformers, ours: seconds) run while
the evaluator imports, takes the run's lock and checks the series; with ``spawn`` every
rank would import everything again after the launch. The server imports modules only:
it never touches CUDA, so each forked rank initialises its own device.

Stdlib only (importing this costs nothing). The fork server exits when the evaluator
does (it reads EOF on a pipe from it); a rank dies with the fork server
(``workers.die_with_parent``).

The ranks inherit the environment the evaluator had when it started the server; the
launcher adds the rank's own variables (``RANK``, ``MASTER_ADDR``...).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver

RANK_START_METHOD = "forkserver"
"""The ``multiprocessing`` start method the evaluation ranks are launched with."""


def prestart_rank_server(module: str) -> None:
    """Start the fork server (idempotent: one per process) with ``module`` imported in
    it; returns at once, the imports go on in the server. A server already running keeps
    the modules it was started with."""
    context = multiprocessing.get_context(RANK_START_METHOD)
    context.set_forkserver_preload([module])
    multiprocessing.forkserver.ensure_running()
