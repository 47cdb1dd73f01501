"""What one rank writes of a training run, as objects: the trainer calls each the same
way on every rank and in every mode, and the objects differ, not the loop.

=================  ==============================  =====================================
                   rank 0 (the writer)             other ranks
=================  ==============================  =====================================
run directory      :class:`RunOutput`              :class:`NoRunOutput`
MLPerf log         ``MLLogWriter``                 ``DiscardingLogWriter``
checkpoints        :class:`DeferredCheckpoints`    its share (:class:`DeferredCheckpoints`)
stop request       :class:`StopRequests` (reads)   :class:`StopRequests` (receives)
=================  ==============================  =====================================

With inline evaluation (``DEFERRED_OFFLINE_EVAL=0``, one process) the checkpoints are
:class:`NoCheckpoints`, the stop requests :class:`NoStopRequests` and the after-step
evaluation the caller's :class:`InlineEval`; otherwise the evaluation is
:class:`NoInlineEval`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch
from mlperf_logging.mllog import constants as C  # noqa: N812

from mlperf_grpo import rules
from mlperf_grpo.checkpoint import (
    AsyncCheckpointer,
    CheckpointTiming,
    RankGroup,
    TrainingInfo,
    engine_checkpoint_weights,
)
from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.config.rundir import RunDir, RunDirError, RunLock
from mlperf_grpo.evaluate.outcome import log_aborted_run_stop
from mlperf_grpo.graceful_stop import GracefulStop
from mlperf_grpo.inference.base import InferenceEngine
from mlperf_grpo.logs.mllog import DiscardingLogWriter, MLLogWriter, read_log
from mlperf_grpo.model.files import DTYPES, check_model_path
from mlperf_grpo.model.fingerprint import canary_logits_in_dtype
from mlperf_grpo.train import collectives, ranks


class Checkpoints(Protocol):
    """The deferred checkpoints of a run (:class:`DeferredCheckpoints`, :class:`NoCheckpoints`)."""

    published_steps: list[int]
    timings: dict[int, CheckpointTiming]

    def prepare(self) -> None: ...
    def raise_if_failed(self) -> None: ...
    def save(self, step: int, weight_update_time_ms: int, stopper: GracefulStop) -> None: ...
    def finish(self, reason: str, raise_error: bool = True) -> None: ...


class NoCheckpoints:
    """:class:`Checkpoints` that writes nothing: a rank other than 0, or inline evaluation."""

    def __init__(self) -> None:
        self.published_steps: list[int] = []
        self.timings: dict[int, CheckpointTiming] = {}

    def prepare(self) -> None:
        """Nothing to stage."""

    def raise_if_failed(self) -> None:
        """No write can fail."""

    def save(self, step: int, weight_update_time_ms: int, stopper: GracefulStop) -> None:
        """Write nothing."""

    def finish(self, reason: str, raise_error: bool = True) -> None:
        """Nothing in flight."""


class DeferredCheckpoints:
    """The run's ``checkpoints/step_N/`` (an :class:`~mlperf_grpo.checkpoint.AsyncCheckpointer`):
    the rollout-dtype weights of each step from the first eval step on, written in the
    background; under torchrun every rank stages and writes the tensors it owns and rank 0
    publishes the step (:class:`~mlperf_grpo.checkpoint.RankGroup`). The non-weight files are snapshotted (and fingerprinted) when this is made,
    at training start.

    Args:
        config: the run config (``checkpoint.max_in_flight``, ``model.dtype``, GBS).
        checkpoint_root: the run's ``checkpoints/`` (every rank writes its shards there).
        log: the run's log; ``log.sync`` runs before each publish, so a ``step_N/`` never
            outlives its step's log lines.
        engine, policy: where the weights come from (:func:`rollout_weights`).
        evaluation: the evaluation settings recorded in each ``training_info.json``.
    """

    def __init__(self, config: RunConfig, checkpoint_root: Path, log: MLLogWriter | DiscardingLogWriter,
                 engine: InferenceEngine, policy: torch.nn.Module, evaluation: dict[str, object]) -> None:
        self.config, self.engine, self.policy, self.evaluation = config, engine, policy, evaluation
        self.dtype = DTYPES[config.model.dtype]
        self.writer = AsyncCheckpointer(checkpoint_root, check_model_path(config.model.path),
                                        config.checkpoint.max_in_flight, before_publish=log.sync,
                                        group=RankGroup.of_process_group() if ranks.in_process_group() else None)

    @property
    def published_steps(self) -> list[int]:
        """Steps whose ``step_N/`` is published, ascending."""
        return self.writer.published_steps

    @property
    def timings(self) -> dict[int, CheckpointTiming]:
        """Each saved step's :class:`~mlperf_grpo.checkpoint.CheckpointTiming`."""
        return self.writer.timings

    def prepare(self) -> None:
        """The host staging buffers, off the clock (before ``run_start``)."""
        self.writer.prepare(rollout_weights(self.engine, self.policy, self.dtype))

    def raise_if_failed(self) -> None:
        """A failed background write stops training here (CheckpointWriteError)."""
        self.writer.raise_if_failed()

    def save(self, step: int, weight_update_time_ms: int, stopper: GracefulStop) -> None:
        """Stage step ``step``'s weights (the engine holds them: refit already) and write
        them in the background; a SIGTERM meanwhile waits for the staging copy."""
        config, g, gbs = self.config, self.config.grpo, self.config.global_batch_size

        def info() -> TrainingInfo:  # called by save() while the weights are copied to the host
            return TrainingInfo(
                current_step=step,
                consumed_samples=step * g.num_prompts_per_step,
                training_step_end_time_ms=weight_update_time_ms,
                samples_count=rules.samples_count(step, gbs),
                global_batch_size=gbs,
                num_generations_per_prompt=g.num_generations_per_prompt,
                dtype=config.model.dtype,
                canary_logits=self.engine.canary_logits() if not self.engine.canary_is_log_softmax  # raw logits
                else canary_logits_in_dtype(self.policy, self.policy.config.vocab_size, self.dtype),
                evaluation=self.evaluation,
            )

        with stopper.deferred():
            self.writer.save(rollout_weights(self.engine, self.policy, self.dtype), info)

    def finish(self, reason: str, raise_error: bool = True) -> None:
        """Wait until every write is published; record ``reason`` (``training_end.json``)."""
        self.writer.finish(reason, raise_error=raise_error)


