"""model.compile: each decoder layer compiled (torch.compile) gives the eager update."""

import shutil

import pytest
from safetensors import safe_open

from mlperf_grpo.config.load import parse_config
from mlperf_grpo.config.rundir import RunDir
from mlperf_grpo.train import trainer


def _config(compile_policy: str, **model):
    return parse_config({"model": {"compile": compile_policy, **model},
                         "grpo": {"max_steps": 1, "first_eval_step": 1, "num_prompts_per_step": 2,
                                  "micro_batch_size": 8}}, "test")


def test_compile_auto_is_on_only_for_the_cuda_bfloat16_path():
    assert not _config("auto").model.compile_policy  # the CPU calibration runs eager
    assert _config("auto", device="cuda", dtype="bfloat16").model.compile_policy
    assert not _config("auto", device="cuda", dtype="bfloat16", compute_dtype="float32").model.compile_policy
    assert _config("on").model.compile_policy and not _config("off", device="cuda", dtype="bfloat16").model.compile_policy


def test_compile_on_and_off_as_yaml_writes_them_unquoted(tmp_path):
    import yaml

    for text, expected in (("on", True), ("off", False), ("auto", False)):
        data = yaml.safe_load(f"model: {{compile: {text}}}")  # bare on/off: YAML booleans
        assert parse_config(data, "c.yaml").model.compile_policy is expected
    with pytest.raises(Exception, match="'auto', 'on' or 'off'"):
        parse_config({"model": {"compile": "bogus"}}, "c.yaml")


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on the CPU needs a C compiler")
def test_compiled_layers_give_the_eager_step(tmp_path):
    eager = trainer.train(_config("off"), RunDir(tmp_path / "eager"), config_filename="test", show_progress=False)
    compiled = trainer.train(_config("on"), RunDir(tmp_path / "compiled"), config_filename="test", show_progress=False)
    (a,), (b,) = eager.steps, compiled.steps
    assert a.grad_norm > 0
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)  # the same math, other kernels
    assert b.loss == pytest.approx(a.loss, abs=1e-5)
    # the weight names the refit and the checkpoints use are unchanged by compilation
    assert _checkpoint_names(tmp_path / "compiled") == _checkpoint_names(tmp_path / "eager") != set()


def _checkpoint_names(run_dir) -> set[str]:
    names = set()
    for path in (run_dir / "checkpoints" / "step_1").glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            names |= set(f.keys())
    return names


def _qwen3_5_moe_dir(tmp_path):
    """A tiny qwen3_5_moe model directory (hybrid gated delta-net + full attention, MoE
    experts) with the built-in model's tokenizer files (loaded as Qwen3.5's tokenizer class, which
    adds one token: vocabulary 16)."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from mlperf_grpo.model.files import BUILTIN_MODEL_DIR

    config = Qwen3_5MoeTextConfig(
        vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"], bos_token_id=1,
        eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    directory = tmp_path / "qwen3_5_moe"
    Qwen3_5MoeForCausalLM(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUILTIN_MODEL_DIR / name, directory / name)
    return directory


def test_compile_auto_leaves_moe_and_linear_attention_models_eager(tmp_path):
    from mlperf_grpo.model.compile import compile_policy_layers

    directory = str(_qwen3_5_moe_dir(tmp_path))
    compiled, note = compile_policy_layers("auto", True, directory)
    assert not compiled
    assert note == ("model.compile auto: off for this model (mixture-of-experts and linear-attention layers break "
                    "the compiled graph); model.compile: on compiles it anyway")
    assert compile_policy_layers("on", True, directory) == (True, None)
    assert compile_policy_layers("auto", True, "builtin:arithmetic-tiny") == (True, None)
    assert compile_policy_layers("auto", False, directory) == (False, None)


def test_a_qwen3_5_moe_model_trains_with_the_default_config(tmp_path):
    directory = _qwen3_5_moe_dir(tmp_path)
    config = parse_config({"model": {"path": str(directory)},
                           "grpo": {"max_steps": 1, "first_eval_step": 1, "num_prompts_per_step": 2,
                                    "micro_batch_size": 8}}, "test")
    result = trainer.train(config, RunDir(tmp_path / "run"), config_filename="test", show_progress=False)
    (step,) = result.steps  # a random model earns no reward here: advantages, loss and gradient are 0
    assert step.loss == 0.0 and step.grad_norm == 0.0
    assert "model.layers.0.linear_attn.A_log" in _checkpoint_names(tmp_path / "run")  # the step's checkpoint
