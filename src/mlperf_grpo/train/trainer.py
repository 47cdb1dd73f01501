"""The GRPO trainer: a fixed lifecycle, the same code on 1 or N ranks.

Reads top to bottom like the run it makes (:func:`train`, :class:`Trainer`)::

    check inputs (once; the CLI's, when it passes them) -> setup: policy, engine, optimizer
    rank 0: create the run directory -> init_start ... init_stop -> run_start
    for step in 1..max_steps:
        train_step:
            block_start
            take scored rollouts (age 1: generated and scored while the previous step trained;
                train/async_rollout.py, train/step_rewards.py)
            advantages; loss over micro-batches; clip; optimizer.step() -> weight-update time
            refit engine <- policy (after the generation in flight)
            block_stop
        after_step (from the first eval step on):
            checkpoint: stage the weights; step_N/ is written in the background
            inline evaluation (DEFERRED_OFFLINE_EVAL=0): stop at a pass
            stop request (stop_training.json, a following evaluator's pass): stop
    training's end: wait until every checkpoint is published (checkpoints/training_end.json)
    close: the engine
    no run_stop: the offline evaluator writes it

What differs between ranks and modes is an object (:mod:`mlperf_grpo.train.outputs`:
a log, checkpoints, stop requests and an inline evaluation that write or do nothing),
never a test in the loop. The model, tokenizer and device are checked, and the model
loaded, before the run directory is made, so a setup failure leaves no half-made run.
How training ends early (SIGTERM, Ctrl-C, an error, a failed checkpoint write) decides
who closes the run (the checkpoints in flight are published first):

    a checkpoint is published -> no run_stop here: the run's result belongs to the
                                 offline evaluator, which evaluates the published series
    none is published         -> run_stop aborted at the last trained step (the time of
                                 its block_stop; run_start's when no step finished)
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch
from mlperf_logging.mllog import constants as C  # noqa: N812
from tqdm import tqdm

from mlperf_grpo.agent.suite import AgentRunner
from mlperf_grpo.checkpoint import CheckpointTiming
from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.config.rundir import RunDir
from mlperf_grpo.errors import ConfigError
from mlperf_grpo.evaluate.settings import evaluation_settings
from mlperf_grpo.graceful_stop import GracefulStop
from mlperf_grpo.inference.base import InferenceEngine, SamplingParams
from mlperf_grpo.inference.factory import build_engine
from mlperf_grpo.inference.tensor_parallel import rank_share
from mlperf_grpo.logs.mllog import now_ms
from mlperf_grpo.model.compile import compile_decoder_layers, compile_policy_layers
from mlperf_grpo.model.files import DTYPES
from mlperf_grpo.model.load import load_model
from mlperf_grpo.train import collectives, ranks
from mlperf_grpo.train.async_rollout import RolloutProducer, RolloutSettings
from mlperf_grpo.train.engine_setup import engine_from_policy
from mlperf_grpo.train.fsdp import load_sharded_policy, policy_weights
from mlperf_grpo.train.inputs import TrainingInputs, check_training_inputs
from mlperf_grpo.train.mlperf_events import log_hyperparameters, log_submission_and_init_start, log_tracked_stats
from mlperf_grpo.train.optimize import OptimizeSettings, optimize_step, training_batch
from mlperf_grpo.train.policy_probe import checked_settings
from mlperf_grpo.train.outputs import InlineEval, NoCheckpoints, NoInlineEval, NoRunOutput, NoStopRequests, RunOutput
from mlperf_grpo.train.rollout import PromptSampler, generate_rollouts
from mlperf_grpo.train.step_rewards import StepScorer
from mlperf_grpo.train.trajectories import agent_generator, is_agentic


@dataclass
class StepStats:
    """What one training step measured."""

    step: int
    reward_mean: float
    rollout_pass_rate: float
    """Fraction of prompts with at least one rewarded completion."""
    loss: float
    grad_norm: float
    weight_update_time_ms: int
    rollout_weights_version: int = 0
    """Optimizer steps applied to the weights that generated this step's rollouts
    (``step - 1`` when synchronous, ``step - 2`` with one-step-async from step 2)."""
    num_sequences_masked_by_is: int = 0
    """Sequences ``seq-mask-tis`` dropped from the loss."""
    reward_timeouts: int = 0
    """Completions (all ranks) whose verification timed out and scored 0
    (``grpo.max_reward_timeout_share``)."""
    entropy: float = 0.0
    """Token-mean entropy (nats) of the policy over the loss's tokens, before the update
    (:attr:`~mlperf_grpo.train.optimize.OptimizeResult.entropy_mean`)."""


@dataclass
class TrainResult:
    """Outcome of :func:`train`."""

    steps: list[StepStats] = field(default_factory=list)
    checkpoint_steps: list[int] = field(default_factory=list)
    """Steps whose checkpoint was published."""
    checkpoint_timings: list[CheckpointTiming] = field(default_factory=list)
    stop_request: dict | None = None
    """The evaluator's request training stopped at (``stop_training.json``, written by
    ``evaluate --follow --stop-training-at-pass`` at a pass); ``None``: not stopped by it."""


def train(
    config: RunConfig,
    run: RunDir,
    config_filename: str,
    show_progress: bool = True,
    inline_eval: InlineEval | None = None,
    retain_checkpoints: bool = False,
    inputs: TrainingInputs | None = None,
) -> TrainResult:
    """Run GRPO training with deferred checkpoints; see the module docstring.

    Args:
        config: the run config.
        run: the run directory (created here, after the model is checked and loaded).
        config_filename: logged as ``config_filename``.
        show_progress: draw a tqdm bar on stderr (rank 0).
        inline_eval: ``DEFERRED_OFFLINE_EVAL=0``: called as ``inline_eval(step, policy)``
            after each step from the first eval step on, instead of writing a deferred
            checkpoint; training stops when it returns True (it logged ``run_stop``).
        retain_checkpoints: recorded in ``run.json``: the evaluation keeps the checkpoints
            (``RunDir.retain_recorded``), however often it is resumed.
        inputs: the caller's :func:`~mlperf_grpo.train.inputs.check_training_inputs`
            (with :func:`~mlperf_grpo.train.ranks.check_layout`) of this config and
            output; ``None``: both are checked here.
    Raises:
        LayoutError: the config does not divide over the ranks (only when ``inputs`` is None).
        RunDirError: the output cannot be created or already holds a run (RunLockedError:
            another process writes to it).
        TaskError: the task data or entry point is unusable (before anything is written).
        ModelLoadError, LogWriteError, CheckpointWriteError, OSError: setup or I/O failed.
        Terminated, KeyboardInterrupt: SIGTERM or Ctrl-C.
        On a failure during setup nothing of the run is written (a run directory this call
        created is removed). On a failure after ``run_start``: ``run_stop`` aborted when no
        checkpoint is published yet, else no ``run_stop`` (the offline evaluator's).

    Under torchrun every rank calls this; rank 0 alone writes the run directory (see
    :mod:`mlperf_grpo.train.outputs`), the others train their share and return the steps' stats.
    """
    writer = ranks.is_writer()
    if inputs is None:
        ranks.check_layout(config, deferred=inline_eval is None)
        inputs = check_training_inputs(config, run, check_output=writer)
    collectives.barrier()  # every rank has checked the output before rank 0 creates it
    output = RunOutput(run, retain_checkpoints) if writer else NoRunOutput(run.checkpoints)
    with output.reserved(), GracefulStop() as stopper:
        trainer = Trainer(config, inputs, output, stopper, config_filename, show_progress and writer, inline_eval)
        trainer.setup()
        try:
            return trainer.train()
        finally:
            trainer.close()


class Trainer:
    """One rank's training run: :meth:`setup`, :meth:`train` (each step
    :meth:`train_step` then :meth:`after_step`), :meth:`close`.

    Args:
        config: the run config.
        inputs: its checked task data (:class:`~mlperf_grpo.train.inputs.TrainingInputs`).
        output: what this rank writes (:class:`~mlperf_grpo.train.outputs.RunOutput` on
            rank 0, :class:`~mlperf_grpo.train.outputs.NoRunOutput` on the others).
        stopper: the SIGTERM handler; a checkpoint's staging copy defers it.
        config_filename: logged as ``config_filename``.
        show_progress: draw a tqdm bar on stderr.
        inline_eval: the after-step evaluation of ``DEFERRED_OFFLINE_EVAL=0``; ``None``:
            deferred checkpoints and the evaluator's stop requests instead.
    """

    def __init__(self, config: RunConfig, inputs: TrainingInputs, output: RunOutput | NoRunOutput,
                 stopper: GracefulStop, config_filename: str, show_progress: bool,
                 inline_eval: InlineEval | None) -> None:
        self.config, self.inputs, self.output, self.stopper = config, inputs, output, stopper
        self.config_filename, self.show_progress = config_filename, show_progress
        self.inline_eval = NoInlineEval() if inline_eval is None else inline_eval
        self.stop_requests = output.stop_requests() if inline_eval is None else NoStopRequests()
        self.inline = inline_eval is not None
        self.result = TrainResult()
        self.engine: InferenceEngine | None = None

    def setup(self) -> None:
        """Load the policy and the engine and make the optimizer; then (rank 0) create the
        run directory and its log. A failure leaves no trace of the run (see :func:`train`).
        """
        with self.output.removed_on_failure():
            self.init_start_ms = now_ms()  # init_start is logged with this time once the run exists
            config = self.config
            torch.manual_seed(config.seed)
            compiled, note = compile_policy_layers(config.model.compile, config.model.compile_policy, config.model.path)
            if note is not None and ranks.is_writer():
                print(f"mlperf-grpo: {note}", file=sys.stderr)
            fit = self.inputs.step_fit
            if fit.note() is not None and ranks.is_writer():
                print(f"mlperf-grpo: {fit.note()}", file=sys.stderr)
            self.policy, self.engine = policy_and_engine(config, compiled, fit.checkpointing, fit.kv_cache_bytes)
            self.optimizer = adamw(config, self.policy)
            self.sampler = PromptSampler(self.inputs.train_pool, config.seed, shuffle=not is_agentic(self.inputs.suite))
            settings = OptimizeSettings.of(config, compiled)
            self.settings, note = checked_settings(self.policy, settings, config.model.path)
            if note is not None and ranks.is_writer():
                print(f"mlperf-grpo: {note}", file=sys.stderr)
            self.log = self.output.create_log(config)

    def train(self) -> TrainResult:
        """``init_start`` ... ``run_start``, then every step until ``grpo.max_steps`` or a
        stop; waits for the checkpoints in flight. On an error or signal: what is in
        flight is published and (:meth:`RunOutput.close_aborted`) ``run_stop`` aborted
        written when nothing is, then the error is raised again.
        """
        self._start_run()
        try:
            for step in range(1, self.config.grpo.max_steps + 1):
                self.checkpoints.raise_if_failed()  # a failed background write stops training here
                stats = self.train_step(step)
                self.result.steps.append(stats)
                if self.after_step(stats):
                    break
            self.checkpoints.finish("finished" if self.result.stop_request is None else "stopped_by_evaluator")
            self.log.commit()  # durable: the whole log is on disk before training returns
            collectives.barrier()  # past every rank's last collective: see collectives.barrier
        except BaseException as err:
            self.stopper.stopping()  # a SIGTERM now (torchrun's, after another rank failed) waits for the publish
            self.checkpoints.finish(type(err).__name__, raise_error=False)  # publish what is in flight
            self.output.close_aborted(self.log, self.completed, self.completed * self.config.global_batch_size,
                                      self.completed_ms)
            raise
        finally:
            self.producer.close()  # waits for a generation in flight (with age 1)
            self.bar.close()
            self.result.checkpoint_steps = list(self.checkpoints.published_steps)
            self.result.checkpoint_timings = [self.checkpoints.timings[s] for s in sorted(self.checkpoints.timings)]
        return self.result

    def _start_run(self) -> None:
        """The log up to ``run_start``; the checkpoints, the rollout producer, the bar."""
        config, log, g = self.config, self.log, self.config.grpo
        log_submission_and_init_start(log, config, time_ms=self.init_start_ms)
        evaluation = evaluation_settings(config, self.inputs.validation)
        # the non-weight files are snapshotted (and fingerprinted) now, at training start
        self.checkpoints = NoCheckpoints() if self.inline else self.output.checkpoints(
            config, log, self.engine, self.policy, evaluation)
        self.checkpoints.prepare()  # host staging buffers, off the clock
        here = ranks.layout()
        log_hyperparameters(log, config, self.config_filename, here.world_size)
        log.end(C.INIT_STOP)
        run_start_ms = now_ms()
        log.start(C.RUN_START, time_ms=run_start_ms)
        log.commit()
        rollout_params = SamplingParams(g.rollout_temperature, g.rollout_top_p, g.max_new_tokens)
        settings = RolloutSettings(g.num_prompts_per_step, g.num_generations_per_prompt, rollout_params, config.seed,
                                   g.max_trajectory_age_steps, g.max_steps, self.inputs.step_fit.release_engine_memory)
        self.producer = RolloutProducer(
            self.engine, self.sampler, settings, config.model.device,
            prompt_share=ranks.prompt_share(g.num_prompts_per_step, here, self.engine.tp_size),
            generate=agent_generator(AgentRunner(config.agent)) if is_agentic(self.inputs.suite) else generate_rollouts,
            score=StepScorer(self.inputs.suite.reward, g.max_reward_timeout_share, is_agentic(self.inputs.suite),
                             self.engine.tp_rank, self.engine.tp_size, g.num_generations_per_prompt),
        )
        self.bar = tqdm(total=g.max_steps, desc="train", unit="step", disable=not self.show_progress)
        self.completed, self.completed_ms = 0, run_start_ms  # the last trained step and its block_stop time

    def train_step(self, step: int) -> StepStats:
        """Step ``step``: rollouts, rewards, one optimizer step, the refit, its log lines."""
        log, g, gbs = self.log, self.config.grpo, self.config.global_batch_size
        log.start(C.BLOCK_START, metadata={C.SAMPLES_COUNT: (step - 1) * gbs, "step": step})
        log.commit(durable=False)  # no fsync on the clock: see mllog's module docstring
        step_start_s = time.perf_counter()
        rollouts = self.producer.take(step)  # with age 1, also starts generating and scoring step + 1
        mine = rank_share(len(rollouts.tasks), self.engine.tp_rank, self.engine.tp_size)  # T > 1: 1/T of the group's
        completions, rewards = rollouts.completions[mine], rollouts.rewards  # rewards [P/N, G] this rank's
        timeouts = int(collectives.all_reduce_sum([float(rollouts.reward_timeouts)])[0])  # the step's, every rank's
        batch = training_batch(completions, rewards, g, self.engine.tokenizer.pad_token_id,
                               self.engine.eos_token_ids)  # a group never spans ranks
        train_start_s = time.perf_counter()
        optimized = optimize_step(self.policy, self.optimizer, batch, self.settings)
        collectives.barrier()  # every rank's optimizer.step() has returned
        weight_update_time_ms = now_ms()  # right after optimizer.step() returned
        policy_training_s = time.perf_counter() - train_start_s
        # for the next rollouts; a sharded policy's parameters are gathered one at a time
        weight_sync_s = self.producer.refit(policy_weights(self.policy), weights_version=step)
        rewards = collectives.all_gather_rows(rewards)  # [P, G] the step's, for its stats
        block_stop_ms = now_ms()
        log.end(C.BLOCK_STOP, metadata={C.SAMPLES_COUNT: step * gbs, "step": step}, time_ms=block_stop_ms)
        log_tracked_stats(log, step, gbs, {  # commits the block_stop too
            "reduced_train_loss": optimized.loss, "reward": float(rewards.mean()), "grad_norm": optimized.grad_norm,
            "global_valid_toks": optimized.num_valid_tokens, "global_valid_seqs": optimized.num_valid_sequences,
            "train_step_time": time.perf_counter() - step_start_s, "policy_training_time": policy_training_s,
            "generation_time": rollouts.generation_s, "exposed_generation_time": rollouts.exposed_generation_s,
            "exposed_reward_time": rollouts.exposed_reward_s,
            "weight_sync_time": weight_sync_s, "rollout_weights_version": rollouts.weights_version,
            "num_sequences_masked_by_is": optimized.num_sequences_masked_by_is, "reward_timeouts": timeouts,
            "entropy": optimized.entropy_mean,
        })
        self.completed, self.completed_ms = step, block_stop_ms
        return StepStats(
            step=step,
            reward_mean=float(rewards.mean()),
            rollout_pass_rate=float((rewards > 0).any(dim=1).float().mean()),
            loss=optimized.loss,
            grad_norm=optimized.grad_norm,
            weight_update_time_ms=weight_update_time_ms,
            rollout_weights_version=rollouts.weights_version,
            num_sequences_masked_by_is=optimized.num_sequences_masked_by_is,
            reward_timeouts=timeouts,
            entropy=optimized.entropy_mean,
        )

    def after_step(self, stats: StepStats) -> bool:
        """From the first eval step on: the checkpoint, the inline evaluation, the stop
        request (a pass needs a published checkpoint: no request, and no collective,
        before). True: training stops after this step."""
        step = stats.step
        if step >= self.config.first_eval_step:
            self.checkpoints.save(step, stats.weight_update_time_ms, self.stopper)
        self.bar.set_postfix(reward=f"{stats.reward_mean:.3f}", acc=f"{stats.rollout_pass_rate:.3f}", refresh=False)
        self.bar.update(1)
        if step < self.config.first_eval_step:
            return False
        if self.inline_eval(step, self.policy):
            return True
        self.result.stop_request = self.stop_requests()  # a following evaluator passed: no step after this one
        return self.result.stop_request is not None

    def close(self) -> None:
        """Release the engine (its decoder's cache and graphs)."""
        if self.engine is not None:
            self.engine.close()


def policy_and_engine(config: RunConfig, compiled: bool, activation_checkpointing: bool = False,
                      kv_cache_bytes: int | None = None) -> tuple[torch.nn.Module, InferenceEngine]:
    """The fp32 policy and the rollout engine: under torchrun the policy built sharded
    (:func:`~mlperf_grpo.train.fsdp.load_sharded_policy`, compute in the rollout dtype on
    CUDA) and each rank's engine refit from it; else both loaded from the files. The
    policy only scores (the engine generates): no KV cache. ``activation_checkpointing``:
    each decoder layer recomputed in the backward (FSDP's ``checkpoint_wrapper`` under
    torchrun; in one process ``transformers``' own non-reentrant gradient checkpointing,
    which keeps the parameter names). ``kv_cache_bytes``: the most bytes the ``hf``
    engine's KV cache takes (the planner's, :mod:`~mlperf_grpo.train.memory_fit`; None:
    the slot decoder's default).

    Raises:
        ModelLoadError: the model does not load.
    """
    if ranks.layout().distributed:
        compute_dtype = DTYPES[config.model.dtype] if config.model.device == "cuda" else None
        policy = load_sharded_policy(config.model.path, config.model.device, compute_dtype,
                                     activation_checkpointing, compile_layers=compiled,
                                     reshard_every_micro_batch=config.distributed.reshard_every_micro_batch)
        disable_dropout(policy)
        return policy, engine_from_policy(config, policy, kv_cache_bytes=kv_cache_bytes)
    policy = load_model(config.model.path, "float32", config.model.device)
    policy.config.use_cache = False
    disable_dropout(policy)
    if activation_checkpointing:
        checkpoint_layers(policy)
    if compiled:
        compile_decoder_layers(policy)
    return policy, build_engine(config, kv_cache_bytes=kv_cache_bytes)


def disable_dropout(policy: torch.nn.Module) -> None:
    """Every dropout of the policy set to 0: ``nn.Dropout``'s ``p``, the float
    ``*dropout*`` attributes modules pass to functional dropout and attention (``attention_dropout``,
    OPT's ``dropout``) and ``*layerdrop*`` (OPT, XGLM, BioGPT: a whole decoder layer
    skipped at random in training mode). The loss passes run in training mode (activation
    checkpointing needs it) and must score what the engine, in eval mode, sampled (as TRL's
    ``disable_dropout`` and NeMo-RL's dropout 0); other training-mode differences are
    refused (``policy_probe.training_mode_problem``)."""
    for module in policy.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if ("dropout" in name or "layerdrop" in name) and isinstance(value, float):
                setattr(module, name, 0.0)


def checkpoint_layers(policy: torch.nn.Module) -> None:
    """Recompute each decoder layer of an unsharded Hugging Face policy in its backward
    (``transformers``' non-reentrant activation checkpointing, in training mode only; the
    parameter names stay those of the files).

    Raises:
        ConfigError: the model's class does not support it (``supports_gradient_checkpointing``
            False, e.g. JetMoE): one line naming the fix, not ``transformers``' ValueError (exit 1).
    """
    if not getattr(policy, "supports_gradient_checkpointing", True):
        raise ConfigError(f"model.activation_checkpointing: {type(policy).__name__} does not support activation "
                          "checkpointing (transformers); set model.activation_checkpointing: off")
    enable = getattr(policy, "activation_checkpointing_enable", None)  # transformers >= 5.25
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def adamw(config: RunConfig, policy: torch.nn.Module) -> torch.optim.AdamW:
    """The config's AdamW over the policy's (fp32 master) parameters."""
    return torch.optim.AdamW(
        policy.parameters(),
        lr=config.learning_rate,
        betas=(config.optimizer.beta_1, config.optimizer.beta_2),
        eps=config.optimizer.epsilon,
        weight_decay=config.optimizer.weight_decay,
        # one kernel for the whole update on the bf16 CUDA path; the float32 paths keep the
        # foreach kernels their measured runs used (the CPU calibration, the GPU default run)
        fused=config.model.device == "cuda" and config.model.train_compute_dtype != "float32",
    )
