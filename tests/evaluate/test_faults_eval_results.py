"""Fault injection on the offline evaluator (issue 5, evaluator side), the results: the engine holds
the weights it claims (refit proof), a reward that raises fails the checkpoint, re-evaluation is
identical, the target is strict. The runs are copies of the default run that ``conftest.py`` makes
once (``finished``, ``trained``, ``run``).
"""

import dataclasses
import json
import os
import types

import pytest
import reward_fixtures
import yaml
from faults_eval_helpers import error_lines, eval_steps, info_of, normalized, read_results, set_info

from mlperf_grpo import rules
from mlperf_grpo.checkpoint import read_weights
from mlperf_grpo.cli import main
from mlperf_grpo.config.load import load_config
from mlperf_grpo.evaluate.offline import evaluate_run
from mlperf_grpo.evaluate.series import RefitError, verify_refit
from mlperf_grpo.logs.mllog import read_log
from mlperf_grpo.tasks import SUITES, arithmetic
from mlperf_grpo.tasks.scoring import VerifierError

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- 4. the engine holds the weights it claims

def test_one_engine_across_checkpoints_equals_fresh_engines(engine_results):
    assert engine_results.shared_19 == engine_results.fresh_19
    assert engine_results.shared_18 != engine_results.shared_19  # the refit changed something


def test_refit_only_engine_evaluates_as_one_that_loaded_the_model(engine_results):
    """The evaluators' engine (built from the config, no weights read or initialised)
    gives, after one refit, the results of an engine built from the model's files."""
    assert engine_results.refit_only_19 == engine_results.fresh_19


def test_evaluator_reads_no_initial_weights_and_is_warm_before_the_first_checkpoint(run, finished, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the evaluator loaded the initial model's weights")

    monkeypatch.setattr("mlperf_grpo.inference.hf.load_model", no_load)
    evaluate_run(run, retain_checkpoints=True, show_progress=False, workers=1)
    assert normalized(run / "mlperf.log") == normalized(finished / "mlperf.log")
    [startup] = [json.loads(l) for l in (run / "eval" / "startup.jsonl").read_text().splitlines()]
    assert startup["rank"] == 0 and startup["launch_unix_s"] is None and startup["pid"] == os.getpid()
    assert startup["engine_s"] > 0 and startup["warm_up_s"] > 0
    first_eval_start_ms = read_log(run / "mlperf.log").find("eval_start")[0].time_ms
    ready_ms = 1000 * (startup["start_unix_s"] + startup["engine_s"] + startup["warm_up_s"])
    assert ready_ms <= first_eval_start_ms + 5  # warmed up before the first checkpoint's clock (rounding)


def test_verify_refit_catches_stale_weights_and_a_wrong_canary(engine_results):
    engine, checkpoints = engine_results.shared, engine_results.checkpoints
    w18, w19 = read_weights(checkpoints[18]), read_weights(checkpoints[19])
    engine.load_weights(w18)
    with pytest.raises(RefitError, match="step_19: the engine's weights differ"):
        verify_refit(engine, checkpoints[19], list(w19))  # the refit to step 19 "did not happen"
    engine.load_weights(w19)
    verify_refit(engine, checkpoints[19], list(w19))
    info = checkpoints[19].info
    bad = dataclasses.replace(checkpoints[19], info=dataclasses.replace(info, canary_logits=[x + 0.01 for x in info.canary_logits]))
    with pytest.raises(RefitError, match="canary logits differ"):
        verify_refit(engine, bad, list(w19))


def test_wrong_canary_in_training_info_stops_evaluation(run, capsys):
    logits = info_of(run, 19)["canary_logits"]
    set_info(run, 19, canary_logits=[logits[0] + 0.5] + logits[1:])
    assert main(["evaluate", str(run), "--retain-checkpoints"]) == 1
    assert "step_19: the engine's canary logits differ" in error_lines(capsys.readouterr().err)
    assert eval_steps(run / "mlperf.log") == [18]  # step 18 committed, nothing for step 19
    log = read_log(run / "mlperf.log")
    assert [e.metadata["step"] for e in log.find("eval_start")] == [18] and not log.find("run_stop")


# --------------------------------------------------------------------------- 5. verifier errors are not wrong answers

def test_reward_that_raises_fails_the_checkpoint(run, monkeypatch):
    bad_task = reward_fixtures.BAD_TASK
    suite = types.SimpleNamespace(validation_tasks=arithmetic.validation_tasks, train_tasks=arithmetic.train_tasks,
                                  reward=reward_fixtures.crashing_reward)
    monkeypatch.setitem(SUITES, "arithmetic", suite)
    before = (run / "mlperf.log").read_bytes()
    with pytest.raises(VerifierError, match=f"failed on 4 of 1004 completions \\(0 timeouts\\).*sandbox crashed on task {bad_task}"):
        evaluate_run(run, retain_checkpoints=True, show_progress=False)
    assert (run / "mlperf.log").read_bytes() == before
    assert not (run / "eval" / "step_18.jsonl").exists()


# --------------------------------------------------------------------------- 6. deterministic

def test_reevaluation_in_a_fresh_engine_is_identical(engine_results, finished):
    """The module's fresh engine on step 18 vs the `run` command's own evaluation."""
    header, rows = read_results(finished / "eval" / "step_18.jsonl")
    accuracy, results = engine_results.shared_18
    assert [(r["task_id"], r["completions"], r["rewards"]) for r in rows] == [
        (r.task_id, r.completions, r.rewards) for r in results
    ]
    assert accuracy == read_log(finished / "mlperf.log").find("eval_accuracy")[0].value
    config = engine_results.config
    assert header["seed"] == config.seed
    assert header["sampling"] == {"temperature": 0.1, "top_p": 0.95, "max_new_tokens": config.grpo.max_new_tokens}
    assert header["engine"] == engine_results.shared.describe()
    assert {"model", "dtype", "batch_size", "torch", "transformers", "sampler"} <= set(header["engine"])


# --------------------------------------------------------------------------- 7. strict target

def test_accuracy_equal_to_the_target_is_not_a_pass(run, finished, monkeypatch):
    step18 = read_log(finished / "mlperf.log").find("eval_accuracy")[0].value
    assert step18 == 171 / 251  # README calibration table: 0.681
    monkeypatch.setattr(rules, "TARGET_ACCURACY", step18)  # configs accept only the rules' target
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["validation"]["target_accuracy"] = step18
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    assert load_config(run / "config.yaml").validation.target_accuracy == step18
    outcome = evaluate_run(run, retain_checkpoints=True, show_progress=False)
    assert outcome.accuracies[18] == step18
    assert outcome.status == "success" and outcome.passing_step == 19
    assert eval_steps(run / "mlperf.log") == [18, 19]



def test_old_checkpoint_without_a_fingerprint_is_reported_unchecked(engine_results):
    engine, checkpoints = engine_results.shared, engine_results.checkpoints
    weights = read_weights(checkpoints[19])
    engine.load_weights(weights)
    info = checkpoints[19].info
    old = dataclasses.replace(checkpoints[19], info=dataclasses.replace(
        info, weights={k: v for k, v in info.weights.items() if k != "fingerprint"}))
    assert verify_refit(engine, old, list(weights)) == "canary (fingerprint unchecked: none recorded)"
    engine.load_weights(read_weights(checkpoints[18]))
    with pytest.raises(RefitError, match="canary logits differ"):  # the canary is still checked
        verify_refit(engine, old, list(weights))
