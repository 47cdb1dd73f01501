"""Host work of one GRPO update on the CPU: the aten operations of each micro-batch pass.

    python benchmarks/update_ops.py [--shape qwen3-tiny] [--compile] [--compute-dtype bfloat16]
                                    [--micro-batch-size 64] [--prompts 16] [--new-tokens 6]

On a GPU the update of ``benchmarks/grpo_step.py``'s default shape is bound by the host
(kernel launches), and launches follow the operations the host dispatches. This runs
:func:`~mlperf_grpo.train.optimize.optimize_step` with the benchmark's settings (the
reference algorithm, GBS = prompts x 16, 6-token completions after 12-16-token prompts,
the policy's own log-probs as the rollout's) on a random-init Qwen3 of ``--shape`` on the
CPU, twice, and profiles the second (``torch.profiler``, CPU activity). ``--compile``
compiles the policy as the trainer does (``model/compile.py``, the loss:
``OptimizeSettings.compile_loss``); each C++ kernel of a compiled graph counts as one
launch (``torch._inductor.config.cpp.enable_kernel_profile``), as each fused kernel is
one on a GPU (where their number differs somewhat), and the eager policy is measured
after it as the baseline.

Prints ONE JSON line: per ``micro_batch`` pass and for the whole update, ``aten_ops``
(every aten operation dispatched, nested ones included) and ``compute_ops`` (what would
launch a kernel: leaf operations that compute, no views or allocations; a ``_foreach_``
operation counts once; a compiled graph's kernels), the update's wall seconds (2 shared
cores: only indicative), its loss, gradient norm, masked sequences and entropy, and
``compute_ops_per_pass`` over the eager policy's (and over ``--baseline``'s, a line this
script printed for another source tree: ``PYTHONPATH=/other/src``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
import torch._inductor.config

from mlperf_grpo import rules
from mlperf_grpo.model.compile import compile_decoder_layers
from mlperf_grpo.model.load import load_model
from mlperf_grpo.train import optimize
from mlperf_grpo.train.grpo import PGLossOptions
from mlperf_grpo.train.rollout import RolloutBatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step import SHAPES, make_qwen3  # noqa: E402  (benchmarks/grpo_step.py)

NO_KERNEL = {
    "aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::empty", "aten::empty_strided", "aten::t",
    "aten::transpose", "aten::reshape", "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::slice",
    "aten::select", "aten::permute", "aten::detach", "aten::alias", "aten::resolve_conj", "aten::resolve_neg",
    "aten::result_type", "aten::lift_fresh", "aten::empty_like", "aten::contiguous", "aten::numpy_T",
    "aten::to", "aten::_to_copy", "aten::type_as", "aten::split", "aten::chunk", "aten::unbind", "aten::narrow",
    "aten::flatten", "aten::unflatten", "aten::view_as", "aten::_reshape_alias", "aten::expand_as", "aten::movedim",
    "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense", "aten::set_", "aten::squeeze_", "aten::unsqueeze_",
    "aten::as_strided_", "aten::_has_compatible_shallow_copy_type", "aten::size", "aten::stride", "aten::dim",
}
"""Operations that launch no kernel of their own (metadata, allocation, dispatch wrappers)."""


def synthetic_batch(prompts: int, generations: int, new_tokens: int, vocab: int, seed: int = 0) -> RolloutBatch:
    """``prompts x generations`` rows: prompts of 12-16 tokens, ``new_tokens``-token
    completions, random rewards, advantages and generation log-probs near the policy's."""
    g = torch.Generator().manual_seed(seed)
    b = prompts * generations
    prompt_lengths = torch.randint(12, 17, (prompts,), generator=g).repeat_interleave(generations)  # [B]
    width = int(prompt_lengths.max()) + new_tokens
    input_ids = torch.zeros((b, width), dtype=torch.long)
    attention_mask = torch.zeros((b, width), dtype=torch.long)
    completion_mask = torch.zeros((b, width - 1))
    for i, p in enumerate(prompt_lengths.tolist()):
        input_ids[i, :p + new_tokens] = torch.randint(1, vocab, (p + new_tokens,), generator=g)
        attention_mask[i, :p + new_tokens] = 1
        completion_mask[i, p - 1:p - 1 + new_tokens] = 1
    rewards = torch.randint(0, 2, (prompts, generations), generator=g).float()
    advantages = (rewards - rewards.mean(dim=1, keepdim=True)).reshape(-1)
    rollout_logprobs = -torch.rand((b, width - 1), generator=g) * 3 * completion_mask
    return RolloutBatch(input_ids, attention_mask, completion_mask, rollout_logprobs, advantages, rewards, torch.ones(b))


def settings_of(args: argparse.Namespace, compiled: bool) -> optimize.OptimizeSettings:
    """The benchmark's settings: the reference algorithm's loss and filter, bf16 autocast."""
    algo = rules.REFERENCE_ALGORITHM
    extra = {"compile_loss": compiled} if "compile_loss" in optimize.OptimizeSettings.__dataclass_fields__ else {}
    return optimize.OptimizeSettings(
        args.micro_batch_size, 1.0, PGLossOptions(**{k: algo[k] for k in PGLossOptions.__dataclass_fields__}), 1.0,
        algo["seq_logprob_error_threshold"], True, getattr(torch, args.compute_dtype),
        width_multiple=optimize.COMPILED_WIDTH_MULTIPLE if compiled else 1, **extra,
    )


