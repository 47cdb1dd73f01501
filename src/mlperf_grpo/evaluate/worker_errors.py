"""The errors a worker publishes as a result and its peers raise again by name (the
committer in step order, the group watch to tell a worker's error from a peer's death)."""

from __future__ import annotations

from mlperf_grpo.errors import EvaluationError
from mlperf_grpo.evaluate.series import RefitError
from mlperf_grpo.tasks.scoring import RewardValueError, VerifierError


class RankFailedError(RuntimeError):
    """A rank other than 0 failed (its message names it); the evaluation stops."""


WORKER_ERRORS: dict[str, type[Exception]] = {"EvaluationError": EvaluationError, "RefitError": RefitError,
                                             "VerifierError": VerifierError, "RewardValueError": RewardValueError,
                                             "RankFailedError": RankFailedError}
"""The errors a worker reports as a result (raised again, in step order, by the committer)."""
