"""The logged micro-batch and gradient-accumulation hyperparameters (train/mlperf_events.py)
with and without a token budget, a row cap and ranks."""

import pytest

from mlperf_grpo.config.load import parse_config
from mlperf_grpo.train.mlperf_events import hyperparameters


@pytest.mark.parametrize("grpo, ranks, micro, steps", [
    ({}, 1, 32, 1),  # a token budget, no row cap: the rank's share in one pass at the fewest
    ({}, 2, 16, 1),
    ({"micro_batch_size": 3}, 1, 3, 11),  # a cap: 32 rows take 11 passes at least (10 x 3 = 30 left 2 out)
    ({"micro_batch_size": 1000}, 1, 32, 1),  # a cap above the share: one pass, not 0
    ({"micro_batch_size": 5}, 2, 5, 4),
    ({"micro_batch_tokens": None, "micro_batch_size": 4}, 2, 4, 4),  # padded passes: 16 rows a rank / 4
])
def test_logged_micro_batch_and_accumulation_steps_are_the_passes_a_rank_makes_at_least(grpo, ranks, micro, steps):
    config = parse_config({"grpo": {"num_prompts_per_step": 2, "first_eval_step": 1, **grpo}}, source="test")  # GBS 32
    values = hyperparameters(config, "c.yaml", ranks)
    assert (values["micro_batch_size"], values["gradient_accumulation_steps"]) == (micro, steps)
    assert values["micro_batch_size"] * values["gradient_accumulation_steps"] * ranks >= config.global_batch_size
