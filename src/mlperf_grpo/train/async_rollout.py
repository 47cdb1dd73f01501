"""The rollout producer: owns the generation engine, hands the trainer each step's rollouts.

``max_trajectory_age_steps: 0`` (synchronous): the rollouts of step N are generated when
step N asks for them, with the weights of step N-1.

``max_trajectory_age_steps: 1`` (one-step-async, the reference's ``async_grpo`` with
``in_flight_weight_updates: false``): as soon as step N has taken its rollouts, the
rollouts of step N+1 start generating on a background thread with the weights the engine
holds, while step N trains. The refit after step N waits for that generation to finish,
then loads the new weights (no weight update in flight); the rewards of step N+1 are
scored on a second thread while the refit runs (the reward calls read only the
completions' text)::

    step 1: generate(1, w0)  | take 1 | gen(2, w0) ........ | refit w1
    step 2:                    take 2 | gen(3, w1) || train 2 | refit w2
    step N trains on rollouts of w_{N-2} (age 1), step 1 on w0 (age 0)

Each :class:`Rollouts` records ``weights_version`` (optimizer steps applied to the weights
that generated it), so the trainer knows the age and applies the importance-sampling
correction (``train/grpo.py``). Prompts are drawn and seeds derived in step order on the
caller's thread, so a run is reproducible whatever the timing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from mlperf_grpo.inference.base import Completion, InferenceEngine, SamplingParams, Weights
from mlperf_grpo.tasks import Task
from mlperf_grpo.train.rollout import PromptSampler, generate_rollouts


@dataclass
class Rollouts:
    """The rollouts of one training step.

    ``completions``: ``[P][G]``. ``weights_version``: optimizer steps applied to the engine
    weights that generated them. ``generation_s``: seconds the engine spent on them.
    ``rewards`` and ``reward_timeouts``: what the producer's ``score`` returned (``None``
    and 0 without one). ``exposed_generation_s`` and ``exposed_reward_s``: seconds the
    trainer waited for the generation and then for the scoring (0 when they were ready).
    """

    step: int
    tasks: list[Task]
    completions: list[list[Completion]]
    weights_version: int
    generation_s: float
    exposed_generation_s: float = 0.0
    rewards: torch.Tensor | None = None
    reward_timeouts: int = 0
    exposed_reward_s: float = 0.0

    @property
    def age_steps(self) -> int:
        """How many optimizer steps older than the trainer's weights (``step - 1``) they are."""
        return self.step - 1 - self.weights_version


Scorer = Callable[[list[Task], list[list[Completion]], threading.Event], tuple[torch.Tensor, int]]
"""``(tasks, samples [P][G], cancel) -> (rewards, timeouts)``: a step's rewards, scored as
soon as its samples are generated; it stops (raising) soon after ``cancel`` is set."""


@dataclass(frozen=True)
class RolloutSettings:
    """What each step's rollouts are: ``num_prompts_per_step`` x
    ``num_generations_per_prompt`` completions sampled with ``params``, per-completion
    seeds derived from the run ``seed``, the step and the index; ``max_trajectory_age_steps``
    0 or 1; no rollouts generated for a step after ``max_steps``."""

    num_prompts_per_step: int
    num_generations_per_prompt: int
    params: SamplingParams
    seed: int
    max_trajectory_age_steps: int
    max_steps: int
    release_engine_memory: bool = False
    """Synchronous rollouts only: free the engine's KV cache and graphs once a step's
    rollouts are generated, so the policy trains in that memory (``train/memory_fit.py``);
    the next generation allocates them again."""


