"""Closed-division config checks: each rule, one value off, refused with the right message."""

import pytest
import yaml

from mlperf_grpo.cli import main
from mlperf_grpo.config.load import ClosedDivisionError, parse_config
from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.errors import ConfigError


def _with(section, key, value):
    data = {"division": "closed", "grpo": {"num_prompts_per_step": 16, "max_steps": 40}}
    data.setdefault(section, {})[key] = value
    return data


OFF_BY_ONE = [
    # section, key, value, required, formula words in the message
    ("grpo", "num_generations_per_prompt", 8, "16", "fixed"),
    ("grpo", "max_sequence_length", 4096, "65536", "fixed"),
    ("grpo", "rollout_temperature", 0.9, "1.0", "training rollouts"),
    ("grpo", "rollout_top_p", 0.9, "1.0", "training rollouts"),
    ("grpo", "first_eval_step", 20, "18", "ceil(2.5 + 3840/GBS) at GBS 256; omit the key or write null"),
    ("grpo", "max_steps", 10, "'>= 18'", "first eval step"),
    ("optimizer", "learning_rate", 4e-6, "1e-06", "1e-6*sqrt(GBS/256) at GBS 256; omit the key or write null"),
    ("optimizer", "gradient_clip_norm", 1.0, "0.125", "0.125*sqrt(256/GBS) at GBS 256; omit the key or write null"),
    ("optimizer", "beta_1", 0.8, "0.9", "AdamW"),
    ("optimizer", "beta_2", 0.99, "0.999", "AdamW"),
    ("optimizer", "epsilon", 1e-6, "1e-08", "AdamW"),
    ("optimizer", "weight_decay", 0.01, "0.0", "AdamW"),
    ("validation", "num_tasks", 250, "251", "eval_samples"),
    ("validation", "generations_per_task", 8, "4", "pass@4"),
    ("validation", "temperature", 0.2, "0.1", "validation rollouts"),
    ("validation", "top_p", 1.0, "0.95", "validation rollouts"),
    # the reference's algorithm (NeMo-RL mlperf-training-qwen35-main async recipe)
    ("grpo", "ratio_clip_min", 0.1, "0.2", "reference algorithm"),
    ("grpo", "ratio_clip_max", 0.2, "0.28", "reference algorithm"),
    ("grpo", "force_on_policy_ratio", False, "True", "reference algorithm"),
    ("grpo", "truncated_importance_sampling_ratio", 1.01, "1.002", "reference algorithm"),
    ("grpo", "truncated_importance_sampling_ratio_min", 0.99, "0.999", "reference algorithm"),
    ("grpo", "seq_logprob_error_threshold", 3.0, "2.0", "reference algorithm"),
    ("grpo", "max_trajectory_age_steps", 0, "1", "reference algorithm"),
    ("grpo", "use_leave_one_out_baseline", False, "True", "reference algorithm"),
    ("grpo", "normalize_rewards", False, "True", "reference algorithm"),
    ("grpo", "overlong_filtering", False, "True", "reference algorithm"),
]


@pytest.mark.parametrize("section,key,value,required,formula", OFF_BY_ONE, ids=[f"{s}.{k}" for s, k, *_ in OFF_BY_ONE])
def test_one_value_off_is_refused(section, key, value, required, formula):
    with pytest.raises(ClosedDivisionError) as info:
        parse_config(_with(section, key, value), source="c.yaml")
    err = info.value
    assert [v.field for v in err.violations] == [f"{section}.{key}"]
    line = str(err).splitlines()[1].strip()
    assert line.startswith(f"{section}.{key}: given {value!r}, required {required} (")
    assert formula in line
    assert str(err).startswith("c.yaml: division closed, but 1 value departs from the closed rules")


@pytest.mark.parametrize("key,value", [("learning_rate", 1e-6), ("gradient_clip_norm", 0.125)])
def test_derived_value_typed_even_when_equal_is_refused(key, value):
    with pytest.raises(ClosedDivisionError, match=f"optimizer.{key}: omit the key or write null; .*even an equal one \\(given {value!r};"):
        parse_config(_with("optimizer", key, value))


def test_closed_first_eval_step_equal_to_formula_is_refused():
    with pytest.raises(ClosedDivisionError) as info:
        parse_config(_with("grpo", "first_eval_step", 18))
    line = str(info.value).splitlines()[1].strip()
    assert line == ("grpo.first_eval_step: omit the key or write null; a closed config never types a derived value, "
                    "even an equal one (given 18; derived: ceil(2.5 + 3840/GBS) at GBS 256)")
    assert "required 18" not in line  # it read "given 18, required 18"