def rollout_weights(engine: InferenceEngine, policy: torch.nn.Module, dtype: torch.dtype):
    """The rollout-dtype weights a checkpoint stores: the engine's own tensors where it
    hands them out (the HF engine's, refit already, so nothing is cast on the clock; at
    T > 1 its group's full tensors one at a time: :func:`engine_checkpoint_weights`), else
    the (unsharded) policy's cast to ``dtype``."""
    held = engine_checkpoint_weights(engine)
    if held is not None:
        return held
    return {name: t.detach().to(dtype) for name, t in policy.state_dict().items()}


class StopRequests:
    """The following evaluator's stop request (``<run>/stop_training.json``, written by
    ``evaluate --follow --stop-training-at-pass`` at a pass), read by rank 0 at a step
    boundary and given to every rank, so all stop after the same step.

    Args:
        read: rank 0's reader (``RunDir.training_stop_request``); the other ranks' gives ``None``.
    """

    def __init__(self, read: Callable[[], dict | None]) -> None:
        self.read = read

    def __call__(self) -> dict | None:
        """Rank 0's request on every rank (a collective: every rank calls it), or ``None``."""
        return collectives.broadcast_object(self.read())


class NoStopRequests:
    """No stop request (inline evaluation decides the stop itself)."""

    def __call__(self) -> dict | None:
        """Never a request."""
        return None


class InlineEval(Protocol):
    """An evaluation after each step from the first eval step on
    (:class:`mlperf_grpo.train.inline_eval.InlineEvaluator`): called as ``(step, policy)``,
    True when the policy passed (it logged ``run_stop``) and training stops."""

    def __call__(self, step: int, policy: torch.nn.Module) -> bool: ...


class NoInlineEval:
    """:class:`InlineEval` of deferred evaluation: never stops training."""

    def __call__(self, step: int, policy: torch.nn.Module) -> bool:
        """Not evaluated here (the offline evaluator reads the checkpoints)."""
        return False


