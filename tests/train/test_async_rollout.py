"""The rollout producer: which weights generate which step, and overlap with training."""

import threading
import time

import pytest
import torch

from mlperf_grpo.inference.base import Completion, SamplingParams
from mlperf_grpo.tasks import arithmetic
from mlperf_grpo.train.async_rollout import RolloutProducer, RolloutSettings
from mlperf_grpo.train.rollout import PromptSampler

PARAMS = SamplingParams(1.0, 1.0, 4)


class FakeEngine:
    """Records the weights it held for each generate call; can block a call until released."""

    def __init__(self) -> None:
        self.weights = "w0"
        self.calls: list[tuple[str, str, int]] = []  # (weights, thread name, number of prompts)
        self.block_calls_after = None  # generate call index from which to wait for `release`
        self.release = threading.Event()
        self.entered = threading.Event()

    def load_weights(self, state_dict):
        self.weights = state_dict["name"]

    def generate(self, prompts, params, seeds):
        index = len(self.calls)
        self.calls.append((self.weights, threading.current_thread().name, len(prompts)))
        if self.block_calls_after is not None and index >= self.block_calls_after:
            self.entered.set()
            assert self.release.wait(timeout=60), "the trainer never released the generation"
        return [Completion([1], [2], [-0.5], str(s)) for s in seeds]


def _producer(engine, age, max_steps=4, score=None):
    sampler = PromptSampler(arithmetic.train_tasks(32, 251, seed=1), seed=1)
    return RolloutProducer(engine, sampler, RolloutSettings(2, 3, PARAMS, seed=7, max_trajectory_age_steps=age,
                                                            max_steps=max_steps), score=score)


class Scorer:
    """Scores a step as the number of its completions; records its thread; can block from
    a call index on until released, or raise."""

    def __init__(self, block_calls_after=None, fail_calls_after=None) -> None:
        self.threads: list[str] = []
        self.block_calls_after, self.fail_calls_after = block_calls_after, fail_calls_after
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, tasks, samples, cancel):
        index = len(self.threads)
        self.threads.append(threading.current_thread().name)
        if self.fail_calls_after is not None and index >= self.fail_calls_after:
            raise RuntimeError("verifier died")
        if self.block_calls_after is not None and index >= self.block_calls_after:
            self.entered.set()
            assert self.release.wait(timeout=60), "the trainer never released the scoring"
        return torch.full((len(tasks), len(samples[0])), float(index)), index


def _run(age, max_steps=4):
    engine = FakeEngine()
    versions, texts = [], []
    with _producer(engine, age, max_steps) as producer:
        for step in range(1, max_steps + 1):
            rollouts = producer.take(step)
            versions.append((rollouts.weights_version, rollouts.age_steps))
            texts.append([c.text for group in rollouts.completions for c in group])
            producer.refit({"name": f"w{step}"}, weights_version=step)
    return engine, versions, texts


def test_synchronous_step_n_uses_the_weights_of_step_n_minus_1():
    engine, versions, _ = _run(age=0)
    assert versions == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert [w for w, _, _ in engine.calls] == ["w0", "w1", "w2", "w3"]


def test_one_step_async_step_n_uses_the_weights_of_step_n_minus_2():
    engine, versions, _ = _run(age=1)
    # step 1 on w0 (age 0), then each step on the weights one step older than the trainer's
    assert versions == [(0, 0), (0, 1), (1, 1), (2, 1)]
    assert [w for w, _, _ in engine.calls] == ["w0", "w0", "w1", "w2"]
    assert all(name.startswith("rollout") for _, name, _ in engine.calls[1:])  # background thread
    assert len(engine.calls) == 4  # nothing generated past max_steps


def test_prompts_and_seeds_do_not_depend_on_the_mode():
    _, _, sync = _run(age=0)
    _, _, async_ = _run(age=1)
    assert sync == async_  # same prompts drawn in step order, same per-completion seeds


def test_generation_of_the_next_step_overlaps_training():
    engine = FakeEngine()
    engine.block_calls_after = 1  # step 2's generation waits until "training" of step 1 releases it
    with _producer(engine, age=1) as producer:
        producer.take(1)
        # take(1) returned while step 2's rollouts are still being generated: the trainer
        # is free to train step 1 now.
        assert engine.entered.wait(timeout=60)
        engine.release.set()  # "training of step 1" done
        weights_before_refit = engine.weights
        producer.refit({"name": "w1"}, weights_version=1)  # waits for the generation first
        assert weights_before_refit == "w0"
        assert producer.take(2).weights_version == 0


