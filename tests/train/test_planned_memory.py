"""The trainer's set-up refuses, before anything is written, a layout whose planned
per-rank device bytes exceed the device (CUDA, faked here), and under torchrun a
tensor-parallel size that does not divide (train/inputs.py check_planned_memory)."""

import pytest

from mlperf_grpo.config.load import parse_config
from mlperf_grpo.plan.memory import MemoryPlanError
from mlperf_grpo.train import inputs
from mlperf_grpo.train.memory_fit import StepFit

# the built-in model (assets/arithmetic-tiny): hidden 64, 2 layers, 4 heads of 16 (4 KV),
# MLP 256, vocab 15, tied embeddings; model.dtype float32
PARAMETERS = 15 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 256 + 2 * 64) + 64
PLANNED_ONE_RANK = PARAMETERS * (4 + 4 + 8) + PARAMETERS * 4  # fp32 weights, gradients, 2 moments; fp32 engine


def cuda_config():
    return parse_config({"model": {"device": "cuda"}})


def test_built_in_model_count():
    assert PARAMETERS == 132352  # plan --memory's count for it, by hand above


def test_layout_past_the_device_memory_is_refused(monkeypatch):
    monkeypatch.setattr(inputs, "device_memory_bytes", lambda: PLANNED_ONE_RANK - 1)
    with pytest.raises(MemoryPlanError) as err:
        inputs.check_planned_memory(cuda_config())
    message = str(err.value)
    assert f"planned {PLANNED_ONE_RANK:,} bytes" in message and f"device's {PLANNED_ONE_RANK - 1:,} bytes" in message
    assert "more ranks" in message and "\n" not in message


def _static_check_only(monkeypatch):
    """The layout's static bytes judged alone, at their exact boundary (the sequences'
    check, with its reserve, is train/memory_fit.py's: tests/train/test_memory_fit.py)."""
    monkeypatch.setattr(inputs, "plan_step", lambda config, model, longest, world, device, agentic: StepFit(False))


def test_layout_that_fits_passes(monkeypatch):
    _static_check_only(monkeypatch)
    monkeypatch.setattr(inputs, "device_memory_bytes", lambda: PLANNED_ONE_RANK)
    inputs.check_planned_memory(cuda_config())


def test_a_step_whose_sequences_do_not_fit_is_refused_after_the_layout(monkeypatch):
    # the built-in model's weights fit 1 GiB, but not with the 3 GiB reserve for the context
    monkeypatch.setattr(inputs, "device_memory_bytes", lambda: 1 << 30)
    with pytest.raises(MemoryPlanError, match="the step needs about .* over the device's 1.0 GiB"):
        inputs.check_planned_memory(cuda_config(), longest_prompt=20)
    monkeypatch.setattr(inputs, "device_memory_bytes", lambda: 8 << 30)
    assert not inputs.check_planned_memory(cuda_config(), longest_prompt=20).checkpointing


def test_agent_trajectories_are_planned_at_the_agents_context(monkeypatch):
    # an agent's trajectory (task.name: swe) runs to agent.max_context_tokens, whatever
    # grpo.max_new_tokens (6) says: planned as prompt + 6 tokens, the 65,536-token passes
    # and KV cache rows were not counted (no checkpointing, no bounded cache: an OOM mid-run)
    monkeypatch.setattr(inputs, "device_memory_bytes", lambda: 8 << 30)
    plain = inputs.check_planned_memory(cuda_config(), longest_prompt=20)
    assert plain.verdict.shape.engine_length == 26 and not plain.checkpointing
    agent = inputs.check_planned_memory(cuda_config(), longest_prompt=20, agentic=True)
    shape = agent.verdict.shape
    assert (shape.pass_tokens, shape.engine_length) == (65536, 65536)
    assert agent.checkpointing and agent.verdict.bounded and "activation checkpointing on" in agent.note()
    # under the reserve: refused, naming the agent's knob
    monkeypatch.setattr(inputs, "device_memory_bytes", lambda: 3 << 30)
    with pytest.raises(MemoryPlanError, match="agent.max_context_tokens") as err:
        inputs.check_planned_memory(cuda_config(), longest_prompt=20, agentic=True)
    assert "grpo.max_new_tokens" not in str(err.value)


