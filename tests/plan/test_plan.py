"""`mlperf-grpo plan`: values, JSON, RCP figures, shipped configs and bad input."""

import json
from pathlib import Path

import pytest

from mlperf_grpo.cli import main
from mlperf_grpo.config.load import load_config
from mlperf_grpo.plan.closed import build_plan, load_rcp_means, rcp_convergence

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_plan_256_prints_every_value(capsys):
    assert main(["plan", "--global-batch-size", "256"]) == 0
    out = capsys.readouterr().out
    for line in [
        "num_prompts_per_step: 16",
        "first_eval_step: 18   = ceil(2.5 + 3840/GBS)",
        "first_eval_samples_count: 4608",
        "later_eval_samples_count: 4864, 5120, 5376",
        "opt_base_learning_rate: 1e-06   = 1e-6*sqrt(GBS/256)",
        "opt_gradient_clip_norm: 0.125   = 0.125*sqrt(256/GBS)",
        "opt_adamw_beta_1: 0.9", "opt_adamw_beta_2: 0.999", "opt_adamw_epsilon: 1e-08",
        "opt_adamw_weight_decay: 0.0", "opt_learning_rate_warmup_steps: 0",
        "opt_learning_rate_decay_schedule: constant",
        "generation_training_rollout_temperature: 1.0", "generation_training_rollout_top_p: 1.0",
        "generation_validation_rollout_temperature: 0.1", "generation_validation_rollout_top_p: 0.95",
        "num_generations_per_prompt: 16", "eval_samples: 251", "max_sequence_length: 65536",
        "target: eval_accuracy > 0.69",
        "rcp_samples_to_converge: 4608 samples (exact",
    ]:
        assert line in out, line


def test_plan_json(capsys):
    assert main(["plan", "--global-batch-size", "1024", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["first_eval_step"] == 7 and plan["first_eval_samples_count"] == 7168
    assert plan["opt_base_learning_rate"] == 2e-6 and plan["opt_gradient_clip_norm"] == 0.0625
    assert plan["rcp"]["kind"] == "exact" and plan["rcp"]["samples_count"] == 7168


def test_rcp_figures_follow_the_rcp_checker():
    means = load_rcp_means()
    assert means == {256: 4608, 512: 5120, 1024: 7168}
    assert rcp_convergence(384, means) == {"kind": "interpolated", "samples_count": 4864.0,
                                           "note": "interpolated between GBS 256 and 512"}
    assert rcp_convergence(16, means)["kind"] == "below" and rcp_convergence(16, means)["samples_count"] == 4608
    assert rcp_convergence(4096, means)["samples_count"] is None
    assert build_plan(16)["rcp"]["first_eval_passes_rcp"] is False  # 243 * 16 = 3888 < 4608
    assert build_plan(512)["rcp"]["first_eval_passes_rcp"] is True


@pytest.mark.parametrize("arg,msg", [
    ("17", "multiple of 16"), ("0", "must be positive"), ("-16", "must be positive"),
    ("abc", "must be an integer"), ("25.6", "must be an integer"),
])
def test_bad_gbs_is_one_line_exit_2(arg, msg, capsys):
    assert main(["plan", f"--global-batch-size={arg}"]) == 2
    captured = capsys.readouterr()
    assert msg in captured.err and captured.err.count("\n") == 1 and captured.out == ""


def test_plan_needs_gbs_or_config(capsys):
    assert main(["plan"]) == 2
    assert "exactly one of" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["closed-gbs256.yaml", "closed-gbs512.yaml", "closed-gbs1024.yaml", "open-default.yaml"])
def test_shipped_configs_load(name):
    config = load_config(CONFIGS / name)
    if config.division == "closed":
        assert config.closed_violations() == []
        assert config.grpo.max_steps >= config.first_eval_step


def test_plan_with_open_config_names_the_differences(capsys):
    assert main(["plan", "--config", str(CONFIGS / "open-default.yaml")]) == 0
    out = capsys.readouterr().out
    # the learning rate, and the open default's synchronous loss against the reference algorithm
    assert "open division: 9 value(s) differ from closed:" in out
    assert "grpo.use_leave_one_out_baseline:" not in out and "grpo.overlong_filtering:" not in out  # the reference's
    assert "optimizer.learning_rate: given 4e-06, required 1e-06" in out
    assert "grpo.max_trajectory_age_steps: given 0, required 1 (reference algorithm)" in out
    assert "grpo.ratio_clip_max: given 0.2, required 0.28 (reference algorithm)" in out
    # each difference is printed once (the plan's config line names the file, not the differences again)
    for field in ("optimizer.learning_rate", "grpo.max_trajectory_age_steps", "grpo.ratio_clip_max"):
        assert out.count(f"{field}:") == 1, out


def test_plan_with_closed_config(capsys):
    assert main(["plan", "--config", str(CONFIGS / "closed-gbs512.yaml")]) == 0
    out = capsys.readouterr().out
    assert "first_eval_step: 10" in out and "every value matches the closed rules" in out
    assert "truncated_importance_sampling_type: seq-mask-tis" in out and "ratio_clip_max: 0.28" in out


def test_plan_lists_every_recipe_key_with_its_place_in_the_recipe(capsys):
    # Issue 30: each algorithm key of the reference recipe, its value and where the recipe
    # file sets it (NVIDIA-NeMo/RL mlperf-training-qwen35-main, read there).
    assert main(["plan", "--global-batch-size", "256"]) == 0
    out = capsys.readouterr().out
    for line in [
        "reference_algorithm_source: NVIDIA-NeMo/RL mlperf-training-qwen35-main "
        "qwen_35/configs/grpo_qwen35_397b_swe_openhands_async.yaml",
        "ratio_clip_min: 0.2   (recipe: loss_fn.ratio_clip_min)",
        "ratio_clip_max: 0.28   (recipe: loss_fn.ratio_clip_max)",
        "force_on_policy_ratio: True   (recipe: loss_fn.force_on_policy_ratio)",
        "use_importance_sampling_correction: True   (recipe: loss_fn.use_importance_sampling_correction)",
        "truncated_importance_sampling_type: seq-mask-tis   (recipe: loss_fn.truncated_importance_sampling_type)",
        "truncated_importance_sampling_ratio: 1.002   (recipe: loss_fn.truncated_importance_sampling_ratio)",
        "truncated_importance_sampling_ratio_min: 0.999   (recipe: loss_fn.truncated_importance_sampling_ratio_min)",
        "seq_logprob_error_threshold: 2.0   (recipe: grpo.seq_logprob_error_threshold)",
        "max_trajectory_age_steps: 1   (recipe: grpo.async_grpo.max_trajectory_age_steps)",
        "use_leave_one_out_baseline: True   (recipe: grpo.use_leave_one_out_baseline)",
        "normalize_rewards: True   (recipe: grpo.normalize_rewards)",
        "overlong_filtering: True   (recipe: grpo.overlong_filtering)",
    ]:
        assert f"  {line}\n" in out, line
    assert main(["plan", "--global-batch-size", "256", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["reference_algorithm_keys"]["overlong_filtering"] == "grpo.overlong_filtering"
    assert (plan["use_leave_one_out_baseline"], plan["normalize_rewards"], plan["overlong_filtering"]) == (True, True, True)