def _launches(ev) -> bool:
    """Whether ``ev`` counts as one launch: a ``_foreach_`` operation (a few fused
    kernels on a GPU, a loop of operations on the CPU, counted once) or a computing leaf
    operation not inside one."""
    parent = ev.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::_foreach_"):
            return False
        parent = parent.cpu_parent
    if ev.name.startswith("aten::_foreach_") or "cpp_fused" in ev.name:  # a compiled graph's own kernel
        return True
    return ev.name not in NO_KERNEL and not any(c.name.startswith("aten::") and c.name not in NO_KERNEL
                                                for c in ev.cpu_children)


def count_ops(prof, top: int = 12) -> dict:
    """Per labelled ``micro_batch`` pass and for the whole profile: aten ops and compute ops."""
    events = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CPU]
    passes = [ev.time_range for ev in events if ev.name == "micro_batch"]
    aten = [ev for ev in events if ev.name.startswith("aten::")]
    leaves = [ev for ev in events if (ev.name.startswith("aten::") or "cpp_fused" in ev.name) and _launches(ev)]

    def inside(evs, ranges):
        return [ev for ev in evs if any(r.start <= ev.time_range.start <= r.end for r in ranges)]

    per_pass_leaves = inside(leaves, passes)
    return {
        "passes": len(passes),
        "aten_ops_per_pass": round(len(inside(aten, passes)) / max(len(passes), 1), 1),
        "compute_ops_per_pass": round(len(per_pass_leaves) / max(len(passes), 1), 1),
        "aten_ops": len(aten),
        "compute_ops": len(leaves),
        "top_compute_ops_per_pass": {name: round(n / max(len(passes), 1), 1) for name, n in
                                     Counter(ev.name for ev in per_pass_leaves).most_common(top)},
    }


def measure(args: argparse.Namespace, model_dir: Path, compiled: bool) -> dict:
    """Two updates of a fresh policy from ``model_dir`` (its own log-probs as the rollout's),
    the second profiled: :func:`count_ops` and the update's figures."""
    policy = load_model(str(model_dir), "float32", "cpu")
    policy.config.use_cache = False
    if compiled:
        torch._inductor.config.cpp.enable_kernel_profile = True  # each fused kernel a profiler event
        compile_decoder_layers(policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    batch = synthetic_batch(args.prompts, rules.NUM_GENERATIONS_PER_PROMPT, args.new_tokens, policy.config.vocab_size)
    with torch.no_grad():  # the rollout's log-probs: the policy's own (importance weights near 1)
        logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
        own = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    batch.rollout_logprobs = own * batch.completion_mask
    settings = settings_of(args, compiled)
    optimize.optimize_step(policy, optimizer, batch, settings)  # warm-up (compiles)
    inner = optimize._micro_batch

    def labelled(*a, **k):
        with torch.profiler.record_function("micro_batch"):
            return inner(*a, **k)

    optimize._micro_batch = labelled
    try:
        start = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            result = optimize.optimize_step(policy, optimizer, batch, settings)
        wall = time.perf_counter() - start
    finally:
        optimize._micro_batch = inner
    return {**count_ops(prof, args.top), "update_wall_s_profiled": round(wall, 3), "loss": result.loss,
            "grad_norm": result.grad_norm, "masked_by_is": result.num_sequences_masked_by_is,
            "masked_by_error": result.num_sequences_masked_by_logprob_error,
            "entropy": getattr(result, "entropy_mean", None)}  # None: a tree before it was reported


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-tiny")
    parser.add_argument("--compile", action="store_true", help="compile the decoder layers as the trainer does")
    parser.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=6)
    parser.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    parser.add_argument("--top", type=int, default=12, help="the most frequent operations a pass listed")
    parser.add_argument("--baseline", type=Path, help="a JSON line this script printed (another tree's): a second ratio")
    args = parser.parse_args()
    torch.manual_seed(0)
    shape = args.shape
    if args.layers:
        shape = f"{args.shape}-{args.layers}-layers"
        SHAPES[shape] = {**SHAPES[args.shape], "num_hidden_layers": args.layers}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_qwen3(shape, Path(tmp) / shape)
        figures = measure(args, model_dir, args.compile)
        eager = measure(args, model_dir, False) if args.compile else figures
    base = json.loads(args.baseline.read_text()) if args.baseline else None
    print(json.dumps({
        "benchmark": "update_ops", "shape": shape, "compile": args.compile, "compute_dtype": args.compute_dtype,
        "micro_batch_size": args.micro_batch_size, "prompts": args.prompts, **figures,
        "eager_compute_ops_per_pass": eager["compute_ops_per_pass"],
        "compute_ops_per_pass_over_eager": round(figures["compute_ops_per_pass"] / eager["compute_ops_per_pass"], 3),
        "compute_ops_per_pass_over_baseline": None if base is None else round(
            figures["compute_ops_per_pass"] / base["compute_ops_per_pass"], 3),
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
