"""The hybrid model's engine cache (src/mlperf_grpo/plan/hybrid_cache.py): transformers'
own cache of a tiny qwen3_5_moe, byte for byte, and the tensor-parallel share."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

from mlperf_grpo.plan.hybrid_cache import format_hybrid_cache, hybrid_cache

MOE = dict(hidden_size=32, num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
           linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=4,
           linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=16, vocab_size=64)


def _cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for value in vars(layer).values():
            tensors = value.values() if isinstance(value, dict) else [value]
            total += sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t) and t.dim() > 0)
    return total


@pytest.mark.parametrize("layout", [{"full_attention_interval": 2}, {"layer_types": [
    "linear_attention", "full_attention", "full_attention", "linear_attention", "linear_attention"]}],
    ids=["interval", "layer-types"])
def test_one_row_is_what_transformers_caches(layout):
    config = Qwen3_5MoeTextConfig(**MOE, **layout)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    rows, tokens = 3, 21
    with torch.no_grad():
        cache = model(input_ids=torch.randint(0, 64, (rows, tokens)), use_cache=True).past_key_values
    planned = hybrid_cache(config.to_dict(), 1, 2)
    assert (planned.full_layers, planned.linear_layers) == (2, 3)
    assert _cache_bytes(cache) == rows * planned.row_bytes(tokens)


def test_the_share_of_one_rank():
    config = Qwen3_5MoeTextConfig(**MOE, full_attention_interval=2).to_dict()  # layers 1 and 3 full
    one, two, four = (hybrid_cache(config, t, 2) for t in (1, 2, 4))
    # per token: 2 full layers x (K, V) x 2 KV heads x 8 x 2 bytes; T = 2 splits the KV heads, T = 4 replicates them
    assert (one.per_token, two.per_token, four.per_token) == (128, 64, 64)
    # per row: 3 linear layers x (conv (2 x 4 x 8 + 8 x 4 = 96 channels) x 4 x 2 bytes + recurrent 8 x 8 x 4 x 4 bytes)
    assert one.state == 3 * (96 * 4 * 2 + 8 * 8 * 4 * 4) == 2 * two.state == 4 * four.state


def test_plan_memory_prints_the_benchmark_model_s_cache(capsys):
    import json

    from mlperf_grpo.cli import main

    assert main(["plan", "--memory", "--model-shape", "qwen3.5-397b-a17b", "--world-size", "64",
                 "--tensor-parallel-size", "8", "--trajectory-tokens", "65536", "--json"]) == 0
    cache = json.loads(capsys.readouterr().out)["sequences"]
    # 15 full layers x (K, V) x 1 of 2 KV heads (T = 8) x 256 x 2 bytes; 45 linear layers x (12,288 conv
    # channels / 8 x 4 x 2 bytes + 64 / 8 value heads x 128 x 128 x 4 bytes)
    assert (cache["per_token"], cache["state"]) == (15 * 2 * 256 * 2, 45 * (12288 // 8 * 4 * 2 + 8 * 128 * 128 * 4))
    assert cache["row_bytes"] == 65536 * 15360 + 24_145_920 and cache["all_rows_bytes"] == 4 * cache["row_bytes"]
    assert main(["plan", "--memory", "--model-shape", "qwen3.5-397b-a17b", "--world-size", "64",
                 "--tensor-parallel-size", "8", "--trajectory-tokens", "65536"]) == 0
    text = capsys.readouterr().out
    assert "K/V of 15 full-attention layers" in text and "(15,360 bytes a token)" in text


def test_a_model_of_full_attention_alone_needs_no_linear_attention_keys():
    config = {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 2, "full_attention_interval": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "hidden_size": 32}
    assert hybrid_cache(config, 1, 2) == type(hybrid_cache(config, 1, 2))(2, 0, 2 * 2 * 2 * 8 * 2, 0)


def test_one_layer_of_a_kind_is_named_in_the_singular():
    config = {"model_type": "qwen3_5_moe_text", **MOE, "num_hidden_layers": 2, "full_attention_interval": 2}
    _, text = format_hybrid_cache(config, hybrid_cache(config, 1, 2), tokens=16, rows=1)
    assert "K/V of 1 full-attention layer " in text and "state of 1 linear-attention layer " in text


@pytest.mark.parametrize("key", ["shared_expert_intermediate_size", "linear_value_head_dim", "moe_intermediate_size"])
def test_a_weight_dimension_of_0_is_one_line_exit_2(tmp_path, capsys, key):
    """Before: exit 1, "integer division or modulo by zero" (FSDP's shard arithmetic)."""
    import json

    from mlperf_grpo.cli import main

    config = {"model_type": "qwen3_5_moe_text", **MOE, "max_position_embeddings": 4096, key: 0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", "--memory", "--model-config", str(tmp_path), "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{key} is 0, not a whole number >= 1" in err, err


def test_a_config_json_without_head_dim_or_kv_heads_is_planned_as_transformers_loads_it(tmp_path, capsys):
    """The planner took a missing ``head_dim`` as hidden / heads (4) and missing KV heads
    as the heads (8), Llama's rule; transformers' Qwen3.5 config fills in 256 and 2: the
    cache was planned at 1/32 of what transformers keeps."""
    import json

    from transformers import AutoConfig

    from mlperf_grpo.cli import main

    shape = {k: v for k, v in MOE.items() if k not in ("head_dim", "num_key_value_heads")}
    Qwen3_5MoeTextConfig(**{**shape, "linear_conv_kernel_dim": 3}, full_attention_interval=3).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    for key in ("head_dim", "num_key_value_heads", "layer_types"):  # as a hand-written config.json leaves them out
        saved.pop(key, None)
    saved["full_attention_interval"] = 3
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert main(["plan", "--memory", "--model-config", str(tmp_path), "--world-size", "1",
                 "--trajectory-tokens", "21", "--rows", "3", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["sequences"]
    config = AutoConfig.from_pretrained(tmp_path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():
        cache = model(input_ids=torch.randint(0, 64, (3, 21)), use_cache=True).past_key_values
    assert (planned["full_layers"], planned["linear_layers"]) == (1, 4)
    assert _cache_bytes(cache) == planned["all_rows_bytes"]
