"""The decoder linears' compute-dtype copies (``train/compute_weights.py``) against autocast's
casts of them, in one run.

    python benchmarks/weight_copies.py [--device cuda] [--model-shape qwen3-1.4b] [--steps 10]
                                       [--micro-batch-size 64]

Trains ``benchmarks/grpo_step.py``'s config (ours alone, every row trained, bfloat16 compute
on cuda) with the optimizer steps alternating: odd steps with the copies off (autocast casts
each weight and each weight's gradient a pass), even steps with them on. Steps 1 and 2 each
compile their arm and are left out. Alternating in one run keeps the machine's drift out of
the comparison.

Prints ONE JSON line: each arm's ``update_s`` (``optimize_step`` seconds per step), their
medians and means, ``ratio`` (the copies' median over autocast's: below 1 is faster) and
``steps_with_copies`` (the steps that got them: none where the model has no decoder linear to copy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from mlperf_grpo.cli.parser import parse_args_one_line
from mlperf_grpo.train import optimize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step import SHAPES, make_qwen3, measure_ours, run_config  # noqa: E402  (benchmarks/grpo_step.py)


def alternating(compute_weights, with_copies: list[int]):
    """``compute_weights`` for even calls, None (autocast's casts) for odd ones; the calls
    (1-based) that got copies are appended to ``with_copies``."""
    calls = [0]

    def pick(policy, dtype):
        calls[0] += 1
        copies = compute_weights(policy, dtype) if calls[0] % 2 == 0 else None
        if copies is not None:
            with_copies.append(calls[0])
        return copies

    return pick


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model-shape", choices=sorted(SHAPES), default="qwen3-tiny")
    parser.add_argument("--steps", type=int, default=10, help="training steps (>= 4: two compile, then pairs)")
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--num-prompts-per-step", type=int, default=16, help="GBS = this x 16")
    args = parse_args_one_line(parser)
    if args.steps < 4 or args.micro_batch_size < 1 or args.num_prompts_per_step < 1:
        parser.exit(2, f"{parser.prog}: error: --steps must be >= 4, --micro-batch-size and "
                       "--num-prompts-per-step >= 1\n")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = str(make_qwen3(args.model_shape, tmp / args.model_shape))
        config = run_config(model, "bfloat16", args.device, 1, args.steps, args.num_prompts_per_step,
                            args.micro_batch_size, compute_dtype="bfloat16", overlong_filtering=False)
        real, with_copies = optimize.compute_weights, []
        optimize.compute_weights = alternating(real, with_copies)
        try:
            steps = measure_ours(config, args.device, tmp)  # steps 2.. (step 1 left out)
        finally:
            optimize.compute_weights = real
    measured = steps[1:]  # from step 3: step k has the copies when k is even
    arms = {"copies": [round(s["update_s"], 4) for k, s in enumerate(measured, start=3) if k % 2 == 0],
            "autocast": [round(s["update_s"], 4) for k, s in enumerate(measured, start=3) if k % 2 == 1]}
    print(json.dumps({
        "benchmark": "weight_copies", "model": args.model_shape, "device": args.device,
        "micro_batch_size": args.micro_batch_size, "global_batch_size": args.num_prompts_per_step * 16,
        "steps_with_copies": with_copies,
        "update_s": arms,
        "median_s": {arm: round(statistics.median(times), 4) for arm, times in arms.items()},
        "mean_s": {arm: round(statistics.fmean(times), 4) for arm, times in arms.items()},
        "ratio": round(statistics.median(arms["copies"]) / statistics.median(arms["autocast"]), 3),
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
