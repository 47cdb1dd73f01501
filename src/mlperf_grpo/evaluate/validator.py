"""Validate one set of weights: generate k completions per task, reward, pass@k."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

from mlperf_grpo import rules
from mlperf_grpo.inference.base import InferenceEngine, SamplingParams, derive_seed
from mlperf_grpo.tasks import Task


REWARD_TIMEOUT_S = 30.0
"""Seconds one reward call may take before it counts as a verifier error."""


class VerifierError(RuntimeError):
    """The reward function raised or timed out; the checkpoint's accuracy is unknown
    (an error is never counted as a wrong answer)."""


REWARD_WORKERS = 4
"""Reward calls run at once (in daemon threads)."""


def score(reward_fn, items: list, timeout_s: float | None = None) -> list[float]:
    """``[reward_fn(text, task) for text, task in items]`` in worker threads.

    ``timeout_s`` defaults to the module's ``REWARD_TIMEOUT_S`` as it is at call time and
    is counted from the moment each call starts. When every worker is stuck in a call past
    its timeout, the calls not yet started are not scored and the scoring stops at once
    (a hung verifier fails in seconds, not ``len(items) * timeout_s``); the workers are
    daemon threads, so a call that never returns does not keep the process alive.

    Raises:
        VerifierError: any call raised or took longer than ``timeout_s`` seconds; the
            message counts errors, timeouts and calls not scored, and quotes the first.
    """
    if timeout_s is None:
        timeout_s = REWARD_TIMEOUT_S
    pending = queue.SimpleQueue()
    for i in range(len(items)):
        pending.put(i)
    started: dict[int, float] = {}
    finished: dict[int, tuple[bool, object, float]] = {}  # i -> (ok, reward or exception, seconds)
    changed = threading.Condition()

    def work() -> None:
        while True:
            try:
                i = pending.get_nowait()
            except queue.Empty:
                return
            with changed:
                started[i] = t0 = time.monotonic()
            text, task = items[i]
            try:
                ok, out = True, float(reward_fn(text, task))
            except Exception as err:  # noqa: BLE001  (any verifier failure is reported, not scored)
                ok, out = False, err
            with changed:
                finished[i] = (ok, out, time.monotonic() - t0)
                changed.notify_all()

    workers = [threading.Thread(target=work, name=f"reward-{n}", daemon=True) for n in range(min(REWARD_WORKERS, len(items)))]
    for w in workers:
        w.start()
    with changed:
        while len(finished) < len(items):
            now = time.monotonic()
            overdue = sum(1 for i, t in started.items() if i not in finished and now - t > timeout_s)
            if overdue == len(workers) or len(finished) + overdue == len(items):
                break
            changed.wait(timeout=min(0.05, timeout_s))
        done, began = dict(finished), set(started)  # a snapshot; late calls change nothing
    while True:  # calls never started are dropped
        try:
            pending.get_nowait()
        except queue.Empty:
            break
    errors, timeouts, skipped, first = 0, 0, 0, ""
    rewards: list[float] = []
    for i, (text, task) in enumerate(items):
        ok, out, seconds = done.get(i, (False, None, float("inf")))
        if ok and seconds <= timeout_s:
            rewards.append(out)
        elif i in done and not ok:
            errors += 1
            first = first or f"{type(out).__name__}: {out} on task {task.task_id}"
        elif i in began:  # still running, or returned after its timeout
            timeouts += 1
            first = first or f"timed out after {timeout_s} s on task {task.task_id}"
        else:
            skipped += 1
    if errors or timeouts or skipped:
        not_scored = f", {skipped} not scored: every worker was stuck" if skipped else ""
        raise VerifierError(
            f"reward function failed on {errors + timeouts + skipped} of {len(items)} completions "
            f"({timeouts} timeouts{not_scored}); first: {first}"
        )
    return rewards


@dataclass(frozen=True)
class TaskResult:
    """One validation task's ``k`` completions and rewards."""

    task_id: str
    prompt: str
    answer: str
    completions: list[str]
    rewards: list[float]

    @property
    def passed(self) -> bool:
        return any(r > 0 for r in self.rewards)


def validate(
    engine: InferenceEngine,
    tasks: list[Task],
    reward_fn,
    generations_per_task: int,
    params: SamplingParams,
    seed: int,
) -> tuple[float, list[TaskResult]]:
    """pass@k of the engine's current weights over ``tasks``.

    Args:
        engine: already refit with the weights to validate.
        tasks: the validation tasks (``eval_samples`` of them).
        reward_fn: ``(completion_text, task) -> float``; a reward > 0 is a pass.
        generations_per_task: k.
        params: validation sampling (temperature 0.1, top_p 0.95 in the rules).
        seed: generation ``j`` of a task uses ``derive_seed("validation", seed, task_id, j)``,
            so re-validating the same weights gives the same completions.
    Returns:
        ``(accuracy, per-task results)``; accuracy = mean over tasks of any reward > 0.
    Raises:
        VerifierError: a reward call raised or timed out (no accuracy is computed).
    """
    k = generations_per_task
    flat_tasks = [t for t in tasks for _ in range(k)]
    seeds = [derive_seed("validation", seed, t.task_id, j) for t in tasks for j in range(k)]
    completions = engine.generate([t.prompt for t in flat_tasks], params, seeds)
    rewards = score(reward_fn, [(c.text, t) for c, t in zip(completions, flat_tasks)])
    results = []
    for i, task in enumerate(tasks):
        texts = [c.text for c in completions[i * k:(i + 1) * k]]
        results.append(TaskResult(task.task_id, task.prompt, task.answer, texts, rewards[i * k:(i + 1) * k]))
    return rules.pass_at_k([r.rewards for r in results]), results
