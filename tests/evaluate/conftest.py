"""The evaluator's fault tests' runs (issue 5, evaluator side).

One default run (trained and evaluated, checkpoints retained) is made once per test session;
each test copies it. The "trained" copy is that run as training left it: the log cut
before the first ``eval_start`` (the evaluator only appends) and no ``eval/``. The fixtures
are built only when a test under ``tests/evaluate/`` asks for them.
"""

import shutil
import types

import pytest
from faults_eval_helpers import copy_run, eval_steps, has_eval_events

from mlperf_grpo.checkpoint import discover_checkpoints, read_weights
from mlperf_grpo.cli import main
from mlperf_grpo.config.load import load_config
from mlperf_grpo.evaluate.series import verify_refit
from mlperf_grpo.evaluate.validator import validate
from mlperf_grpo.inference.base import SamplingParams
from mlperf_grpo.inference.hf import HFEngine
from mlperf_grpo.tasks import arithmetic


@pytest.fixture(scope="session")
def finished(tmp_path_factory):
    """An uninterrupted default run: train, then evaluate, checkpoints retained."""
    run = tmp_path_factory.mktemp("faults_eval") / "finished"
    assert main(["run", "--output", str(run), "--retain-checkpoints"]) == 0
    assert eval_steps(run / "mlperf.log") == [18, 19, 20]
    return run


@pytest.fixture(scope="session")
def trained(finished, tmp_path_factory):
    """The same run as training left it (log up to the first eval_start, no eval/)."""
    run = copy_run(finished, tmp_path_factory.mktemp("faults_eval") / "trained")
    shutil.rmtree(run / "eval")
    lines = (run / "mlperf.log").read_text().splitlines(keepends=True)
    cut = next(i for i, l in enumerate(lines) if '"key": "eval_start"' in l)
    (run / "mlperf.log").write_text("".join(lines[:cut]))
    assert not has_eval_events(run / "mlperf.log")
    return run


@pytest.fixture
def run(trained, tmp_path):
    return copy_run(trained, tmp_path / "run")


@pytest.fixture(scope="session")
def engine_results(trained):
    """Library-level evaluation: steps 18 then 19 in one engine, and 19 in a fresh one."""
    config = load_config(trained / "config.yaml")
    checkpoints = {c.step: c for c in discover_checkpoints(trained / "checkpoints")[0]}
    v = config.validation
    tasks = arithmetic.validation_tasks(v.num_tasks)
    params = SamplingParams(v.temperature, v.top_p, config.grpo.max_new_tokens)

    def new_engine():
        return HFEngine(config.model.path, config.model.dtype, batch_size=v.batch_size)

    def evaluate(engine, step):
        weights = read_weights(checkpoints[step])
        engine.load_weights(weights)
        assert verify_refit(engine, checkpoints[step], list(weights)) == "fingerprint+canary"
        return validate(engine, tasks, arithmetic.reward, v.generations_per_task, params, seed=config.seed)

    shared = new_engine()
    results = {"shared_18": evaluate(shared, 18), "shared_19": evaluate(shared, 19)}
    results["fresh_19"] = evaluate(new_engine(), 19)
    results["refit_only_19"] = evaluate(HFEngine.for_refit(config.model.path, config.model.dtype, batch_size=v.batch_size), 19)
    return types.SimpleNamespace(shared=shared, checkpoints=checkpoints, config=config, **results)
