"""The memory planner (src/mlperf_grpo/plan/memory.py): its analytic parameter list equals
the one transformers builds (on the meta device: no memory), and its per-rank bytes are the
layout's arithmetic."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

from mlperf_grpo.plan import memory as memory_plan
from mlperf_grpo.plan.memory import MemoryPlanError, model_tensors, plan_memory

MOE = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
           linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=24, vocab_size=100)
CONFIGS = {
    "llama-tied": LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=4, vocab_size=50, tie_word_embeddings=True),
    "llama-gqa-bias": LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
                                  num_key_value_heads=2, head_dim=16, vocab_size=70, attention_bias=True, mlp_bias=True),
    "qwen3": Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=32, vocab_size=90, tie_word_embeddings=False),
    "qwen3-tied": Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=16, vocab_size=40, tie_word_embeddings=True),
    "qwen3_5_moe": Qwen3_5MoeTextConfig(**MOE),
    "qwen3_5_moe-interval-2": Qwen3_5MoeTextConfig(**{**MOE, "num_hidden_layers": 5}, full_attention_interval=2),
}


def meta_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}  # tied tensors once


def planner_config(hf_config) -> dict:
    """What ``config.json`` holds (``layer_types`` dropped for the MoE: the planner derives
    them from ``full_attention_interval`` as transformers does)."""
    data = hf_config.to_dict()
    if "full_attention_interval" not in data and "layer_types" in data and data["model_type"].startswith("qwen3_5"):
        data["full_attention_interval"] = next(i + 1 for i, kind in enumerate(data["layer_types"]) if kind == "full_attention")
        del data["layer_types"]
    return data


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameter_list_equals_transformers(name):
    expected = meta_shapes(CONFIGS[name])
    planned = {t.name: t.shape for t in model_tensors(planner_config(CONFIGS[name]))}
    assert planned == expected
    assert sum(t.numel for t in model_tensors(planner_config(CONFIGS[name]))) == sum(
        torch.Size(s).numel() for s in expected.values())


def test_layer_types_are_read_when_given():
    config = CONFIGS["qwen3_5_moe"].to_dict()  # layer_types listed, as a saved config.json has them
    assert {t.name: t.shape for t in model_tensors(config)} == meta_shapes(CONFIGS["qwen3_5_moe"])


def test_397b_shape_counts_about_397e9():
    total = sum(t.numel for t in model_tensors(memory_plan.QWEN3_5_397B_A17B))
    assert abs(total - 397e9) / 397e9 < 0.01, total


def test_per_rank_bytes_are_the_layout_arithmetic():
    # 2 tensors: embeddings (10, 4) split; norm (4,) replicated; tied: no lm_head. Layers 0.
    config = {"model_type": "llama", "hidden_size": 4, "vocab_size": 10, "num_hidden_layers": 0,
              "num_attention_heads": 2, "num_key_value_heads": 2, "tie_word_embeddings": True}
    plan = plan_memory(config, world_size=4, tensor_parallel_size=2, dtype="bfloat16", max_in_flight=3)
    assert plan.parameters == 44 and plan.weight_bytes == 88
    shard = 3 * 4 + 1  # ceil(10/4) rows of 4, ceil(4/4) element
    r, s = plan.replica, plan.sharded
    assert (r.master_weights_bytes, r.gradient_bytes, r.adam_bytes) == (4 * shard, 4 * shard, 8 * shard)
    assert (r.engine_bytes, r.staging_bytes, r.eval_read_bytes) == (88, 3 * 2 * shard, 2 * 88)
    engine = 2 * (40 // 2 + 4)  # the embedding split over T = 2, the norm whole
    assert (s.engine_bytes, s.staging_bytes, s.eval_read_bytes) == (engine, 3 * 2 * shard, 2 * engine)
    assert r.device_bytes == 16 * shard + 88 and s.device_bytes == 16 * shard + engine


def test_kv_heads_are_replicated_past_t():
    # one layer, 4 heads of 2, 1 KV head, hidden 8: k/v (2, 8) each stay whole for any T
    config = {"model_type": "llama", "hidden_size": 8, "vocab_size": 4, "num_hidden_layers": 1, "intermediate_size": 4,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 2, "tie_word_embeddings": True}
    kv = 2 * 2 * 8
    split = 4 * 8 + 8 * 8 + 8 * 8 + 3 * 4 * 8  # embeddings, q, o, MLP
    replicated = 3 * 8  # 2 layer norms + final norm
    assert plan_memory(config, 4, 4, "float32").sharded.engine_bytes == 4 * (split // 4 + kv + replicated)


@pytest.mark.parametrize("world, t, named", [(6, 4, "world size 6"), (8, 8, "6 attention heads"),
                                             (4, 4, "6 attention heads"), (3, 3, "2 KV heads")])
def test_tensor_parallel_that_does_not_divide_is_refused(world, t, named):
    config = planner_config(CONFIGS["llama-gqa-bias"])  # 6 heads, 2 KV heads
    with pytest.raises(MemoryPlanError, match=named) as err:
        plan_memory(config, world, t)
    assert f"tensor_parallel_size {t}" in str(err.value)


def test_experts_must_divide():
    config = {**planner_config(CONFIGS["qwen3_5_moe"]), "num_experts": 6, "linear_num_key_heads": 4}
    with pytest.raises(MemoryPlanError, match="6 MoE experts"):
        plan_memory(config, 4, 4)


def test_unknown_model_type_is_refused():
    with pytest.raises(MemoryPlanError, match="model_type 'gpt2'"):
        model_tensors({"model_type": "gpt2"})


def test_cli_shape_names_are_the_planners():
    from mlperf_grpo.cli.requests import MODEL_SHAPE_NAMES

    assert MODEL_SHAPE_NAMES == tuple(memory_plan.MODEL_SHAPES)


def test_plan_memory_json_is_the_plan(tmp_path, capsys):
    import json

    from mlperf_grpo.cli import main

    config = {"model_type": "llama", "hidden_size": 4, "vocab_size": 10, "num_hidden_layers": 0,
              "num_attention_heads": 2, "num_key_value_heads": 2, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", "--memory", "--model-config", str(tmp_path), "--world-size", "4",
                 "--tensor-parallel-size", "2", "--max-in-flight", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == plan_memory(config, 4, 2, "bfloat16", 3).to_json()
    assert out["replica"]["device_bytes"] == 16 * 13 + 88  # as in test_per_rank_bytes_are_the_layout_arithmetic


def test_plan_memory_bad_t_is_one_line_naming_the_flag(capsys):
    """The refusal names the flag the user gave, not the config key (a new-user trial)."""
    from mlperf_grpo.cli import main

    assert main(["plan", "--memory", "--model-shape", "qwen3.5-397b-a17b", "--world-size", "64",
                 "--tensor-parallel-size", "32"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("mlperf-grpo: error: --tensor-parallel-size 32 does not divide the 16 linear-attention "
                            "key heads (linear_num_key_heads): set --tensor-parallel-size to a common divisor of 16\n")
    assert main(["plan", "--memory", "--model-shape", "qwen3.5-397b-a17b", "--world-size", "64",
                 "--tensor-parallel-size", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mlperf-grpo: error: --tensor-parallel-size 3 does not divide") and "inference." not in err


@pytest.mark.parametrize("argv, needle", [
    (["plan", "--memory", "--global-batch-size", "256", "--model-shape", "qwen3.5-397b-a17b", "--world-size", "8"],
     "drop --global-batch-size"),
    (["plan", "--global-batch-size", "256", "--world-size", "8"], "--world-size belongs to plan --memory: add --memory"),
    (["plan", "--memory", "--model-shape", "qwen3.5-397b-a17b"], "give --world-size N"),
])
def test_plan_memory_options_are_not_mixed_silently(argv, needle, capsys):
    from mlperf_grpo.cli import main

    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and needle in captured.err and captured.err.count("\n") == 1


@pytest.mark.parametrize("key, value, least", [("num_attention_heads", 0, 1), ("vocab_size", 0, 1),
                                               ("num_hidden_layers", 2.5, 0), ("hidden_size", "64", 1),
                                               ("hidden_size", -64, 1), ("hidden_size", 0, 1),
                                               ("intermediate_size", True, 1), ("intermediate_size", -1, 1),
                                               ("linear_conv_kernel_dim", 0, 1), ("intermediate_size", 0, 1)])
def test_a_config_count_that_is_not_a_whole_number_is_one_line(tmp_path, capsys, key, value, least):
    """Before: ZeroDivisionError / TypeError text and exit 1, or negative bytes and exit 0 (a new-user trial)."""
    import json

    from mlperf_grpo.cli import main

    config = {"model_type": "llama", "hidden_size": 64, "vocab_size": 15, "num_hidden_layers": 2, "intermediate_size": 96,
              "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 4096, key: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", "--memory", "--model-config", str(tmp_path), "--world-size", "2", "--trajectory-tokens", "100"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert f"{key} is {value!r}, not a whole number >= {least}" in captured.err


def test_the_hf_engine_does_not_replicate_kv_heads():
    """vLLM replicates Qwen3.5-397B's 2 KV heads over T = 8; transformers' tensor
    parallelism (the hf engine) would cut them into quarters, so T must divide them."""
    from mlperf_grpo.plan.memory import QWEN3_5_397B_A17B

    plan_memory(QWEN3_5_397B_A17B, 64, 8)  # vLLM's rule
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(QWEN3_5_397B_A17B, 64, 8, engine="hf")
    assert str(err.value) == ("inference.tensor_parallel_size 8 does not divide the 2 KV heads (num_key_value_heads) of "
                              "the hf engine, which does not replicate them: set inference.tensor_parallel_size to a "
                              "common divisor of 2, or engine vllm (it replicates KV heads)")
    assert plan_memory(QWEN3_5_397B_A17B, 64, 2, engine="hf").sharded.engine_bytes < plan_memory(
        QWEN3_5_397B_A17B, 64, 1).replica.engine_bytes / 2 + 2**31  # half the engine, plus the replicated small tensors


def test_the_fit_check_takes_the_split_engine_at_t_above_1():
    from mlperf_grpo.plan.memory import check_fits

    config = planner_config(CONFIGS["llama-gqa-bias"])
    plan = plan_memory(config, 2, 2, "float32", engine="hf")
    r, s = plan.replica, plan.sharded
    planned = r.master_weights_bytes + r.gradient_bytes + r.adam_bytes + s.engine_bytes
    check_fits(plan, planned)
    with pytest.raises(MemoryPlanError, match=f"planned {planned:,} bytes"):
        check_fits(plan, planned - 1)


def test_a_small_size_in_a_refusal_never_reads_0_0():
    """Sizes under 0.05 GiB read "0.0 GiB" in the refusal lines (a tiny model's planned
    bytes): below it they are in MiB, below 0.05 MiB in bytes."""
    from mlperf_grpo.plan.memory import check_fits, size_text

    assert [size_text(n) for n in (0, 52_428, 52_429, 53_687_091, 53_687_092, 3 << 30)] == [
        "0 bytes", "52,428 bytes", "0.1 MiB", "51.2 MiB", "0.1 GiB", "3.0 GiB"]
    plan = plan_memory(planner_config(CONFIGS["llama-gqa-bias"]), 1, 1, "float32")
    planned = memory_plan.static_device_bytes(plan)
    with pytest.raises(MemoryPlanError) as err:
        check_fits(plan, planned - 1)
    assert f"({planned / 2**20:.1f} MiB: fp32 weights" in str(err.value) and "0.0" not in str(err.value)


def test_a_small_size_in_a_plan_table_never_reads_0_0():
    """A tiny model's ``plan --memory`` table: a nonzero cell under 0.05 GiB has its unit
    (MiB or bytes); a zero cell and a large one stay bare GiB."""
    from mlperf_grpo.plan.memory import format_memory_plan, gib_cell

    assert [gib_cell(n) for n in (0, 52_428, 53_687_091, 53_687_092)] == ["0.0", "52,428 bytes", "51.2 MiB", "0.1"]
    table = format_memory_plan(plan_memory(planner_config(CONFIGS["llama-gqa-bias"]), 1, 1, "float32"))
    cells = [c for line in table.splitlines()[2:-1] for c in line[38:].split("  ") if c.strip()]
    assert cells and all(c.strip() == "0.0" or not c.strip().startswith("0.0") for c in cells), table
    assert "MiB" in table, table


@pytest.mark.parametrize("content, named", [
    ("[" * 100_000, "nested too deeply"), ('{"model_type": "llama", "hidden_size": ' + "9" * 400 + "}", "hidden_size is over"),
    ('{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1000000000}', "num_hidden_layers is over 100,000"), ("x" * (16 * 2**20 + 1), "over 16 MiB, not a model config"),
    ('{"model_type": "llama", "hidden_size": 66, "num_attention_heads": 4, "vocab_size": 15, "num_hidden_layers": 2, '
     '"intermediate_size": 8}', "hidden_size 66 is not a multiple of num_attention_heads 4"),
    # accepted before: 3 KV heads planned for 4 heads, a NaN switch read as true, a short layer_types an IndexError
    ('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 3, "vocab_size": 15, '
     '"num_hidden_layers": 2, "intermediate_size": 8}', "num_key_value_heads 3 does not divide num_attention_heads 4"),
    ('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 15, "num_hidden_layers": 2, '
     '"intermediate_size": 8, "tie_word_embeddings": NaN}', "tie_word_embeddings is nan, not true or false"),
    ('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 15, "num_hidden_layers": 2, '
     '"intermediate_size": 8, "attention_bias": "yes"}', "attention_bias is 'yes', not true or false"),
    ('{"model_type": "qwen3_5_moe_text", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 15, '
     '"num_hidden_layers": 2, "layer_types": ["full_attention"]}', "layer_types is not a list of 2 of full_attention"),
    ('{"model_type": "qwen3_5_moe_text", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 15, '
     '"num_hidden_layers": 1, "layer_types": ["sliding_attention"]}', "layer_types is not a list of 1"),
    ('{"model_type": "qwen3_5_moe_text", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 15, '
     '"num_hidden_layers": 1, "linear_num_key_heads": 3, "linear_num_value_heads": 4}',
     "linear_num_key_heads 3 does not divide linear_num_value_heads 4"),
])
def test_a_config_that_is_no_model_config_is_one_line(tmp_path, capsys, content, named):
    """A deep JSON nest (RecursionError), a huge file (a weights file given by mistake:
    read at most 16 MiB), heads that do not divide the width: one line, exit 2."""
    from mlperf_grpo.cli import main

    (tmp_path / "config.json").write_text(content)
    assert main(["plan", "--memory", "--model-config", str(tmp_path), "--world-size", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and named in captured.err, captured.err[:300]


def test_a_tiny_model_s_plan_names_its_parameters_without_0_0():
    from mlperf_grpo.plan.memory import format_memory_plan

    head = format_memory_plan(plan_memory(planner_config(CONFIGS["llama-gqa-bias"]), 1, 1, "float32")).splitlines()[0]
    assert "(0.0e9)" not in head and "e-" not in head and " parameters, " in head, head
    big = format_memory_plan(plan_memory(memory_plan.MODEL_SHAPES["qwen3.5-397b-a17b"], 64, 8)).splitlines()[0]
    assert "parameters (3" in big and "e9)" in big, big


def test_a_fifo_or_a_device_as_model_config_is_one_line(tmp_path, capsys):
    """A FIFO would block the read forever, /dev/zero never ends: refused before reading."""
    import os

    from mlperf_grpo.cli import main

    os.mkfifo(tmp_path / "config.json")
    for given in (tmp_path, "/dev/zero"):
        assert main(["plan", "--memory", "--model-config", str(given), "--world-size", "2"]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1 and "not a regular file" in captured.err


def test_a_saved_config_s_layer_types_are_accepted(tmp_path):
    """transformers writes ``layer_types`` into config.json: Qwen3's with sliding-window layers, Qwen3.5's."""
    import json

    from mlperf_grpo.plan.model_config import load_model_config

    sliding = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                          num_key_value_heads=2, head_dim=32, vocab_size=90, use_sliding_window=True, sliding_window=16,
                          max_window_layers=1)
    for name, hf_config in (("qwen3", sliding),
                            ("qwen3_5_moe", CONFIGS["qwen3_5_moe"])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(hf_config.to_dict()))
        assert len(load_model_config(tmp_path / name)["layer_types"]) == hf_config.num_hidden_layers
    assert "sliding_attention" in load_model_config(tmp_path / "qwen3")["layer_types"]


def test_layer_types_without_a_layer_count_or_with_a_null_interval(tmp_path, capsys):
    """transformers reads ``full_attention_interval`` only where no ``layer_types`` is given:
    a null interval beside them is planned; ``layer_types`` without ``num_hidden_layers``
    names the missing count (not "not a list of 0")."""
    import json

    from mlperf_grpo.cli import main
    from mlperf_grpo.plan.model_config import load_model_config

    data = {**CONFIGS["qwen3_5_moe"].to_dict(), "full_attention_interval": None}
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert {t.name: t.shape for t in model_tensors(load_model_config(tmp_path))} == meta_shapes(CONFIGS["qwen3_5_moe"])
    (tmp_path / "config.json").write_text(json.dumps({**data, "num_hidden_layers": None}))
    assert main(["plan", "--memory", "--model-config", str(tmp_path), "--world-size", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert "layer_types is given but num_hidden_layers is not" in captured.err, captured.err
