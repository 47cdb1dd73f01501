"""Derived closed-division values against numbers worked out by hand.

S0 = ceil(2.5 + 3840/GBS); lr = 1e-6*sqrt(GBS/256); clip = 0.125*sqrt(256/GBS).
    GBS 16:   2.5 + 240    = 242.5  -> 243; lr 1e-6/4 = 2.5e-7;      clip 0.125*4 = 0.5
    GBS 256:  2.5 + 15     = 17.5   -> 18;  lr 1e-6;                 clip 0.125
    GBS 512:  2.5 + 7.5    = 10.0   -> 10;  lr 1e-6*sqrt(2);         clip 0.125/sqrt(2)
    GBS 1024: 2.5 + 3.75   = 6.25   -> 7;   lr 2e-6;                 clip 0.0625
    GBS 4096: 2.5 + 0.9375 = 3.4375 -> 4;   lr 4e-6;                 clip 0.03125
"""

import math

import pytest

from mlperf_grpo import rules

HAND = {
    # gbs: (prompts, S0, samples_count at S0, lr, clip)
    16: (1, 243, 3888, 2.5e-7, 0.5),
    256: (16, 18, 4608, 1.0e-6, 0.125),
    512: (32, 10, 5120, 1.4142135623730951e-6, 0.08838834764831845),
    1024: (64, 7, 7168, 2.0e-6, 0.0625),
    4096: (256, 4, 16384, 4.0e-6, 0.03125),
}


@pytest.mark.parametrize("gbs", sorted(HAND))
def test_derived_values_match_hand_computation(gbs):
    prompts, s0, first_samples, lr, clip = HAND[gbs]
    assert rules.first_eval_step(gbs) == s0
    assert rules.samples_count(s0, gbs) == first_samples
    assert rules.closed_learning_rate(gbs) == pytest.approx(lr, rel=1e-12)
    assert rules.closed_gradient_clip_norm(gbs) == pytest.approx(clip, rel=1e-12)
    plan = rules.closed_plan(gbs, num_later_evals=3)
    assert plan["num_prompts_per_step"] == prompts
    assert plan["first_eval_step"] == s0
    assert plan["first_eval_samples_count"] == first_samples
    assert plan["later_eval_samples_count"] == [first_samples + gbs, first_samples + 2 * gbs, first_samples + 3 * gbs]


def test_first_eval_step_is_exact_at_integer_boundaries():
    # 2.5 + 3840/GBS is an integer at GBS 512 (10.0) and 2560 (4.0): ceil must not round up
    assert rules.first_eval_step(512) == 10
    assert rules.first_eval_step(2560) == 4
    for gbs in range(16, 8193, 16):
        assert rules.first_eval_step(gbs) == math.ceil(2.5 + 3840 / gbs)


def test_matches_the_official_rcp_records():
    # rcps_qwen35_397b_grpo.json converges at exactly the first eval at 256, 512 and 1024.
    for gbs, samples in rules.REFERENCE_SAMPLES_TO_CONVERGE.items():
        assert rules.samples_count(rules.first_eval_step(gbs), gbs) == samples


def test_fixed_values_in_plan():
    plan = rules.closed_plan(256)
    assert plan["opt_adamw_beta_1"] == 0.9 and plan["opt_adamw_beta_2"] == 0.999
    assert plan["opt_adamw_epsilon"] == 1e-8 and plan["opt_adamw_weight_decay"] == 0.0
    assert plan["opt_learning_rate_warmup_steps"] == 0
    assert plan["opt_learning_rate_decay_schedule"] == "constant"
    assert plan["generation_training_rollout_temperature"] == 1.0
    assert plan["generation_training_rollout_top_p"] == 1.0
    assert plan["generation_validation_rollout_temperature"] == 0.1
    assert plan["generation_validation_rollout_top_p"] == 0.95
    assert plan["num_generations_per_prompt"] == 16
    assert plan["eval_samples"] == 251
    assert plan["max_sequence_length"] == 65536
    assert plan["target"] == "eval_accuracy > 0.69"


@pytest.mark.parametrize("bad", [0, -16, 17, 8, 100, 2.5, "256", True, None])
def test_closed_gbs_must_be_a_positive_multiple_of_16(bad):
    with pytest.raises(ValueError, match="global batch size"):
        rules.check_closed_global_batch_size(bad)
