"""A small ``qwen3_5_moe`` model (gated delta-net linear attention + MoE) trained with the
default config: does the benchmark's model family train, and how long is a step.

    python benchmarks/qwen35_moe_train.py [--device cuda|cpu] [--steps 4] [--shape small|319m]
        [--new-tokens N] [--output DIR]

Builds a random-init ``Qwen3_5MoeForCausalLM`` (``--shape small``: 14.7M parameters,
hidden 256, 4 layers, 3 ``linear_attention`` + 1 ``full_attention``; ``319m``: 313.9M,
hidden 1,024, 8 layers, the same 3:1 pattern twice, 16 query / 4 KV heads, expert width
640; both 16 experts, 4 per token; the built-in tokenizer, nothing downloaded), saves it
in bfloat16, then runs ``mlperf-grpo train`` (``cli.main``) on it with ``model: {device,
dtype: bfloat16}``, ``grpo.max_new_tokens: --new-tokens`` (default 6, the config's) and
every other key at its default (``model.compile: auto``, GBS 256), ``--steps`` steps.
Prints the
command's exit code and ONE JSON line: ``step_s``, the seconds between consecutive
``block_stop`` lines of its MLPerf log (the first from ``run_start``). A refusal (fla-core
where its backward is wrong, README "Guarantees") is the CLI's one line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import tempfile
from pathlib import Path

import torch
import yaml
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from mlperf_grpo.cli import app as cli
from mlperf_grpo.cli.parser import parse_args_one_line
from mlperf_grpo.logs.mllog import read_log
from mlperf_grpo.model.files import BUILTIN_MODEL_DIR

SHAPES = {
    "small": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
              "linear_num_key_heads": 4, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
              "linear_value_head_dim": 64, "layer_types": ["linear_attention"] * 3 + ["full_attention"]},
    "319m": {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
             "head_dim": 128, "moe_intermediate_size": 640, "shared_expert_intermediate_size": 640,
             "linear_num_key_heads": 8, "linear_num_value_heads": 8, "linear_key_head_dim": 128,
             "linear_value_head_dim": 128, "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2},
}


def make_model(out: Path, shape: str) -> int:
    """The model directory of :data:`SHAPES` ``[shape]`` at ``out``; returns its parameter count."""
    config = Qwen3_5MoeTextConfig(
        vocab_size=16, num_experts=16, num_experts_per_tok=4, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=True, **SHAPES[shape],
    )  # vocabulary 16: the built-in tokenizer files load as Qwen3.5's tokenizer class, which adds one token
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUILTIN_MODEL_DIR / name, out / name)
    return sum(p.numel() for p in model.parameters())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--new-tokens", type=int, default=None, help="grpo.max_new_tokens (default: the config's)")
    parser.add_argument("--output", type=Path, default=None, help="run directory (default: a temporary one)")
    args = parse_args_one_line(parser)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, config = Path(tmp) / "model", Path(tmp) / "run.yaml"
        params = make_model(model_dir, args.shape)
        grpo = {"max_steps": args.steps, "first_eval_step": args.steps}
        if args.new_tokens is not None:
            grpo["max_new_tokens"] = args.new_tokens
        config.write_text(yaml.safe_dump({"model": {"path": str(model_dir), "device": args.device, "dtype": "bfloat16"},
                                          "grpo": grpo}))
        output = args.output or Path(tmp) / "run"
        rc = cli.main(["train", "--config", str(config), "--output", str(output)])
        if rc != 0:
            return rc
        times = [e.time_ms for e in read_log(output / "mlperf.log").events if e.key in ("run_start", "block_stop")]
    step_s = [round((b - a) / 1000, 3) for a, b in zip(times, times[1:])]
    print(json.dumps({"benchmark": "qwen35_moe_train", "device": args.device, "shape": args.shape, "params": params,
                      "new_tokens": args.new_tokens, "step_s": step_s, "torch": torch.__version__,
                      "fla_core": _version("fla-core"), "triton": _version("triton")}))
    return 0


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
