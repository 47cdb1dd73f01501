"""Cost of deferred checkpoints on the training clock, against the hardware's floor.

    python benchmarks/checkpoint.py --device cpu --params 2e7
    python benchmarks/checkpoint.py --device cuda --params 1.4e9 --dir /work/ck   # one H200, bfloat16

Builds a Qwen3-shaped model of about ``--params`` parameters from a ``transformers``
config (random init, the shipped tokenizer; nothing is downloaded), saves it as a local
model directory, and runs our trainer (``mlperf_grpo.train.trainer.train``) twice for
``--steps`` steps: checkpoints off, then a checkpoint after every step. Prints one JSON
line:

- ``weight_bytes``: the rollout-dtype weights one checkpoint stores;
- ``step_s_without`` / ``step_s_with``: median ``block_start`` to ``block_start`` (the
  first step, warm-up, left out);
- ``critical_path_s``: median time the loop is held per checkpoint, measured as the
  issue measured it: ``block_stop`` of a checkpointed step to the next ``block_start``;
- ``back_pressure_wait_s``: the part of it spent waiting for a free staging slot (the
  writes fall behind when a step is shorter than a checkpoint write: then the disk, not
  the staging, sets the pace);
- ``d2h_limit_s``: a pinned device-to-host copy of ``weight_bytes`` (a memcpy on CPU);
- ``publish_s``: median weight-update time to ``step_N/`` visible;
- ``write_limit_s``: one plain (buffered) write + fsync of ``weight_bytes`` to the same
  disk, one stream;
- ``direct_write_limit_s``: the same bytes written from aligned memory with O_DIRECT +
  fsync by the writer's own routine (``checkpoint.direct_io.write_file_image``: the
  aligned prefix in 64 MiB chunks from 4 threads, the tail buffered), alone, no hashing;
  ``null`` where the disk refuses O_DIRECT (then the writer writes buffered too). The
  writer writes shards this way, so ``publish_over_direct_write`` is what the rest of
  the publish (header, hash, fingerprint, index, metadata files, fsyncs, the rename in
  step order, waiting for the previous step) adds to the write itself;
- the ratios the limits are judged by, and ``steady_state_step_ratio_floor``:
  ``max(1, write_s / step_s_without)`` with ``write_s`` the faster of the two limits. A checkpoint after every step means writing
  ``weight_bytes`` per step, so over a long run no design beats this ratio: when a step is
  shorter than a write, the disk sets the pace (the ``max_in_flight`` staging slots only
  absorb the first few checkpoints).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

from mlperf_grpo.checkpoint.direct_io import aligned_empty, write_file_image
from mlperf_grpo.cli.parser import parse_args_one_line
from mlperf_grpo.config.load import parse_config
from mlperf_grpo.config.rundir import RunDir
from mlperf_grpo.logs.mllog import read_log
from mlperf_grpo.model.files import BUILTIN_MODEL_DIR, DTYPES
from mlperf_grpo.train.trainer import train

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def qwen3_config(params: float, vocab_size: int) -> Qwen3Config:
    """A Qwen3-shaped config (head_dim 128, GQA 2:1, MLP 3x hidden, tied embeddings, as
    Qwen3-1.7B; hidden size 4096 from 4e9 parameters on, as Qwen3-8B) with about
    ``params`` parameters; the layer count is solved for (28 at 1.4e9, 40 at 8e9)."""
    hidden = 4096 if params >= 4e9 else 2048 if params >= 1e9 else 1024 if params >= 2e8 else 512
    heads = hidden // 128
    kv_heads = max(1, heads // 2)
    inter = 3 * hidden
    per_layer = hidden * 128 * (2 * heads + 2 * kv_heads) + 3 * hidden * inter + 2 * hidden + 2 * 128
    layers = max(1, round(params / per_layer))
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )


def build_model_dir(directory: Path, params: float, dtype: str, device: str | None = None, vocab_multiple: int = 1) -> int:
    """Save a random-init Qwen3-shaped model with the shipped tokenizer; returns its
    parameter count. The vocabulary is the tokenizer's, rounded up to a multiple of
    ``vocab_multiple`` (a tensor-parallel engine's T must divide it).

    The weights are initialised by ``transformers`` (normal, std ``initializer_range``
    0.02; norms 1), seed 0, on ``device``: by default the GPU when there is one, where an
    8e9-parameter init takes about a second (on the host it takes minutes). The values
    therefore depend on the device's random generator, not only on the seed; they are
    finite, and what they are does not matter for the speed figures. The files are
    written in shards of at most 5 GB, as published checkpoints are, and the model's
    device memory is released before this returns.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR, local_files_only=True)
    torch.manual_seed(0)
    with torch.device(device):
        vocab = -(-len(tokenizer) // vocab_multiple) * vocab_multiple
        model = AutoModelForCausalLM.from_config(qwen3_config(params, vocab), dtype=DTYPES[dtype])
    model.save_pretrained(directory, max_shard_size="5GB")
    for name in TOKENIZER_FILES:
        shutil.copy(BUILTIN_MODEL_DIR / name, directory / name)
    count = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return count


def run_trainer(root: Path, model_dir: Path, args: argparse.Namespace, dtype: str, checkpoints: bool) -> dict:
    """Train ``args.steps`` steps; with ``checkpoints`` one after every step. Returns the
    step times, the loop's hold after each checkpointed step, and publish times (s)."""
    steps = args.steps
    config = parse_config({
        "model": {"path": str(model_dir), "dtype": dtype, "device": args.device},
        "grpo": {"num_prompts_per_step": args.prompts, "micro_batch_size": 16, "max_new_tokens": args.max_new_tokens,
                 "max_steps": steps, "first_eval_step": 1},
        "task": {"num_train_tasks": 64},
        "checkpoint": {"max_in_flight": args.max_in_flight},
    })
    run = RunDir(root / ("with" if checkpoints else "without"))
    inline = None if checkpoints else (lambda step, policy: False)  # no checkpoint written
    result = train(config, run, "benchmarks/checkpoint.py", show_progress=False, inline_eval=inline)
    log = read_log(run.root / "mlperf.log")
    starts = {e.metadata["step"]: e.time_ms / 1000 for e in log.find("block_start")}
    stops = {e.metadata["step"]: e.time_ms / 1000 for e in log.find("block_stop")}
    step_s = [starts[s + 1] - starts[s] for s in range(2, steps)]
    held_s = [starts[s + 1] - stops[s] for s in range(2, steps)]
    publish_s = [t.publish_s for t in result.checkpoint_timings if t.publish_s is not None]
    wait_s = [t.wait_s for t in result.checkpoint_timings if t.step > 2]
    shutil.rmtree(run.root)
    return {"step_s": step_s, "held_s": held_s, "publish_s": publish_s, "wait_s": wait_s or [0.0]}


def d2h_limit_s(weight_bytes: int, device: str) -> float:
    """Best of 3 copies of ``weight_bytes`` from the device into pinned host memory (CPU:
    a memcpy between two host buffers)."""
    src = torch.ones(weight_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty(weight_bytes, dtype=torch.uint8, pin_memory=device == "cuda")
    best = float("inf")
    for _ in range(3):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def write_limit_s(weight_bytes: int, directory: Path) -> float:
    """Best of 2 plain writes + fsync of ``weight_bytes`` (one stream) to ``directory``."""
    data = memoryview(torch.ones(weight_bytes, dtype=torch.uint8).numpy())
    best = float("inf")
    for i in range(2):
        path = directory / f"write_limit_{i}.bin"
        start = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            view = data
            while view:
                view = view[f.write(view):]
            os.fsync(f.fileno())
        best = min(best, time.perf_counter() - start)
        path.unlink()
    return best


def direct_write_limit_s(weight_bytes: int, directory: Path) -> float | None:
    """Best of 2 O_DIRECT writes + fsync of ``weight_bytes`` from aligned memory to
    ``directory``, through the checkpoint writer's own routine; ``None`` where O_DIRECT
    is refused there."""
    image = aligned_empty(weight_bytes, pin=False)
    image.fill_(1)
    best = float("inf")
    for i in range(2):
        path = directory / f"direct_write_limit_{i}.bin"
        start = time.perf_counter()
        f, direct = write_file_image(path, image)
        try:
            os.fsync(f.fileno())
        finally:
            f.close()
        elapsed = time.perf_counter() - start
        path.unlink()
        if not direct:
            return None
        best = min(best, elapsed)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--params", type=float, default=2e7, help="model size in parameters (e.g. 1.4e9)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="rollout/checkpoint dtype (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (the first is warm-up)")
    parser.add_argument("--prompts", type=int, help="prompts per step, 16 completions each (default: 4 on cuda, 1 on cpu)")
    parser.add_argument("--max-new-tokens", type=int, help="rollout length (default: 16 on cuda, 8 on cpu)")
    parser.add_argument("--max-in-flight", type=int, default=2, help="checkpoint.max_in_flight (K)")
    parser.add_argument("--dir", type=Path, default=Path("."), help="where checkpoints are written (a real disk)")
    args = parse_args_one_line(parser)
    cuda = args.device == "cuda"
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.prompts = args.prompts or (4 if cuda else 1)
    args.max_new_tokens = args.max_new_tokens or (16 if cuda else 8)
    os.environ.pop("MLPERF_MLLOG_FILE", None)
    root = Path(tempfile.mkdtemp(prefix="checkpoint-bench-", dir=args.dir))
    try:
        params = build_model_dir(root / "model", args.params, dtype)
        weight_bytes = params * DTYPES[dtype].itemsize
        without = run_trainer(root, root / "model", args, dtype, checkpoints=False)
        with_ = run_trainer(root, root / "model", args, dtype, checkpoints=True)
        d2h_s = d2h_limit_s(weight_bytes, args.device)
        write_s = write_limit_s(weight_bytes, root)
        direct_write_s = direct_write_limit_s(weight_bytes, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {
        "device": args.device,
        "params": params,
        "dtype": dtype,
        "max_in_flight": args.max_in_flight,
        "weight_bytes": weight_bytes,
        "step_s_without": statistics.median(without["step_s"]),
        "step_s_with": statistics.median(with_["step_s"]),
        "critical_path_s": statistics.median(with_["held_s"]),
        "critical_path_s_without": statistics.median(without["held_s"]),
        "back_pressure_wait_s": statistics.median(with_["wait_s"]),
        "d2h_limit_s": d2h_s,
        "publish_s": statistics.median(with_["publish_s"]),
        "write_limit_s": write_s,
        "direct_write_limit_s": direct_write_s,
    }
    out["step_ratio"] = out["step_s_with"] / out["step_s_without"]
    out["critical_path_over_d2h"] = out["critical_path_s"] / out["d2h_limit_s"]
    out["publish_over_write"] = out["publish_s"] / out["write_limit_s"]
    out["publish_over_direct_write"] = out["publish_s"] / direct_write_s if direct_write_s else None
    out["critical_path_over_publish"] = out["critical_path_s"] / out["publish_s"]
    fastest_write_s = min(write_s, direct_write_s or write_s)
    out["steady_state_step_ratio_floor"] = max(1.0, fastest_write_s / out["step_s_without"])
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
