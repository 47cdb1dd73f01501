"""Generation at a real vocabulary: our engine against the model's own ``generate``.

    python benchmarks/generation.py [--device cpu|cuda] [--batch B] [--new-tokens T]
        [--layers N --hidden H | --params P] [--dtype float32|bfloat16] [--prompt-tokens N]

Builds a Qwen3-shaped model (``transformers.Qwen3Config``, random init, ``vocab_size``
151,936, nothing downloaded), then generates B prompts x T new tokens twice in the same
process: with ``HFEngine.generate_ids`` (per-row seeded sampling, log-probabilities of
every sampled token) and with the model's own ``generate`` in plain sampling
(temperature 1, top_p 1, top_k off, no log-probabilities). The model has no EOS, so
both arms generate all T tokens. Each arm is warmed up once on a short run first.

Prints ONE JSON line: per arm the wall seconds, tokens per second and peak memory,
absolute and above the start of the call (CUDA: ``torch.cuda.max_memory_allocated``,
whose start is the model's weights; CPU: the process's peak RSS, reset through
``/proc/self/clear_refs``); the ratios engine / plain, the limits they are judged by
(``peak_ratio`` <= 1.2, ``throughput_ratio`` >= 0.9) and, for scale, the bytes a
``[B, T, V]`` float32 logits tensor would take. Bad arguments: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from mlperf_grpo.inference.base import SamplingParams
from mlperf_grpo.inference.hf import HFEngine

VOCAB_SIZE = 151_936  # Qwen3 / Qwen3.5 tokenizers
PEAK_RATIO_MAX = 1.2
THROUGHPUT_RATIO_MIN = 0.9
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def qwen3_config(layers: int, hidden: int) -> Qwen3Config:
    """A Qwen3-shaped config: head_dim 64 (hidden < 256: hidden / 4), GQA with half as
    many KV heads, MLP 3x hidden, tied embeddings, no EOS (generation runs to the limit)."""
    head_dim = 64 if hidden >= 256 else max(hidden // 4, 1)
    heads = max(hidden // head_dim, 1)
    return Qwen3Config(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), head_dim=head_dim,
        max_position_embeddings=65_536, tie_word_embeddings=True, eos_token_id=None, bos_token_id=None,
        pad_token_id=0,
    )


def config_for_params(params: float) -> Qwen3Config:
    """The smallest hidden size (multiple of 256, 16 layers) whose model has at least
    ``params`` parameters."""
    hidden = 256
    while count_params(qwen3_config(16, hidden)) < params:
        hidden += 256
    return qwen3_config(16, hidden)


def count_params(config: Qwen3Config) -> int:
    """Parameters of a Qwen3 model with this config (tied embeddings counted once)."""
    with torch.device("meta"):
        return sum(p.numel() for p in Qwen3ForCausalLM(config).parameters())


def build_model(config: Qwen3Config, dtype: torch.dtype, device: str) -> Qwen3ForCausalLM:
    """Random-init model on ``device`` in ``dtype``, eval mode, without an EOS id."""
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


class PeakMemory:
    """Peak memory of a block: CUDA allocator peak, or on CPU the peak RSS above the RSS
    at entry (VmHWM reset by writing 5 to ``/proc/self/clear_refs``; Linux only)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.peak_bytes = 0
        self.peak_above_start_bytes = 0

    def __enter__(self) -> PeakMemory:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")
            self._start = _status_bytes("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated()
        else:
            self.peak_bytes = _status_bytes("VmHWM")
        self.peak_above_start_bytes = self.peak_bytes - self._start


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def run_engine(engine: HFEngine, prompts: list[list[int]], new_tokens: int) -> int:
    """Our engine; returns the number of tokens generated."""
    seeds = list(range(len(prompts)))
    completions = engine.generate_ids(prompts, SamplingParams(1.0, 1.0, new_tokens), seeds)
    return sum(len(c.token_ids) for c in completions)


def run_plain(model: Qwen3ForCausalLM, prompts: list[list[int]], new_tokens: int) -> int:
    """The model's own ``generate``, plain sampling; returns the number of tokens generated."""
    input_ids = torch.tensor(prompts, device=model.device)
    out = model.generate(
        input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True, temperature=1.0,
        top_p=1.0, top_k=0, max_new_tokens=new_tokens, pad_token_id=0,
    )
    return (out.shape[1] - input_ids.shape[1]) * out.shape[0]


def measure(device: str, fn, *args) -> dict:
    """Wall seconds, tokens/s and peak memory of ``fn(*args)``."""
    with PeakMemory(device) as mem:
        start = time.perf_counter()
        tokens = fn(*args)
        if device == "cuda":
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
    peak = {"peak_bytes": mem.peak_bytes, "peak_above_start_bytes": mem.peak_above_start_bytes}
    return {"wall_s": round(wall_s, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall_s, 1), **peak}


def ratio_or_none(numerator: int, denominator: int) -> float | None:
    """``numerator / denominator`` rounded, or None when the denominator is under 1 MiB
    (RSS peaks that small are within the kernel's lazy RSS accounting)."""
    return round(numerator / denominator, 3) if denominator >= 2**20 else None


def bad_input(message: str) -> None:
    """One line on stderr, exit 2."""
    print(f"generation.py: {message}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--batch", type=int, default=8, help="prompts (rows) per generate call")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--params", type=float, default=None, help="pick --hidden (16 layers) for this many parameters")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        bad_input("--device cuda but no CUDA device is available; use --device cpu")
    if args.device == "cpu" and not Path("/proc/self/clear_refs").exists():
        bad_input("--device cpu measures peak RSS through /proc/self/clear_refs (Linux only); use --device cuda")
    if min(args.batch, args.new_tokens, args.prompt_tokens, args.layers, args.hidden) < 1:
        bad_input("--batch, --new-tokens, --prompt-tokens, --layers and --hidden must be >= 1")

    config = config_for_params(args.params) if args.params else qwen3_config(args.layers, args.hidden)
    model = build_model(config, DTYPES[args.dtype], args.device)
    engine = HFEngine.from_model(model, batch_size=args.batch)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, VOCAB_SIZE) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]

    run_plain(model, prompts, 4)  # warm up kernels and allocator, both arms
    run_engine(engine, prompts, 4)
    plain = measure(args.device, run_plain, model, prompts, args.new_tokens)
    ours = measure(args.device, run_engine, engine, prompts, args.new_tokens)
    expected = args.batch * args.new_tokens
    if plain["tokens"] != expected or ours["tokens"] != expected:
        sys.exit(f"unequal work: plain {plain['tokens']}, engine {ours['tokens']} tokens, expected {expected}")

    peak_ratio = ours["peak_bytes"] / plain["peak_bytes"]
    throughput_ratio = ours["tokens_per_s"] / plain["tokens_per_s"]
    print(json.dumps({
        "benchmark": "generation",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": args.dtype, "batch": args.batch, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "vocab_size": VOCAB_SIZE, "layers": config.num_hidden_layers, "hidden": config.hidden_size,
        "params": count_params(config), "torch": torch.__version__,
        "engine": ours, "plain_generate": plain,
        "peak_ratio": round(peak_ratio, 3),
        "peak_above_start_ratio": ratio_or_none(ours["peak_above_start_bytes"], plain["peak_above_start_bytes"]),
        "throughput_ratio": round(throughput_ratio, 3),
        "limits": {"peak_ratio_max": PEAK_RATIO_MAX, "throughput_ratio_min": THROUGHPUT_RATIO_MIN},
        "within_limits": peak_ratio <= PEAK_RATIO_MAX and throughput_ratio >= THROUGHPUT_RATIO_MIN,
        "full_logits_bytes": expected * VOCAB_SIZE * 4,
    }))


if __name__ == "__main__":
    main()
