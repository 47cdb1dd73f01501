"""Where a decode step of the slot decoder spends its time, and what its fused kernels and key buckets give.

    python benchmarks/decode_step.py [--device cpu|cuda] [--batch B] [--new-tokens T]
        [--layers N --hidden H | --params P] [--dtype float32|bfloat16] [--key-length K]
        [--variants unfused key_block_256] [--profile-top N]

With no shape option the model is ``--params 1.4e9`` on CUDA (the shape the other GPU
benchmarks use) and 2 layers of hidden 64 on the CPU.

Builds the Qwen3-shaped model of ``benchmarks/generation.py`` (random init, vocabulary
151,936, nothing downloaded) and measures, in one process:

- ``proxy``: the GEMM-only decode proxy of ``generation.py`` (every ``nn.Linear`` on a
  ``[B, in_features]`` input), the floor a step is judged by;
- ``baseline``: ``SlotDecoder`` as the engine runs it (on CUDA: CUDA graphs and the
  fused kernels of ``inference/fused_decode.py``), B prompts x T new tokens, the second
  call timed: ``ms_per_step`` (wall / decode steps), ``tokens_per_s``, ``proxy_ratio``,
  ``fused_kernels`` (the kinds fused);
- ``parts_ms``: pieces of one step timed alone (on CUDA each captured as a CUDA graph
  and replayed 20 times; on CPU 3 calls): the model's forward over B rows and
  ``--key-length`` cache columns (with the output head), the output head alone, and
  the sampler at training's sampling (temperature 1, top_p 1: ``sample_tokens``, the
  definition, and ``sample_tokens_by_blocks``, what the decoder runs, with its fused
  block masses when the decoder fuses), at validation's (temperature 0.1, top_p 0.95)
  and validation's over 64 candidates;
- ``profile``: 8 decode steps of the baseline run eagerly (no graphs, no prefill) under
  ``torch.profiler``: ``kernels_per_step`` and the ``--profile-top`` operators by device
  time (CPU: CPU time), ms per step;
- per ``--variants`` entry, the slot decoder changed as named: ``unfused`` (no fused
  kernels: the model's own eager code in the graphs) and ``key_block_256`` (key-length
  buckets of 256 columns instead of 64: attention reads more unused columns, fewer
  graphs are captured): ``ms_per_step``, ``speedup_vs_baseline``,
  ``identical_completions`` (the fraction of rows with the baseline's tokens: kernels
  that round differently may change a sample) and ``first_call_s`` (compilation and
  captures).

Prints ONE JSON line on stdout (each section also on stderr as it ends, so a run cut
short still shows what it measured). Bad arguments: one line, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation import DTYPES, add_model_arguments, bad_input, build_model, gemm_proxy, model_config  # noqa: E402

from mlperf_grpo.cli.parser import parse_args_one_line  # noqa: E402
from mlperf_grpo.inference import fused_decode, slot_attention  # noqa: E402
from mlperf_grpo.inference.decode import DecodeOptions, SlotDecoder  # noqa: E402
from mlperf_grpo.inference.sampling import sample_tokens, sample_tokens_by_blocks, sample_tokens_from_candidates  # noqa: E402
from mlperf_grpo.inference.slot_state import DecodeCall  # noqa: E402

PROMPT_TOKENS = 32
CUDA_DEFAULT_PARAMS = 1.4e9
"""With ``--device cuda`` and no shape option, the model of ``--params 1.4e9`` (16 layers,
1.65B with the 151,936-id vocabulary: the shape of ``generation.py``'s and the docs' GPU
figures); on the CPU the 2-layer, hidden-64 model."""
REPLAYS = 20
VARIANTS = {"unfused": {"fused_kernels": False}, "key_block_256": {"key_block": 256}}


def synchronize(device: str) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    if device == "cuda":
        torch.cuda.synchronize()


def timed_generate(decoder: SlotDecoder, prompts: list[list[int]], new_tokens: int, device: str) -> tuple[dict, list]:
    """The second of two identical calls (training's sampling, no EOS): wall seconds,
    ms per decode step, tokens/s; the first call's seconds; the rows' token ids."""
    seeds = list(range(len(prompts)))
    start = time.perf_counter()
    decoder.generate(prompts, seeds, 1.0, 1.0, new_tokens, [])
    synchronize(device)
    first = time.perf_counter() - start
    start = time.perf_counter()
    rows = decoder.generate(prompts, seeds, 1.0, 1.0, new_tokens, [])
    synchronize(device)
    wall = time.perf_counter() - start
    return {"wall_s": round(wall, 4), "ms_per_step": round(wall / max(decoder.decode_steps, 1) * 1e3, 3),
            "tokens_per_s": round(len(prompts) * new_tokens / wall, 1), "first_call_s": round(first, 2)}, \
        [ids for ids, _ in rows]


def time_ms(fn: Callable[[], object], device: str) -> float:
    """Milliseconds per call of ``fn``: on CUDA captured once as a CUDA graph (after two
    warm-up calls on a side stream) and replayed :data:`REPLAYS` times between two
    events; on CPU the mean of 3 calls after one."""
    if device != "cuda":
        fn()
        start = time.perf_counter()
        for _ in range(3):
            fn()
        return round((time.perf_counter() - start) / 3 * 1e3, 3)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return round(begin.elapsed_time(end) / REPLAYS, 3)


def parts(model, decoder: SlotDecoder, rows: int, key_length: int, device: str) -> dict:
    """``parts_ms`` (module docstring); ``decoder`` holds a cache from a call of ``rows``
    rows. With the decoder's fused kernels on, each part runs with them."""
    scope = fused_decode.fused if decoder.fused_kernels else contextlib.nullcontext

    def within(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            with scope():
                return fn()
        return run

    def forward() -> torch.Tensor:
        with slot_attention.attention_implementation(model, slot_attention.SLOT_ATTENTION):
            return decoder._decode_logits(rows, key_length)

    def sample(fn: Callable, *args) -> Callable[[], object]:
        return lambda: fn(logits, uniforms, *args)

    with torch.no_grad():
        logits = within(forward)()
        uniforms = torch.rand(rows, 1, device=device)
        hidden = torch.randn(rows, model.config.hidden_size, dtype=model.dtype, device=device)
        return {
            "forward": time_ms(within(forward), device),
            "output_head": time_ms(lambda: model.lm_head(hidden), device),
            "sample_training": time_ms(sample(sample_tokens, 1.0, 1.0), device),
            "sample_training_by_blocks": time_ms(within(
                lambda: sample_tokens_by_blocks(logits, uniforms, 1.0, fused_decode.block_masses_fn())), device),
            "sample_validation": time_ms(sample(sample_tokens, 0.1, 0.95), device),
            "sample_validation_64_candidates": time_ms(sample(sample_tokens_from_candidates, 0.1, 0.95, 64), device),
        }


def profile_step(decoder: SlotDecoder, rows: int, device: str, top: int, steps: int = 8) -> dict:
    """``steps`` eager decode steps of ``decoder`` (which holds a cache from a call of
    ``rows`` rows) under ``torch.profiler``: kernels per step and the ``top`` operators
    (and kernels) by device time, ms per step."""
    from torch.profiler import ProfilerActivity, profile

    call = DecodeCall(1.0, 1.0, decoder.state.uniforms.shape[1], (-1,))
    key_length = decoder.cache.length
    decoder._step_body(call, rows, key_length, exact=True)  # compiled kernels built before the profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.no_grad(), profile(activities=activities) as prof:
        for _ in range(steps):
            decoder._step_body(call, rows, key_length, exact=True)
        synchronize(device)
    field = "device_time_total" if device == "cuda" else "cpu_time_total"
    totals = sorted(((getattr(e, field, 0) or 0, e.key, e.count) for e in prof.key_averages()), reverse=True)
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"steps": steps, "key_length": key_length, "kernels_per_step": round(kernels / steps, 1),
            "top_ms_per_step": [[name[:100], count, round(us / steps / 1e3, 4)] for us, name, count in totals[:top]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--batch", type=int, default=8, help="prompts (rows, slots)")
    parser.add_argument("--new-tokens", type=int, default=16)
    add_model_arguments(parser)
    parser.add_argument("--dtype", choices=list(DTYPES), help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--key-length", type=int, default=256, help="cache columns the timed forward reads")
    parser.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=list(VARIANTS),
                        help="changes of the decoder to measure (default: both; the bare flag: none)")
    parser.add_argument("--profile-top", type=int, default=30, help="operators listed by the profile (0: no profile)")
    args = parse_args_one_line(parser)
    bad = [f"--{name.replace('_', '-')} {value}" for name, value, low in (
        ("batch", args.batch, 1), ("new_tokens", args.new_tokens, 2), ("key_length", args.key_length, 1),
        ("profile_top", args.profile_top, 0)) if value < low]
    if bad:
        bad_input(f"{', '.join(bad)}: sizes must be positive (--new-tokens >= 2: a prefill and a decode step; "
                  "--profile-top >= 0)")
    if args.device == "cuda" and not torch.cuda.is_available():
        bad_input("--device cuda but torch sees no CUDA device; use --device cpu")

    device = args.device
    if device == "cuda" and args.params is None and args.layers is None and args.hidden is None:
        args.params = CUDA_DEFAULT_PARAMS  # the shape the other benchmarks measure on a GPU
    config = model_config(args)
    model = build_model(config, DTYPES[args.dtype or ("bfloat16" if device == "cuda" else "float32")], device)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, config.vocab_size) for _ in range(PROMPT_TOKENS)] for _ in range(args.batch)]
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "params": sum(p.numel() for p in model.parameters()), "hidden": config.hidden_size,
                    "layers": config.num_hidden_layers, "batch": args.batch, "new_tokens": args.new_tokens,
                    "dtype": str(model.dtype).removeprefix("torch."), "torch": torch.__version__}

    def section(name: str, value: object) -> None:
        result[name] = value
        print(json.dumps({name: value}), file=sys.stderr, flush=True)

    section("proxy", gemm_proxy(model, args.batch, device))
    cuda_graphs = device == "cuda"
    decoder = SlotDecoder(model, args.batch, 0, DecodeOptions(cuda_graphs=cuda_graphs))
    baseline, baseline_rows = timed_generate(decoder, prompts, args.new_tokens, device)
    baseline["proxy_ratio"] = round(baseline["tokens_per_s"] / result["proxy"]["tokens_per_s"], 3)
    baseline["fused_kernels"] = decoder.fused_kernels
    section("baseline", baseline)
    key_length = min(args.key_length, decoder.cache.length)
    section("parts_ms", {"key_length": key_length, **parts(model, decoder, args.batch, key_length, device)})
    del decoder
    if args.profile_top:
        eager = SlotDecoder(model, args.batch, 0, DecodeOptions(cuda_graphs=False, fused_kernels=cuda_graphs))
        timed_generate(eager, prompts, 2, device)
        section("profile", profile_step(eager, args.batch, device, args.profile_top))
        del eager
    for name in args.variants:
        decoder = SlotDecoder(model, args.batch, 0, DecodeOptions(cuda_graphs=cuda_graphs,
                              **{"fused_kernels": cuda_graphs, **VARIANTS[name]}))
        figures, rows = timed_generate(decoder, prompts, args.new_tokens, device)
        del decoder
        figures["speedup_vs_baseline"] = round(baseline["ms_per_step"] / figures["ms_per_step"], 3)
        figures["proxy_ratio"] = round(figures["tokens_per_s"] / result["proxy"]["tokens_per_s"], 3)
        figures["identical_completions"] = round(sum(a == b for a, b in zip(rows, baseline_rows)) / args.batch, 3)
        section(name, figures)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