class RunOutput:
    """Rank 0's run directory: created after setup, its log, its checkpoints, and the
    trainer's own ``run_stop`` aborted.

    Args:
        run: the run directory.
        retain_checkpoints: recorded in ``run.json`` (``RunDir.retain_recorded``).
    """

    def __init__(self, run: RunDir, retain_checkpoints: bool = False) -> None:
        self.run, self.retain_checkpoints = run, retain_checkpoints
        self.root_existed = run.root.exists()

    @contextlib.contextmanager
    def reserved(self) -> Iterator[None]:
        """The directory made and locked for the duration.

        Raises:
            RunDirError: it cannot be made (RunLockedError: another process writes to it).
        """
        try:
            self.run.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RunDirError(f"cannot create run directory {self.run.root}: {err.strerror}") from None
        with RunLock(self.run.root, "trainer"):
            yield

    @contextlib.contextmanager
    def removed_on_failure(self) -> Iterator[None]:
        """A failure in the block (no line of the run was logged yet) leaves no trace: a
        directory this run made is removed when it holds nothing but ``.lock``."""
        try:
            yield
        except BaseException:
            if not self.root_existed:
                self.run.remove_if_unwritten()
            raise

    def create_log(self, config: RunConfig) -> MLLogWriter:
        """Write ``config.yaml`` and ``run.json``; the run's MLPerf log."""
        return MLLogWriter(self.run.create(config, retain_checkpoints=self.retain_checkpoints))

    def checkpoints(self, config: RunConfig, log: MLLogWriter, engine: InferenceEngine, policy: torch.nn.Module,
                    evaluation: dict[str, object]) -> DeferredCheckpoints:
        """The run's :class:`DeferredCheckpoints`."""
        return DeferredCheckpoints(config, self.run.checkpoints, log, engine, policy, evaluation)

    def stop_requests(self) -> StopRequests:
        """Reads ``stop_training.json`` and gives it to every rank."""
        return StopRequests(self.run.training_stop_request)

    def close_aborted(self, log: MLLogWriter, step: int, samples_count: int, time_ms: int) -> None:
        """After training stopped on an error or signal: ``run_stop`` aborted at ``step``
        (its block_stop time ``time_ms``), unless a checkpoint is published (the run's
        result is then the offline evaluator's, however training ended) or the log has
        a ``run_stop`` already (inline evaluation's)."""
        if not self.run.published_steps() and not read_log(log.path).find(C.RUN_STOP):
            log_aborted_run_stop(log, step, samples_count, time_ms)
            log.commit()


class NoRunOutput:
    """:class:`RunOutput` of a rank other than 0: writes no log or run file, only its
    share of each checkpoint (rank 0 publishes it), and receives rank 0's stop requests.

    Args:
        checkpoint_root: the run's ``checkpoints/``; ``None``: write no checkpoint
            (:class:`NoCheckpoints`).
    """

    def __init__(self, checkpoint_root: Path | None = None) -> None:
        self.checkpoint_root = checkpoint_root

    @contextlib.contextmanager
    def reserved(self) -> Iterator[None]:
        """Nothing to make."""
        yield

    @contextlib.contextmanager
    def removed_on_failure(self) -> Iterator[None]:
        """Nothing to remove."""
        yield

    def create_log(self, config: RunConfig) -> DiscardingLogWriter:
        """A log that writes nothing."""
        return DiscardingLogWriter()

    def checkpoints(self, config: RunConfig, log: DiscardingLogWriter, engine: InferenceEngine,
                    policy: torch.nn.Module, evaluation: dict[str, object]) -> Checkpoints:
        """This rank's share of the run's :class:`DeferredCheckpoints`."""
        if self.checkpoint_root is None:
            return NoCheckpoints()
        return DeferredCheckpoints(config, self.checkpoint_root, log, engine, policy, evaluation)

    def stop_requests(self) -> StopRequests:
        """Receives rank 0's request."""
        return StopRequests(lambda: None)

    def close_aborted(self, log: DiscardingLogWriter, step: int, samples_count: int, time_ms: int) -> None:
        """Rank 0 closes the run."""
