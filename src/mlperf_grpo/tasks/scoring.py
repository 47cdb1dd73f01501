"""Reward scoring under a deadline that holds for any input: rewards run in worker processes.

A reward function may never return, and may hold the interpreter lock while it does
(``math-verify`` on ``\\boxed{9^{9^{9}}}`` computes a huge integer power), so a deadline
kept by a thread of the same process cannot fire. :func:`score` therefore runs the
reward calls in a persistent pool of :data:`REWARD_WORKERS` worker processes and kills
(then replaces) a worker whose call runs past its timeout.

- **Reward functions by name.** A worker imports the reward function by its
  ``"module:qualname"`` (a module-level function, given as the function or as that
  string): the built-in tasks' ``reward``, :func:`mlperf_grpo.tasks.verify.math_reward`,
  or a user's ``pkg.mod:fn``. Closures and lambdas are refused (``ValueError``).
- **Workers** are fresh interpreters (``subprocess`` with the parent's ``sys.path``, so no
  ``fork`` of a process whose torch threads run, and the caller's ``__main__`` is not
  re-run); they start on the first call, are reused by every later one (a GRPO step
  scores 256 completions, a validation 1,004), and stop at exit. A worker dies with its
  parent even under SIGKILL (Linux ``PR_SET_PDEATHSIG``; elsewhere it exits when its
  connection closes, once its current call returns). Ctrl-C goes to the parent only.
- **Time.** A call's timeout counts from the moment the worker starts it; importing the
  reward's module in a fresh worker has its own bound (:data:`LOAD_TIMEOUT_S`).
- **Errors** (:class:`VerifierError`): any call that raised, timed out or whose worker
  died fails the whole ``score`` call; nothing is counted as a wrong answer. When as many
  calls have timed out (or lost their worker) as there are workers, the verifier is taken
  to hang: calls not yet started are not scored and the error comes at once (seconds, not
  ``len(items) x timeout``). Validation scores this way.
- **Timeouts in training** (:func:`score_tolerating_timeouts`): a call that times out
  scores 0.0 and is counted, as the reference trainer's math environment scores a
  verification that raises or times out (NeMo-RL ``nemo_rl/environments/math_environment.py``,
  ``HFVerifyWorker.verify``: ``except (Exception, TimeoutException): results.append(0.0)``;
  TRL's ``trl/rewards/accuracy_rewards.py`` gives such a completion ``None``, skipped); the
  call fails only when more than ``max_timeout_share`` of the completions time out (a
  verifier that hangs on everything is broken, not one pathological completion), and stops
  scheduling as soon as that is certain. A call that raises still fails it.
- **Values** (:class:`RewardValueError`): a reward must be a finite real number (``int``,
  ``float``, ``bool``, a numpy or 0-d torch scalar). NaN, an infinity or anything else (a
  string, ``None``, a list) fails the whole ``score`` call, naming the task and the value:
  in training a NaN reward makes every advantage of its group NaN, then the loss, the
  gradients and every weight (huggingface/trl#5773), and in validation a NaN is not
  ``> 0``, so it would count as a wrong answer.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from mlperf_grpo.tasks.base import Task, TaskError
from mlperf_grpo.tasks.reward_names import RewardFn, resolve_reward, reward_ref

REWARD_TIMEOUT_S = 30.0
"""Seconds one reward call may take before it counts as a verifier error."""

REWARD_WORKERS = 4
"""Reward calls run at once (worker processes)."""

LOAD_TIMEOUT_S = 120.0
"""Seconds a fresh worker may take to start or to import a reward function's module."""

CANCEL_POLL_S = 0.1
"""Seconds a call given a ``cancel`` event may go without looking at it."""



class VerifierError(RuntimeError):
    """The reward function raised or timed out; the checkpoint's accuracy is unknown
    (an error is never counted as a wrong answer)."""


class ScoringCancelled(Exception):
    """A score call stopped by its ``cancel`` event; its calls in progress were killed."""


