"""End to end: `run --config configs/swe-tiny.yaml` (made smaller for CI): the random-init
agent trains on the tiny suite in bubblewrap sandboxes, is evaluated offline, and ends
aborted; the log's structure passes the official checker."""

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from mlperf_grpo.cli import main
from mlperf_grpo.logs.mllog import read_log
from test_pipeline import official_check

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (apt-get install bubblewrap)")]
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "swe-tiny.yaml"


def test_swe_tiny_run_trains_evaluates_and_ends_aborted(tmp_path, monkeypatch):
    monkeypatch.setenv("MLPERF_GRPO_CACHE", str(tmp_path / "cache"))
    config = yaml.safe_load(CONFIG.read_text())
    config["grpo"].update(max_steps=1)
    config["agent"].update(max_turns=2, max_new_tokens_per_turn=8, sandbox_root=str(tmp_path / "sandboxes"))
    config["validation"].update(generations_per_task=1)
    path = tmp_path / "swe-tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    assert main(["run", "--config", str(path), "--output", str(run)]) == 3  # aborted: an untrained model
    log = read_log(run / "mlperf.log")
    assert [(e.metadata["step"], e.value) for e in log.find("eval_accuracy")] == [(1, 0.0)]
    assert [e.metadata["status"] for e in log.find("run_stop")] == ["aborted"]
    header, *results = [json.loads(line) for line in (run / "eval" / "step_1.jsonl").read_text().splitlines()]
    assert len(results) == 12 and all(len(r["trajectories"]) == 1 for r in results)
    record = results[0]["trajectories"][0]
    assert record["end_reason"] in ("max_turns", "finish", "context") and 1 <= len(record["turns"]) <= 2
    assert record["tokens"] > record["prompt_tokens"] and record["sampled_tokens"] > 0
    assert not any((tmp_path / "sandboxes").iterdir())
    # the structure passes; only the values of a tiny untrained run fail: 12 eval samples, not 251, and no pass
    text = official_check(run / "mlperf.log")
    assert set(re.findall(r"CHECK for '(\w+)' failed", text)) == {"eval_samples"}, text
    assert "Failed checks for eval_accuracy" in text


class ScriptedEvaluationEngine:
    """The evaluator's real engine (refit, fingerprint and canary checks all real) whose
    turns a scripted policy writes: a double for the trained model only."""

    def __init__(self, engine, script):
        from mlperf_grpo.agent.scripted import ScriptedEngine
        from mlperf_grpo.tasks.swe import tiny_suite

        self._engine = engine
        self._scripted = ScriptedEngine(engine.tokenizer, tiny_suite("validation"), script)

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate_ids(self, prompt_token_ids, params, seeds):
        return self._scripted.generate_ids(prompt_token_ids, params, seeds)


def test_the_logs_eval_accuracy_is_pass_at_4_of_the_agents_trajectories(tmp_path, monkeypatch):
    """A policy that fixes 9 of the 12 validation tasks: pass@4 = 0.75 > 0.69, so the run
    passes at its first checkpoint and run_stop is success."""
    from mlperf_grpo.agent.scripted import do_nothing_script, known_fix_script
    from mlperf_grpo.evaluate import worker
    from mlperf_grpo.tasks.swe import tiny_suite

    fixed = {t.task_id for t in tiny_suite("validation")[:9]}

    def script(task_id, turn, text):
        return (known_fix_script if task_id in fixed else do_nothing_script)(task_id, turn, text)

    real_build = worker.build_engine
    monkeypatch.setattr(worker, "build_engine", lambda *a, **k: ScriptedEvaluationEngine(real_build(*a, **k), script))
    monkeypatch.setenv("MLPERF_GRPO_CACHE", str(tmp_path / "cache"))
    config = yaml.safe_load(CONFIG.read_text())
    config["grpo"].update(max_steps=1, num_prompts_per_step=1)
    # the scripted fixes take up to 444 tokens a turn; the random-init policy trains on turns as long
    config["agent"].update(max_turns=3, max_new_tokens_per_turn=512, sandbox_root=str(tmp_path / "sandboxes"))
    config["validation"].update(generations_per_task=4)
    path = tmp_path / "swe-tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    assert main(["run", "--config", str(path), "--output", str(run)]) == 0
    log = read_log(run / "mlperf.log")
    assert [(e.metadata["step"], e.value) for e in log.find("eval_accuracy")] == [(1, 0.75)]
    assert [e.metadata["status"] for e in log.find("run_stop")] == ["success"]
    header, *results = [json.loads(line) for line in (run / "eval" / "step_1.jsonl").read_text().splitlines()]
    assert [r["rewards"] for r in results] == [[1.0] * 4] * 9 + [[0.0] * 4] * 3
    assert all(t["end_reason"] == "finish" for r in results for t in r["trajectories"])