@pytest.mark.parametrize("gbs,lr,clip,s0", [(256, 1e-6, 0.125, 18), (512, 2**0.5 * 1e-6, 0.125 / 2**0.5, 10), (1024, 2e-6, 0.0625, 7)])
def test_omitted_or_null_means_derived(gbs, lr, clip, s0):
    for optimizer in ({}, {"learning_rate": None, "gradient_clip_norm": None}):
        c = parse_config({"division": "closed", "grpo": {"num_prompts_per_step": gbs // 16, "max_steps": 30}, "optimizer": optimizer})
        assert c.closed_violations() == []
        assert c.learning_rate == pytest.approx(lr, rel=1e-12)
        assert c.gradient_clip_norm == pytest.approx(clip, rel=1e-12)
        assert c.first_eval_step == s0


def test_python_construction_of_closed_config_derives_learning_rate():
    assert RunConfig(division="closed").learning_rate == 1e-6
    assert RunConfig().learning_rate == 4e-6  # open default


def test_every_violation_is_listed_one_line_each():
    data = {"division": "closed", "grpo": {"num_prompts_per_step": 16, "first_eval_step": 20},
            "optimizer": {"learning_rate": 4e-6, "beta_1": 0.8}}
    with pytest.raises(ClosedDivisionError) as info:
        parse_config(data)
    lines = str(info.value).splitlines()
    assert len(lines) == 4 and "3 values depart" in lines[0]
    assert [ln.split(":")[0].strip() for ln in lines[1:]] == ["optimizer.beta_1", "grpo.first_eval_step", "optimizer.learning_rate"]


def test_open_division_allows_departures_and_names_them():
    c = parse_config({"division": "open", "grpo": {"first_eval_step": 20}, "optimizer": {"learning_rate": 4e-6}})
    assert c.first_eval_step == 20
    algorithm = [f"grpo.{k}" for k in ("ratio_clip_max", "force_on_policy_ratio", "use_importance_sampling_correction",
                 "truncated_importance_sampling_type", "truncated_importance_sampling_ratio",
                 "truncated_importance_sampling_ratio_min", "seq_logprob_error_threshold", "max_trajectory_age_steps")]
    # use_leave_one_out_baseline, normalize_rewards, overlong_filtering: open default = closed
    assert [v.field for v in c.closed_violations()] == [*algorithm, "grpo.first_eval_step", "optimizer.learning_rate"]
    reference = parse_config({"division": "closed"}).grpo.model_dump()
    assert RunConfig(division="open", optimizer={"learning_rate": 1e-6}, grpo=reference).closed_violations() == []


def test_unknown_division_is_a_one_line_config_error():
    with pytest.raises(ConfigError) as info:
        parse_config({"division": "semi-closed"})
    assert "division" in str(info.value) and "\n" not in str(info.value)


def test_cli_refuses_a_closed_config_before_anything_starts(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump({"division": "closed", "optimizer": {"learning_rate": 2e-6}}))
    out = tmp_path / "run"
    assert main(["run", "--config", str(cfg), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "optimizer.learning_rate: given 2e-06, required 1e-06" in err
    assert "Traceback" not in err
    assert not out.exists()


def test_cli_unknown_division_exit_2(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("division: secret\n")
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "division" in err


def test_bad_deferred_env_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DEFERRED_OFFLINE_EVAL", "maybe")
    assert main(["run", "--output", str(tmp_path / "r")]) == 2
    assert "DEFERRED_OFFLINE_EVAL must be 0" in capsys.readouterr().err


def test_closed_omitted_algorithm_keys_are_the_reference():
    c = parse_config({"division": "closed", "grpo": {"num_prompts_per_step": 16}})
    g = c.grpo
    assert (g.ratio_clip_min, g.ratio_clip_max, g.force_on_policy_ratio) == (0.2, 0.28, True)
    assert (g.use_importance_sampling_correction, g.truncated_importance_sampling_type) == (True, "seq-mask-tis")
    assert (g.truncated_importance_sampling_ratio_min, g.truncated_importance_sampling_ratio) == (0.999, 1.002)
    assert (g.seq_logprob_error_threshold, g.max_trajectory_age_steps) == (2.0, 1)
    assert (g.use_leave_one_out_baseline, g.normalize_rewards, g.overlong_filtering) == (True, True, True)
    assert g.needs_prev_logprobs  # the reference computes prev log-probs for the error filter
    assert RunConfig(division="closed").grpo.max_trajectory_age_steps == 1
    assert RunConfig().grpo.max_trajectory_age_steps == 0  # open default: synchronous


def test_closed_without_is_correction_lists_every_departure():
    # Turning the IS correction off in a closed config is refused; the truncation that
    # depends on it must be switched off too, and both are named.
    data = {"division": "closed", "grpo": {"use_importance_sampling_correction": False,
            "truncated_importance_sampling_type": None, "max_trajectory_age_steps": 0}}
    with pytest.raises(ClosedDivisionError) as info:
        parse_config(data)
    assert [v.field for v in info.value.violations] == [
        "grpo.use_importance_sampling_correction", "grpo.truncated_importance_sampling_type", "grpo.max_trajectory_age_steps"]


@pytest.mark.parametrize("grpo,msg", [
    ({"truncated_importance_sampling_type": "seq-mask-tis"}, "needs use_importance_sampling_correction: true"),
    ({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "seq-mask-tis",
      "truncated_importance_sampling_ratio": 0.99, "truncated_importance_sampling_ratio_min": 1.0}, "ratio_min <= "),
    ({"max_trajectory_age_steps": 1}, "max_trajectory_age_steps: 1 needs use_importance_sampling_correction"),
    ({"max_trajectory_age_steps": 2}, "max_trajectory_age_steps"),
    ({"truncated_importance_sampling_type": "icepop"}, "truncated_importance_sampling_type"),
    ({"ratio_clip_eps": 0.2}, "ratio_clip_eps was renamed: write ratio_clip_min and ratio_clip_max"),
])
def test_inconsistent_loss_options_are_one_line_errors(grpo, msg):
    with pytest.raises(ConfigError) as info:
        parse_config({"grpo": grpo})
    assert msg in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("force,is_correction,threshold,expected", [
    (True, True, 2.0, True),     # the reference: the pass feeds the log-prob error filter only
    (True, True, None, False),   # NeMo-RL skips it: the loss uses sg(curr) for prev
    (False, True, None, True),   # the ratio and the IS weight need the real prev
    (False, False, None, False),  # open default: generation log-probs stand in for prev
])
def test_prev_logprob_pass_runs_when_the_reference_runs_it(force, is_correction, threshold, expected):
    from mlperf_grpo.config.sections import GRPOConfig

    g = GRPOConfig(force_on_policy_ratio=force, use_importance_sampling_correction=is_correction,
                   seq_logprob_error_threshold=threshold)
    assert g.needs_prev_logprobs is expected