def test_rewards_of_the_next_step_are_scored_while_the_step_trains_and_the_refit_does_not_wait_for_them():
    scorer = Scorer(block_calls_after=1)  # step 2's scoring waits until the test releases it
    with _producer(FakeEngine(), age=1, score=scorer) as producer:
        first = producer.take(1)
        assert first.rewards.tolist() == [[0.0] * 3] * 2 and first.reward_timeouts == 0
        assert scorer.entered.wait(timeout=60)  # step 2 scored with no call from the trainer
        producer.refit({"name": "w1"}, weights_version=1)  # returns while step 2's scoring is blocked
        scorer.release.set()
        second = producer.take(2)
        assert second.rewards.tolist() == [[1.0] * 3] * 2 and second.reward_timeouts == 1
        assert second.exposed_reward_s >= 0 and second.exposed_generation_s >= 0
    assert scorer.threads[0] == "MainThread" and scorer.threads[1].startswith("reward")


def test_synchronous_rollouts_are_scored_before_take_returns():
    scorer = Scorer()
    with _producer(FakeEngine(), age=0, max_steps=2, score=scorer) as producer:
        assert producer.take(1).reward_timeouts == 0 and producer.take(2).reward_timeouts == 1
    assert scorer.threads == ["MainThread", "MainThread"]


def test_closing_cancels_a_scoring_in_flight_instead_of_waiting_for_it():
    """Before: close() waited for the background scoring to end: SIGTERM during a hanging
    reward's timeouts took 92 s (helper break11)."""
    calls, entered, cancelled = [], threading.Event(), []

    def score_until_cancelled(tasks, samples, cancel):
        calls.append(1)
        if len(calls) > 1:  # step 2's scoring, in the background
            entered.set()
            cancelled.append(cancel.wait(timeout=60))
            raise RuntimeError("cancelled")
        return torch.zeros(len(tasks), len(samples[0])), 0

    producer = _producer(FakeEngine(), age=1, score=score_until_cancelled)
    producer.take(1)
    assert entered.wait(timeout=60)
    start = time.monotonic()
    producer.close()
    assert time.monotonic() - start < 5 and cancelled == [True]


def test_a_scoring_error_reaches_the_trainer_at_its_step_not_at_the_refit_before():
    with _producer(FakeEngine(), age=1, score=Scorer(fail_calls_after=1)) as producer:
        producer.take(1)
        producer.refit({"name": "w1"}, weights_version=1)  # step 1 ends: its log lines are written
        with pytest.raises(RuntimeError, match="verifier died"):
            producer.take(2)


def test_engine_error_reaches_the_trainer():
    class Broken(FakeEngine):
        def generate(self, prompts, params, seeds):
            if self.calls:
                raise RuntimeError("engine died")
            return super().generate(prompts, params, seeds)

    with _producer(Broken(), age=1) as producer:
        producer.take(1)
        with pytest.raises(RuntimeError, match="engine died"):
            producer.take(2)


def test_steps_out_of_order_are_refused():
    with _producer(FakeEngine(), age=1) as producer:
        producer.take(1)
        with pytest.raises(ValueError, match="rollouts of step 2 are in flight; step 3 was asked for"):
            producer.take(3)


def test_synchronous_rollouts_free_the_engines_cache_before_training_when_asked():
    # the real slot decoder on the CPU: after each step's rollouts its KV cache and state
    # are gone (the policy trains in that memory); the next call re-creates them and
    # samples the same completions as an engine that kept them
    from mlperf_grpo.inference.hf import HFEngine

    texts = {}
    for release in (False, True):
        engine = HFEngine("builtin:arithmetic-tiny", "float32", batch_size=4, decode="slots")
        sampler = PromptSampler(arithmetic.train_tasks(32, 251, seed=1), seed=1)
        settings = RolloutSettings(2, 3, PARAMS, seed=7, max_trajectory_age_steps=0, max_steps=2,
                                   release_engine_memory=release)
        with RolloutProducer(engine, sampler, settings) as producer:
            for step in (1, 2):
                rollouts = producer.take(step)
                assert (engine._decoder.cache is None) is release
                texts.setdefault(release, []).append([c.token_ids for g in rollouts.completions for c in g])
    assert texts[True] == texts[False]


def test_one_step_async_never_frees_the_cache_the_next_generation_uses():
    engine = FakeEngine()  # no release_memory: calling it would raise
    sampler = PromptSampler(arithmetic.train_tasks(32, 251, seed=1), seed=1)
    settings = RolloutSettings(2, 3, PARAMS, seed=7, max_trajectory_age_steps=1, max_steps=2, release_engine_memory=True)
    with RolloutProducer(engine, sampler, settings) as producer:
        producer.take(1)
        producer.refit({"name": "w1"}, weights_version=1)
        producer.take(2)
