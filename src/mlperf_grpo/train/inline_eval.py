"""Inline evaluation during training: what ``DEFERRED_OFFLINE_EVAL=0`` selects.

The reference launcher's switch: ``1`` (our default) trains with deferred checkpoints
and evaluates them afterwards (:mod:`mlperf_grpo.evaluate.offline`); ``0`` evaluates the
policy in the training process after every step from the first eval step on, so
evaluation time counts toward time-to-train and ``run_stop`` carries the passing
evaluation's end time. No checkpoints are written. The same validator, results files
and log events as the offline evaluator are used::

    train step N >= S0 -> refit engine <- policy -> validate (pass@k) -> eval/step_N.jsonl
        -> eval_start, eval_accuracy, eval_stop (+ run_stop success at the eval's end)
    no pass by max_steps -> run_stop aborted at the last eval's end
"""

from __future__ import annotations

import torch
from mlperf_logging.mllog import constants as C  # noqa: N812

from mlperf_grpo import rules
from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.config.rundir import RunDir
from mlperf_grpo.evaluate import outcome
from mlperf_grpo.evaluate.commit import write_results
from mlperf_grpo.evaluate.offline import EvalOutcome, read_outcome, write_summary
from mlperf_grpo.evaluate.outcome import Evaluation
from mlperf_grpo.evaluate.series import EvaluationError
from mlperf_grpo.evaluate.validator import validate_suite
from mlperf_grpo.inference.base import SamplingParams
from mlperf_grpo.inference.factory import build_engine
from mlperf_grpo.logs.mllog import MLLogWriter, now_ms, read_log
from mlperf_grpo.tasks import ValidationSet
from mlperf_grpo.train.inputs import TrainingInputs


class InlineEvaluator:
    """``inline_eval`` hook of :func:`mlperf_grpo.train.trainer.train`
    (:class:`~mlperf_grpo.train.outputs.InlineEval`).

    Args:
        config: the run config (validation settings, GBS, target).
        run: the run directory (``eval/step_N.jsonl`` results go there).
        mllog_file: the run's MLPerf log (the trainer's file; lines are appended).
        validation: the task suite and validation tasks the trainer's inputs loaded.
    """

    def __init__(self, config: RunConfig, run: RunDir, mllog_file, validation: ValidationSet) -> None:
        self.config = config
        self.run = run
        self.writer = MLLogWriter(mllog_file)
        self.suite, self.tasks = validation.suite, validation.tasks
        v = config.validation
        self.params = SamplingParams(v.temperature, v.top_p, config.grpo.max_new_tokens)
        self.engine = build_engine(config, batch_size=v.batch_size)
        self.last_step: int | None = None
        self.last_stop_ms: int | None = None

    def __call__(self, step: int, policy: torch.nn.Module) -> bool:
        """Validate the current policy as step ``step``; True when it passed (run_stop logged)."""
        v, gbs = self.config.validation, self.config.global_batch_size
        start_ms = now_ms()
        self.engine.load_weights(policy.state_dict())  # refit
        accuracy, results = validate_suite(self.engine, self.suite, self.tasks, v.generations_per_task, self.params,
                                           self.config.seed, self.config.agent)
        stop_ms = now_ms()
        write_results(self.run, step, results, self.params, seed=self.config.seed, engine=self.engine.describe())
        self.last_step, self.last_stop_ms = step, stop_ms
        return outcome.commit_inline_evaluation(self.writer, Evaluation(step, accuracy, start_ms, stop_ms), gbs, v.target_accuracy)

    def finish(self) -> None:
        """After training: ``run_stop`` aborted at the last evaluation's end, when none passed."""
        if self.last_step is None:
            return
        gbs = self.config.global_batch_size
        outcome.log_aborted_run_stop(self.writer, self.last_step, rules.samples_count(self.last_step, gbs), self.last_stop_ms)
        self.writer.commit()


def train_with_inline_eval(config: RunConfig, run: RunDir, config_filename: str, inputs: TrainingInputs) -> EvalOutcome:
    """Train with :class:`InlineEvaluator`; returns the outcome read back from the log.
    ``inputs``: the caller's checked :class:`~mlperf_grpo.train.inputs.TrainingInputs`
    (``check_layout`` and ``check_training_inputs``); its suite and validation tasks are
    the evaluator's too.

    Raises:
        EvaluationError: training ended before the first eval step (nothing evaluated).
        The errors of :func:`mlperf_grpo.train.trainer.train`.
    """
    from mlperf_grpo.train.trainer import train

    evaluator: InlineEvaluator | None = None

    def inline_eval(step: int, policy: torch.nn.Module) -> bool:
        nonlocal evaluator
        if evaluator is None:  # built lazily: the trainer creates the run directory and log
            evaluator = InlineEvaluator(config, run, run.load()[1], inputs.validation_set)
        return evaluator(step, policy)

    try:
        train(config, run, config_filename, inline_eval=inline_eval, inputs=inputs)
    finally:
        if evaluator is not None:
            evaluator.engine.close()
    _, mllog_file = run.load()
    if not read_log(mllog_file).find(C.RUN_STOP):
        if evaluator is None:
            raise EvaluationError(f"grpo.max_steps {config.grpo.max_steps} ends before the first eval step {config.first_eval_step}")
        evaluator.finish()
    outcome = read_outcome(run, mllog_file)
    write_summary(run, outcome)
    return outcome
