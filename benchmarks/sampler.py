"""The decode step's sampler alone: :func:`sample_tokens` (full-vocabulary sort at
top-p < 1) against :func:`sample_tokens_from_candidates` (``torch.topk`` candidates).

    python benchmarks/sampler.py [--device cpu|cuda] [--rows B] [--vocab V] [--std S]
        [--temperature T] [--top-p P] [--candidates K [K ...]] [--dtype bfloat16|float32]

Logits are random normal with standard deviation ``--std`` (a random-init Qwen3 model's
are about 1), rounded to ``--dtype`` (bfloat16 makes equal logits common, so the tie
order is exercised). Prints ONE JSON line per ``K``: milliseconds per call of each
sampler (median of 20 timed calls after 3 warm-ups, device synchronized),
``exact_fraction`` (rows whose nucleus lay within the candidates) and
``same_token_fraction`` (of those rows, the share whose token equals
:func:`sample_tokens`'). Bad arguments: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from mlperf_grpo.cli.parser import parse_args_one_line
from mlperf_grpo.inference.sampling import sample_tokens, sample_tokens_from_candidates

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def time_ms(fn, device: str, calls: int = 20) -> float:
    """Median milliseconds of ``fn()`` over ``calls`` calls after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--std", type=float, default=1.0)
    parser.add_argument("--temperature", type=float, default=0.1)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--candidates", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    args = parse_args_one_line(parser)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("sampler.py: --device cuda but no CUDA device is available", file=sys.stderr)
        sys.exit(2)
    if min(args.rows, args.vocab, *args.candidates) < 1 or not 0 < args.top_p < 1 or args.temperature <= 0:
        print("sampler.py: --rows, --vocab, --candidates must be >= 1, --top-p in (0, 1), --temperature > 0",
              file=sys.stderr)
        sys.exit(2)
    gen = torch.Generator(device=args.device).manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, generator=gen, device=args.device) * args.std).to(DTYPES[args.dtype])
    uniforms = torch.rand(args.rows, 1, generator=gen, device=args.device)
    want, _ = sample_tokens(logits, uniforms, args.temperature, args.top_p)
    full_ms = time_ms(lambda: sample_tokens(logits, uniforms, args.temperature, args.top_p), args.device)
    for k in args.candidates:
        got, _, exact = sample_tokens_from_candidates(logits, uniforms, args.temperature, args.top_p, k)
        same = (got[:, 0] == want[:, 0]) & exact
        print(json.dumps({
            "benchmark": "sampler", "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "rows": args.rows, "vocab": args.vocab, "std": args.std, "dtype": args.dtype,
            "temperature": args.temperature, "top_p": args.top_p, "candidates": k, "torch": torch.__version__,
            "sample_tokens_ms": full_ms,
            "candidates_ms": time_ms(lambda: sample_tokens_from_candidates(
                logits, uniforms, args.temperature, args.top_p, k), args.device),
            "exact_fraction": round(float(exact.float().mean()), 4),
            "same_token_fraction": round(float(same.sum()) / max(1, int(exact.sum())), 4),
        }), flush=True)


if __name__ == "__main__":
    main()
