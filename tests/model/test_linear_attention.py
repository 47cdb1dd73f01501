"""fla-core (the gated delta-net kernels) is refused before a run where its backward is
wrong: Triton >= 3.4.0 and < 3.7.1 on a Hopper GPU (flash-linear-attention #640)."""

import yaml
from test_compile import _qwen3_5_moe_dir

from mlperf_grpo.cli import app as cli
from mlperf_grpo.model import linear_attention
from mlperf_grpo.model.linear_attention import fla_refusal
from mlperf_grpo.train import inputs


def test_fla_is_refused_only_on_hopper_with_the_triton_releases_that_break_it():
    assert fla_refusal((9, 0), "3.6.0", "0.6.0").startswith("fla-core 0.6.0 (flash-linear-attention) with Triton 3.6.0")
    assert fla_refusal((9, 0), "3.4.0", "0.3.2") is not None  # older fla: wrong silently, refused too
    assert fla_refusal((9, 0), "3.7.1", "0.6.0") is None
    assert fla_refusal((9, 0), "3.3.1", "0.6.0") is None
    assert fla_refusal((10, 0), "3.6.0", "0.6.0") is None  # Blackwell
    assert fla_refusal((9, 0), "3.6.0", None) is None  # not installed: transformers' PyTorch fallback
    assert fla_refusal(None, "3.6.0", "0.6.0") is None


def test_train_with_fla_on_a_bad_hopper_setup_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    model = _qwen3_5_moe_dir(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": str(model), "device": "cuda", "dtype": "bfloat16"}}))
    monkeypatch.setattr(inputs, "check_device", lambda device: None)  # this machine has no GPU: a Hopper one
    monkeypatch.setattr(linear_attention, "_cuda_capability", lambda: (9, 0))
    monkeypatch.setattr(linear_attention, "_version", {"triton": "3.6.0", "fla-core": "0.6.0"}.get)
    output = tmp_path / "run"
    capsys.readouterr()  # the fixture's save_pretrained progress bar
    assert cli.main(["train", "--config", str(config), "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mlperf-grpo: error: model.path ")
    assert "install Triton >= 3.7.1, or uninstall fla-core" in err
    assert not output.exists()  # refused before anything is written
