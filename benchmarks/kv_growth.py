"""The slot decoder's KV cache grown with the rows' lengths against one allocated at full length.

    python benchmarks/kv_growth.py [--device cpu|cuda] [--rows R] [--prompt-tokens N] [--new-tokens T]
        [--mean-tokens M] [--budget-fraction F] [--layers N --hidden H | --params P] [--dtype float32|bfloat16]

A Qwen3-shaped model (``generation.qwen3_config``, random init, vocabulary 151,936). R
prompts of N tokens, T new tokens at most, at temperature 1; a row stops at any id below
V / M, about one token in M, so most rows end within a few M tokens and a few run several
times longer (lengths roughly geometric, capped at T). One :class:`SlotDecoder` (CUDA
graphs on CUDA) per arm, each called twice, the second measured:

- ``full``: ``kv_cache_bytes`` that holds every row at full length (N + T columns):
  allocated at once, the cache as it was before it grew;
- ``grown``: one byte less: the cache starts at the first steps' columns and grows with
  the live rows (compacted to the front as rows end); no row is preempted unless the
  live rows outgrow the full-length cache;
- ``bounded``: F of it: where the live rows at a new width do not fit, rows are
  preempted and resumed (recomputed).

Prints ONE JSON line: per arm the wall seconds, tokens per second, the device's peak
allocated memory above the call's start (CUDA ``max_memory_allocated``; on the CPU 0),
the decoder's ``kv_cache_peak_bytes``, ``cache_grows``, ``preempted``,
``graph_captures``, ``decode_steps`` and ``identical`` (the fraction of rows with the full
arm's tokens: 1 for ``grown``, whose batches are the full arm's; ``bounded`` runs rows in
other batches, equal up to float rounding, which at random init's nearly equal
probabilities over 151,936 ids moves some samples); and for ``grown`` and ``bounded`` their ratios to ``full``: peak
(``peak_ratio``, ``kv_peak_ratio``) and tokens per second (``speed_ratio``, the limit:
>= 0.95 for ``grown``).
Bad arguments: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from generation import (
    DTYPES,
    VOCAB_SIZE,
    PeakMemory,
    add_model_arguments,
    bad_input,
    build_model,
    count_params,
    model_config,
)
from mlperf_grpo.cli.parser import parse_args_one_line
from mlperf_grpo.inference.decode import DecodeOptions, SlotDecoder
from mlperf_grpo.inference.slot_state import cache_bytes

SPEED_RATIO_MIN = 0.95


def run_arm(model, prompts: list[list[int]], args: argparse.Namespace, budget: int, eos: list[int]) -> dict:
    """One arm: a decoder with ``budget`` bytes of KV cache, called twice; the second
    call's figures and rows."""
    decoder = SlotDecoder(model, len(prompts), 0, DecodeOptions(cuda_graphs=args.device == "cuda",
                                                                kv_cache_bytes=budget))
    seeds = list(range(len(prompts)))
    call = (prompts, seeds, 1.0, 1.0, args.new_tokens, eos)
    decoder.generate(*call)
    with PeakMemory(args.device) as mem:
        start = time.perf_counter()
        rows = [ids for ids, _ in decoder.generate(*call)]
        if args.device == "cuda":
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
    tokens = sum(len(r) for r in rows)
    figures = {"wall_s": round(wall_s, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall_s, 1),
               "peak_above_start_bytes": mem.peak_above_start_bytes if args.device == "cuda" else 0,
               "kv_cache_peak_bytes": decoder.kv_cache_peak_bytes, "budget_bytes": budget,
               "cache_grows": decoder.cache_grows, "preempted": decoder.preempted,
               "graph_captures": decoder.graph_captures, "decode_steps": decoder.decode_steps}
    decoder.release()
    return {"figures": figures, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--mean-tokens", type=int, default=32, help="about one token in this many ends a row")
    parser.add_argument("--budget-fraction", type=float, default=0.25, help="the bounded arm's share of the full cache")
    add_model_arguments(parser)
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    args = parse_args_one_line(parser)
    if args.device == "cuda" and not torch.cuda.is_available():
        bad_input("--device cuda but no CUDA device is available; use --device cpu")
    if min(args.rows, args.prompt_tokens, args.new_tokens, args.mean_tokens) < 1:
        bad_input("--rows, --prompt-tokens, --new-tokens and --mean-tokens must be >= 1")
    if not 0 < args.budget_fraction < 1:
        bad_input(f"--budget-fraction {args.budget_fraction:g}: must be in (0, 1)")
    config = model_config(args)
    shapes = [(config.num_key_value_heads, config.head_dim)] * config.num_hidden_layers
    columns = -(-(args.prompt_tokens + args.new_tokens) // 64) * 64  # the decoder's key_block, 64
    full_bytes = cache_bytes(shapes, args.rows, columns, DTYPES[args.dtype])
    bounded = int(full_bytes * args.budget_fraction)
    one_row = cache_bytes(shapes, 1, columns, DTYPES[args.dtype])
    if bounded < one_row:  # the decoder would refuse it (KVCacheBudgetError) after the first two arms had run
        bad_input(f"--budget-fraction {args.budget_fraction:g}: {bounded:,} bytes hold no row at full length "
                  f"({one_row:,} bytes): at least {one_row / full_bytes:.3g} for --rows {args.rows}"
                  + (" (and --rows 2 or more: the bounded arm holds fewer rows than all)" if args.rows < 2 else ""))
    model = build_model(config, DTYPES[args.dtype], args.device)
    rng = random.Random(0)
    stop = VOCAB_SIZE // args.mean_tokens
    prompts = [[rng.randrange(stop, VOCAB_SIZE) for _ in range(args.prompt_tokens)] for _ in range(args.rows)]
    eos = list(range(stop))
    arms = {name: run_arm(model, prompts, args, budget, eos) for name, budget in (
        ("full", full_bytes), ("grown", full_bytes - 1), ("bounded", bounded))}
    full = arms["full"]
    out = {"benchmark": "kv_growth", "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "dtype": args.dtype, "params": count_params(config), "layers": config.num_hidden_layers,
           "hidden": config.hidden_size, "rows": args.rows, "prompt_tokens": args.prompt_tokens,
           "new_tokens": args.new_tokens, "mean_tokens": args.mean_tokens, "full_cache_bytes": full_bytes,
           "lengths": {"max": max(map(len, full["rows"])), "median": sorted(map(len, full["rows"]))[args.rows // 2]},
           "torch": torch.__version__}
    for name, arm in arms.items():
        figures = arm["figures"]
        figures["identical"] = round(sum(a == b for a, b in zip(arm["rows"], full["rows"])) / args.rows, 3)
        if name != "full":
            base = full["figures"]
            figures["speed_ratio"] = round(figures["tokens_per_s"] / base["tokens_per_s"], 3)
            figures["kv_peak_ratio"] = round(figures["kv_cache_peak_bytes"] / base["kv_cache_peak_bytes"], 3)
            if base["peak_above_start_bytes"]:
                figures["peak_ratio"] = round(figures["peak_above_start_bytes"] / base["peak_above_start_bytes"], 3)
        out[name] = figures
    out["limits"] = {"grown_speed_ratio_min": SPEED_RATIO_MIN}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
