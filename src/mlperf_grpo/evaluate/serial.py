"""Serial evaluation: one engine in this process evaluates a plan's checkpoints and the
results are committed in step order as each one is in. Used by the offline evaluator
with one worker (``evaluate/offline.py``) and by each round of a follower
(``evaluate/follow.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from mlperf_grpo.checkpoint import Checkpoint
from mlperf_grpo.evaluate.commit import EvalPlan, StepOrderCommitter
from mlperf_grpo.evaluate.launch import local_queue
from mlperf_grpo.evaluate.series import EvalJob
from mlperf_grpo.evaluate.worker import evaluate_claimed
from mlperf_grpo.inference.base import InferenceEngine


def evaluate_serially(job: EvalJob, log_file: Path, plan: EvalPlan, checkpoints: dict[int, Checkpoint],
                      engine: Callable[[], InferenceEngine], show_progress: bool) -> None:
    """Evaluate ``plan.pending_steps`` in step order with ``engine()`` (called once, after
    the first claim) and commit each result to ``log_file`` as it is in, up to the run's
    decision (:class:`~mlperf_grpo.evaluate.commit.StepOrderCommitter`). The engine is the
    caller's to close.

    Raises:
        EvaluationError, RefitError, VerifierError: as the committer (earlier results
            are committed).
    """
    queue = local_queue(len(plan.pending_steps))
    committer = StepOrderCommitter(job.run, job.config, log_file, plan, checkpoints, queue, show_progress)
    try:
        evaluate_claimed(queue, job, checkpoints, plan, engine, after_each=lambda: committer.advance(block=False))
        committer.advance(block=True)
    finally:
        committer.close()