def test_a_model_type_the_planner_does_not_count_is_said_on_cuda(monkeypatch, tmp_path):
    # a GPT-2: neither its layout nor its sequences are planned; before, nothing said so
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 15, "n_embd": 32}))
    monkeypatch.setattr(inputs, "check_model_path", lambda path: tmp_path)
    monkeypatch.setattr(inputs, "device_memory_bytes", lambda: 80 << 30)
    fit = inputs.check_planned_memory(cuda_config())
    assert fit.verdict is None and not fit.checkpointing and "model_type 'gpt2' are not planned" in fit.note()


def test_cpu_is_not_checked(monkeypatch):
    monkeypatch.setattr(inputs, "device_memory_bytes", lambda: pytest.fail("CPU memory is not checked"))
    inputs.check_planned_memory(parse_config({}))


def test_vllm_engine_is_split_over_its_t(monkeypatch):
    config = parse_config({"model": {"device": "cuda"}, "inference": {"engine": "vllm", "tensor_parallel_size": 2}})
    _static_check_only(monkeypatch)
    monkeypatch.setattr(inputs, "device_memory_bytes", lambda: PLANNED_ONE_RANK - PARAMETERS * 4 // 2)
    inputs.check_planned_memory(config)


@pytest.mark.parametrize("world, t, named", [(2, 4, "world size 2"), (8, 8, "4 attention heads")])
def test_tensor_parallel_size_is_checked_under_torchrun(monkeypatch, world, t, named):
    monkeypatch.setattr(inputs.ranks, "launched", lambda: True)
    monkeypatch.setattr(inputs.ranks, "layout", lambda: inputs.ranks.Layout(0, world))
    with pytest.raises(MemoryPlanError, match=named):
        inputs.check_planned_memory(parse_config({"inference": {"tensor_parallel_size": t}}))


def test_tensor_parallel_size_that_divides_passes_under_torchrun(monkeypatch):
    monkeypatch.setattr(inputs.ranks, "launched", lambda: True)
    monkeypatch.setattr(inputs.ranks, "layout", lambda: inputs.ranks.Layout(0, 4))
    inputs.check_planned_memory(parse_config({"inference": {"engine": "vllm", "tensor_parallel_size": 4}}))


@pytest.mark.parametrize("world, t, refusal", [
    (1, 2, "inference.tensor_parallel_size 2 does not divide the world size 1: set inference.tensor_parallel_size to a "
           "common divisor of the world size and the heads, or launch a multiple of 2 ranks"),
    (4, 4, "inference.tensor_parallel_size 4 does not divide the 15 vocabulary entries (vocab_size): set "
           "inference.tensor_parallel_size to a common divisor of 15"),
])
def test_the_hf_engine_splits_over_the_world_and_the_vocabulary(monkeypatch, world, t, refusal):
    """The tensor-parallel hf engine: T ranks of the world (one process is a world of 1)
    and row-split embeddings (the built-in model's vocabulary of 15 does not split)."""
    monkeypatch.setattr(inputs.ranks, "launched", lambda: world > 1)
    monkeypatch.setattr(inputs.ranks, "layout", lambda: inputs.ranks.Layout(0, world))
    with pytest.raises(MemoryPlanError) as err:
        inputs.check_planned_memory(parse_config({"inference": {"tensor_parallel_size": t}}))
    assert str(err.value) == refusal


def test_train_refuses_a_tensor_parallel_hf_engine_in_one_process(tmp_path, capsys):
    from mlperf_grpo.cli import main

    config = tmp_path / "t2.yaml"
    config.write_text("inference: {tensor_parallel_size: 2}\n")
    assert main(["train", "--config", str(config), "--output", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == (
        "mlperf-grpo: error: inference.tensor_parallel_size 2 does not divide the world size 1: set "
        "inference.tensor_parallel_size to a common divisor of the world size and the heads, or launch a multiple of 2 "
        "ranks\n")
    assert not (tmp_path / "run").exists()  # nothing written
