"""First-time cost of new key lengths in KV-cached generation, per attention kernel set.

    python benchmarks/attention_backends.py --device cuda --params 1.4e9   # one H200
    python benchmarks/attention_backends.py --device cpu --params 2e6      # plumbing

Builds a Qwen3-shaped model (random init, nothing downloaded; ``benchmarks/checkpoint.py``)
in an ``HFEngine`` and, after one warm-up generation, generates ``--rows`` prompts x
``--new-tokens`` twice at prompt widths not used before (every step's key length is new
the first time, seen the second), once with the engine's kernels
(``model/attention.planless_attention``: no cuDNN attention) and once with cuDNN attention allowed
(torch's default set). Each arm has its own widths, so neither warms the other's shapes.

Prints ONE JSON line: per arm ``first_s``, ``repeat_s`` and ``first_time_cost_s``
(``first_s - repeat_s``: plan building and other per-shape start-up); the engine's time
at the cuDNN arm's width once that arm is done (``at_cudnn_width_s``); and the ratios
``engine_repeat_over_cudnn_repeat`` (steady speed at the same width:
``at_cudnn_width_s / cudnn_allowed.repeat_s``) and ``engine_first_over_cudnn_first``
(what a process pays the first time at each length: the first checkpoint of every
evaluator, the training's early rollouts).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint import qwen3_config  # noqa: E402  (benchmarks/checkpoint.py)

from mlperf_grpo.cli.parser import parse_args_one_line  # noqa: E402
from mlperf_grpo.inference import hf  # noqa: E402
from mlperf_grpo.inference.base import SamplingParams  # noqa: E402
from mlperf_grpo.inference.hf import HFEngine  # noqa: E402

def timed_generation(engine: HFEngine, rows: int, width: int, new_tokens: int) -> float:
    """Seconds for ``rows`` prompts of about ``width`` tokens (3 lengths: left padding)."""
    prompts = [[(i * 7 + j) % 1000 + 10 for j in range(width - i % 3)] for i in range(rows)]
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate_ids(prompts, SamplingParams(0.1, 0.95, new_tokens), list(range(rows)))
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--params", type=float, default=2e6, help="model size in parameters (e.g. 1.4e9)")
    parser.add_argument("--rows", type=int, default=256, help="prompts per generation (one engine batch)")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parse_args_one_line(parser)
    if not (args.params > 0 and args.rows >= 1 and args.new_tokens >= 1):
        parser.exit(2, f"{parser.prog}: error: --params must be > 0, --rows and --new-tokens >= 1 (got {args.params:g}, "
                       f"{args.rows}, {args.new_tokens})\n")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: error: --device cuda but no CUDA device is available\n")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(qwen3_config(args.params, 151_669), dtype=dtype)
    engine = HFEngine.from_model(model, batch_size=args.rows)
    timed_generation(engine, args.rows, 40, args.new_tokens)  # kernels loaded, allocator grown
    out: dict = {"device": args.device, "params": sum(p.numel() for p in model.parameters()), "rows": args.rows,
                 "new_tokens": args.new_tokens, "torch": torch.__version__}
    step = args.new_tokens + 40  # widths far enough apart that the arms share no key length
    for name, kernels, width in (("engine", hf.planless_attention, 100),
                                 ("cudnn_allowed", contextlib.nullcontext, 100 + step)):  # torch's default set
        with mock.patch.object(hf, "planless_attention", kernels):
            first_s = timed_generation(engine, args.rows, width, args.new_tokens)
            repeat_s = timed_generation(engine, args.rows, width, args.new_tokens)
        out[name] = {"width": width, "first_s": round(first_s, 4), "repeat_s": round(repeat_s, 4),
                     "first_time_cost_s": round(first_s - repeat_s, 4)}
    same_width_s = timed_generation(engine, args.rows, 100 + step, args.new_tokens)  # no plans to reuse
    out["engine"]["at_cudnn_width_s"] = round(same_width_s, 4)
    out["engine_repeat_over_cudnn_repeat"] = round(same_width_s / out["cudnn_allowed"]["repeat_s"], 4)
    out["engine_first_over_cudnn_first"] = round(out["engine"]["first_s"] / out["cudnn_allowed"]["first_s"], 4)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