class RewardValueError(VerifierError, TaskError):
    """The reward function returned something that is not a finite real number (NaN, an
    infinity, a string, ...): the task's code is wrong, so it is bad input (exit 2)."""


def finite_reward(value: object) -> float | None:
    """``value`` as a float when it is a finite real number, else None.

    Real numbers are those with ``__float__`` (``int``, ``float``, ``bool``, ``Fraction``,
    numpy and 0-d torch scalars); a ``str`` (``"1.0"`` included), ``None``, a list or a
    number whose float is NaN or infinite (``10**400`` too) is not a reward.
    """
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


_WORKER_CODE = (
    "import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
    "from mlperf_grpo.tasks.scoring import _worker_main; _worker_main(int(sys.argv[2]), int(sys.argv[3]))"
)


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(0)


def _worker_main(fd: int, parent_pid: int) -> None:
    """Worker loop: receive ``(index, ref, text, task, sys_path or None)``, reply
    ``("loaded", index)`` after a first import of ``ref`` (with the caller's ``sys.path``),
    then ``("done", index, reward)``, ``("bad_value", index, repr of the value)`` (see
    :func:`finite_reward`) or ``("error", index, text)``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _die_with_parent(parent_pid)
    conn = Connection(fd)
    functions: dict[str, RewardFn] = {}
    conn.send(("ready", -1))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        index, ref, text, task, path = message
        try:
            if path is not None:
                sys.path[:0] = [p for p in path if p not in sys.path]
            if ref not in functions:
                functions[ref] = resolve_reward(ref)
                conn.send(("loaded", index))
            value = functions[ref](text, task)
            reward = finite_reward(value)
            conn.send(("done", index, reward) if reward is not None else ("bad_value", index, _shown(value)))
        except Exception as err:  # noqa: BLE001  (any verifier failure is reported, not scored)
            conn.send(("error", index, f"{type(err).__name__}: {err}"))


def _shown(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a reward's value in an error line)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass
class _Worker:
    process: subprocess.Popen
    conn: Connection
    ready: bool = False
    loaded: set[str] = field(default_factory=set)
    call: int | None = None
    """Index of the item in progress, None when idle."""
    deadline: float = 0.0
    started: float = field(default_factory=time.monotonic)

    def kill(self) -> None:
        self.conn.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def _start_worker() -> _Worker:
    parent, child = socket.socketpair()
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CODE, json.dumps(sys.path), str(child.fileno()), str(os.getpid())],
            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
    finally:
        child.close()
    return _Worker(process, Connection(parent.detach()))


class RewardPool:
    """A persistent set of reward worker processes; see the module docstring.

    One :meth:`score` call runs at a time (calls from several threads take turns).
    """

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._lost = 0

    def close(self) -> None:
        """Stop every worker (their connections close; each is killed and reaped)."""
        with self._lock:
            for worker in self._workers:
                worker.kill()
            self._workers = []

    def score(self, reward_fn: RewardFn | str, items: list[tuple[str, Task]], timeout_s: float,
              timeouts_allowed: int = 0, cancel: threading.Event | None = None) -> tuple[list[float], int]:
        """``(rewards of items in order, timeouts)``; see :func:`score` (``timeouts_allowed``
        0) and :func:`score_tolerating_timeouts`."""
        ref = reward_ref(reward_fn)
        with self._lock:
            clean = False
            try:
                outcome = self._run(ref, items, timeout_s, timeouts_allowed, cancel)
                clean = True
            finally:
                if not clean:  # interrupted or cancelled: calls in progress would answer the next score()
                    for worker in [w for w in self._workers if w.call is not None]:
                        worker.kill()  # the next call starts its replacement
                        self._workers.remove(worker)
        return _rewards_or_error(ref, items, timeout_s, timeouts_allowed, outcome)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = _start_worker()

    def _run(self, ref: str, items: list[tuple[str, Task]], timeout_s: float, timeouts_allowed: int,
             cancel: threading.Event | None):
        while len(self._workers) < self.num_workers:
            self._workers.append(_start_worker())
        self._lost = 0  # workers killed on a timeout or dead in a call, this call
        pending = deque(range(len(items)))
        rewards: dict[int, float] = {}
        errors: dict[int, str] = {}
        bad_values: dict[int, str] = {}
        timed_out: list[int] = []
        while True:
            now = time.monotonic()
            # a verifier that hangs or kills every worker (tolerating timeouts: more than allowed): stop
            hopeless = (len(timed_out) > timeouts_allowed or bool(errors)) if timeouts_allowed else \
                self._lost >= self.num_workers
            if not hopeless:
                for worker in self._workers:
                    if pending and worker.ready and worker.call is None:
                        i = pending.popleft()
                        text, task = items[i]
                        path = None if ref in worker.loaded else sys.path  # imports see the caller's path
                        try:
                            worker.conn.send((i, ref, text, task, path))
                        except OSError:  # it died while idle (e.g. with the thread that started it)
                            pending.appendleft(i)
                            self._replace(worker)
                            continue
                        worker.call = i
                        worker.deadline = now + (timeout_s if ref in worker.loaded else LOAD_TIMEOUT_S)
            busy = [w for w in self._workers if w.call is not None]
            if not busy and (not pending or hopeless):
                break
            waiting = [w for w in self._workers if w.call is not None or not w.ready]
            next_deadline = min(w.deadline if w.call is not None else w.started + LOAD_TIMEOUT_S for w in waiting)
            timeout = max(0.0, next_deadline - time.monotonic())
            readable = wait([w.conn for w in waiting], timeout=timeout if cancel is None else min(timeout, CANCEL_POLL_S))
            if cancel is not None and cancel.is_set():
                raise ScoringCancelled(f"scoring of {len(items)} completions cancelled")
            now = time.monotonic()
            for worker in [w for w in waiting if w.conn in readable]:
                try:
                    message = worker.conn.recv()
                except (EOFError, OSError):
                    self._worker_died(worker, items, errors)
                    continue
                kind, i = message[0], message[1]
                if kind == "ready":
                    worker.ready = True
                elif kind == "loaded":
                    worker.loaded.add(ref)
                    worker.deadline = now + timeout_s
                elif now > worker.deadline:  # answered, but after its timeout
                    timed_out.append(i)
                    worker.call = None
                else:
                    if kind == "done":
                        rewards[i] = message[2]
                    elif kind == "bad_value":
                        bad_values[i] = message[2]
                    else:
                        errors[i] = f"{message[2]} on task {items[i][1].task_id}"
                    worker.call = None
            for worker in list(self._workers):
                overdue = now > (worker.deadline if worker.call is not None else worker.started + LOAD_TIMEOUT_S)
                if overdue and worker.call is not None:
                    if ref in worker.loaded:
                        timed_out.append(worker.call)
                    else:
                        errors[worker.call] = (f"reward function {ref} did not load within {LOAD_TIMEOUT_S:g} s "
                                               f"on task {items[worker.call][1].task_id}")
                    self._lost += 1
                    self._replace(worker)
                elif overdue and not worker.ready:
                    raise VerifierError(f"reward worker did not start within {LOAD_TIMEOUT_S:g} s")
        return rewards, bad_values, errors, timed_out, list(pending)

    def _worker_died(self, worker: _Worker, items: list, errors: dict[int, str]) -> None:
        code = worker.process.wait()
        if worker.call is not None:
            errors[worker.call] = f"reward worker died (exit code {code}) on task {items[worker.call][1].task_id}"
            self._lost += 1
        self._replace(worker)
        if worker.call is None and not worker.ready:
            raise VerifierError(f"reward worker exited with code {code} before it was ready")


def _rewards_or_error(ref: str, items: list, timeout_s: float, timeouts_allowed: int,
                     outcome: tuple) -> tuple[list[float], int]:
    """``(rewards, timeouts)`` of a pool call, or its error; ``outcome`` is what
    :meth:`RewardPool._run` returns: ``(rewards, bad_values, errors, timed_out, not_scored)``."""
    rewards, bad_values, errors, timed_out, not_scored = outcome
    if bad_values:  # the reward's own defect: reported before errors and timeouts
        first = min(bad_values)
        raise RewardValueError(
            f"reward function {ref} returned {bad_values[first]} on task {items[first][1].task_id} "
            f"({len(bad_values)} of {len(items)} completions); a reward must be a finite number: fix the reward function"
        )
    if not errors and not not_scored and len(timed_out) <= timeouts_allowed:
        zero = set(timed_out)
        return [0.0 if i in zero else rewards[i] for i in range(len(items))], len(timed_out)
    first_error = min(errors) if errors else None
    first_timeout = min(timed_out) if timed_out else None
    if first_error is not None and (first_timeout is None or first_error < first_timeout):
        first = errors[first_error]
    else:
        first = f"timed out after {timeout_s} s on task {items[first_timeout][1].task_id}"
    failed = len(errors) + len(timed_out) + len(not_scored)
    stuck = f", {len(not_scored)} not scored: every worker was stuck" if not_scored else ""
    if timeouts_allowed and errors and not_scored:  # the first error stopped the scheduling
        stuck = f", {len(not_scored)} not scored after the first error"
    if timeouts_allowed and not errors:
        stuck = f", more than the {timeouts_allowed} allowed" + (f"; {len(not_scored)} not scored" if not_scored else "")
    raise VerifierError(
        f"reward function failed on {failed} of {len(items)} completions ({len(timed_out)} timeouts{stuck}); first: {first}"
    )


_POOL: RewardPool | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> RewardPool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = RewardPool(REWARD_WORKERS)
            atexit.register(_POOL.close)
        return _POOL


def score(reward_fn: RewardFn | str, items: list[tuple[str, Task]], timeout_s: float | None = None) -> list[float]:
    """``[reward_fn(text, task) for text, task in items]``, run in the reward worker pool.

    Args:
        reward_fn: a module-level ``(completion_text, task) -> float`` or its
            ``"module:qualname"``.
        items: ``(completion text, task)`` pairs.
        timeout_s: per call, counted from the moment a worker starts it; defaults to the
            module's :data:`REWARD_TIMEOUT_S` as it is at call time. A call past it is
            killed with its worker (which is replaced), whatever the call is doing.
    Returns:
        One float per item, in order.
    Raises:
        ValueError: ``reward_fn`` cannot be imported by name in a worker.
        RewardValueError: a call returned a value that is not a finite real number (see
            :func:`finite_reward`); the message names the first such task (in item order)
            and the value. A :class:`VerifierError` and a ``ConfigError`` (exit 2).
        VerifierError: any call raised, took longer than ``timeout_s`` seconds or lost its
            worker; the message counts errors, timeouts and calls not scored, and quotes
            the first (in item order).
    """
    if timeout_s is None:
        timeout_s = REWARD_TIMEOUT_S
    if not items:
        return []
    return _pool().score(reward_fn, items, timeout_s)[0]


def score_tolerating_timeouts(reward_fn: RewardFn | str, items: list[tuple[str, Task]], max_timeout_share: float,
                              timeout_s: float | None = None,
                              cancel: threading.Event | None = None) -> tuple[list[float], int]:
    """As :func:`score`, but a call that times out scores 0.0 and is counted (the
    reference's rule: module docstring), unless more than ``max_timeout_share`` of
    ``items`` time out. Setting ``cancel`` (from another thread) stops the call within
    :data:`CANCEL_POLL_S` seconds, killing the calls in progress.

    Returns:
        ``(rewards in item order, number of calls that timed out)``.
    Raises:
        RewardValueError: as :func:`score`.
        VerifierError: a call raised or lost its worker, or more than
            ``floor(max_timeout_share * len(items))`` calls timed out (``max_timeout_share``
            0: any timeout, as :func:`score`).
        ScoringCancelled: ``cancel`` was set.
    """
    if timeout_s is None:
        timeout_s = REWARD_TIMEOUT_S
    if not items:
        return [], 0
    return _pool().score(reward_fn, items, timeout_s, math.floor(max_timeout_share * len(items)), cancel)