class RolloutProducer:
    """Generates each step's rollouts, one step ahead when ``max_trajectory_age_steps`` is 1.

    Only this object calls the engine (generation on its single worker thread, refit on
    the caller's); use it as a context manager so a pending generation is waited for.

    Args:
        engine: the generation engine, holding the weights of version 0.
        sampler: draws each step's prompts.
        settings: the batch shape, sampling parameters, seed, trajectory age and last
            step (:class:`RolloutSettings`).
        device: the engine's device; with ``cuda`` the background generation runs on
            its own CUDA stream (after the refit's copies on the default stream), so
            its kernels can overlap training's instead of queueing behind them.
        prompt_share: which of each step's ``num_prompts_per_step`` prompts this
            producer generates (a data-parallel rank's share; default all). Every
            producer draws the whole step's prompts, so the shares never overlap, and
            seeds follow the prompt's index in the step.
        generate: what makes a step's ``[P][G]`` samples (``generate_rollouts``'s
            signature): completions by default, agent trajectories for ``task.name: swe``
            (:func:`~mlperf_grpo.train.trajectories.agent_generator`).
        score: scores a step's samples (:data:`Scorer`) on the producer's scoring thread,
            so that with age 1 the rewards are ready when the trainer takes them; ``None``:
            no rewards in the :class:`Rollouts`.
    Raises:
        ValueError: ``max_trajectory_age_steps`` is not 0 or 1.
    """

    def __init__(self, engine: InferenceEngine, sampler: PromptSampler, settings: RolloutSettings, device: str = "cpu",
                 prompt_share: slice = slice(None), generate=generate_rollouts, score: Scorer | None = None) -> None:
        if settings.max_trajectory_age_steps not in (0, 1):
            raise ValueError(f"max_trajectory_age_steps must be 0 or 1, got {settings.max_trajectory_age_steps}")
        self._engine = engine
        self._sampler = sampler
        self._shape = (settings.num_prompts_per_step, settings.num_generations_per_prompt)
        self._params = settings.params
        self._seed = settings.seed
        self._max_age = settings.max_trajectory_age_steps
        self._max_steps = settings.max_steps
        self._release = settings.release_engine_memory and settings.max_trajectory_age_steps == 0
        self._weights_version = 0
        self._cuda = device == "cuda"
        self._share = prompt_share
        self._generate_fn = generate
        self._score_fn = score
        self._cancel = threading.Event()  # set by close(): a scoring in flight stops
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
        self._scoring = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
        self._pending: tuple[int, Future[Rollouts], Future[Rollouts]] | None = None  # step, generated, scored

    def __enter__(self) -> "RolloutProducer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def take(self, step: int) -> Rollouts:
        """The scored rollouts of ``step`` (waiting for them if in flight); then, with age 1,
        starts generating and scoring those of ``step + 1`` in the background.

        Raises:
            ValueError: steps are taken out of order.
            Whatever the engine raised while generating, or ``score`` while scoring.
        """
        start = time.perf_counter()
        if self._pending is not None:
            pending_step, generated, scored = self._pending
            if pending_step != step:
                raise ValueError(f"rollouts of step {pending_step} are in flight; step {step} was asked for")
            self._pending = None
            generated.result()
            generated_s = time.perf_counter()
            rollouts = scored.result()
        else:
            rollouts = self._generate(step, self._draw(), self._weights_version)
            if self._release:  # nothing generates until the next take: the policy may train in it
                self._engine.release_memory()
            generated_s = time.perf_counter()
            rollouts = self._score(rollouts)
        rollouts.exposed_generation_s = generated_s - start
        rollouts.exposed_reward_s = time.perf_counter() - generated_s
        if self._max_age == 1 and step < self._max_steps:
            nxt = step + 1
            generated = self._pool.submit(self._generate_on_side_stream, nxt, self._draw(), self._weights_version)
            self._pending = (nxt, generated, self._scoring.submit(lambda: self._score(generated.result())))
        return rollouts

    def refit(self, weights: Weights, weights_version: int) -> float:
        """Load the trainer's weights (after optimizer step ``weights_version``) into the
        engine through its one refit entry (``load_weights``); ``weights`` may be a
        sharded policy's parameters gathered one at a time
        (:func:`~mlperf_grpo.train.fsdp.policy_weights`).

        Waits for any generation in flight first (the reference's
        ``in_flight_weight_updates: false``), so it is not counted in the returned time;
        its scoring goes on.
        Returns:
            Seconds spent loading the weights (the weight-sync time).
        """
        if self._pending is not None:
            self._pending[1].result()
        start = time.perf_counter()
        self._engine.load_weights(weights)
        self._weights_version = weights_version
        return time.perf_counter() - start

    def close(self) -> None:
        """Wait for a generation in flight, stop a scoring in flight (their results are
        dropped), and stop the workers."""
        self._cancel.set()
        self._pending = None
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._scoring.shutdown(wait=True, cancel_futures=True)

    def _draw(self) -> list[Task]:
        return self._sampler.sample(self._shape[0])[self._share]

    def _generate_on_side_stream(self, step: int, tasks: list[Task], weights_version: int) -> Rollouts:
        if not self._cuda:
            return self._generate(step, tasks, weights_version)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.default_stream())  # the refit's weight copies come first
        with torch.cuda.stream(stream):
            rollouts = self._generate(step, tasks, weights_version)
        stream.synchronize()
        return rollouts

    def _generate(self, step: int, tasks: list[Task], weights_version: int) -> Rollouts:
        start = time.perf_counter()
        completions = self._generate_fn(
            self._engine, tasks, self._shape[1], self._params, self._seed, step, self._share.start or 0
        )
        return Rollouts(step, tasks, completions, weights_version, time.perf_counter() - start)

    def _score(self, rollouts: Rollouts) -> Rollouts:
        if self._score_fn is not None:
            rollouts.rewards, rollouts.reward_timeouts = self._score_fn(rollouts.tasks, rollouts.completions, self._cancel)
        return rollouts
