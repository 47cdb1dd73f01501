"""Config: defaults, and one-line errors naming the field."""

import pytest

from mlperf_grpo.config import ConfigError, RunConfig, load_config, parse_config


def test_default_is_the_builtin_run():
    c = RunConfig()
    assert c.global_batch_size == 256
    assert c.first_eval_step == 18
    assert c.division == "open"
    assert c.validation.num_tasks == 251 and c.validation.generations_per_task == 4


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"grpo": {"max_step": 3}}, "unknown key 'grpo.max_step'"),
        ({"bogus": 1}, "unknown key 'bogus'"),
        ({"grpo": {"max_steps": 0}}, "field 'grpo.max_steps'"),
        ({"grpo": {"max_steps": "many"}}, "field 'grpo.max_steps'"),
        ({"grpo": {"micro_batch_size": 100}}, "must divide the global batch size 256"),
        ({"division": "semi"}, "field 'division'"),
        ([1, 2], "expected a mapping"),
    ],
)
def test_bad_fields_name_the_field(data, needle):
    with pytest.raises(ConfigError) as err:
        parse_config(data, source="x.yaml")
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_malformed_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("grpo: {max_steps: [\n")
    with pytest.raises(ConfigError, match="malformed YAML"):
        load_config(p)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")
