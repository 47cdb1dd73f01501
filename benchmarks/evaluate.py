"""Cost of offline evaluation per checkpoint, with 1 and N workers, against the load floor.

    python benchmarks/evaluate.py --device cpu --params 2e7 --checkpoints 3 --workers 2
    python benchmarks/evaluate.py --device cuda --params 1.4e9 --checkpoints 6 --workers 1   # one H200
    python benchmarks/evaluate.py --device cuda --params 1.4e9 --checkpoints 6 --workers 2   # nvidia-h200-x2

Without ``--run`` it makes its own run: a Qwen3-shaped model of about ``--params``
parameters from a ``transformers`` config (random init, the shipped tokenizer; nothing
is downloaded, as ``benchmarks/checkpoint.py``), trained by our trainer for
``--checkpoints`` steps with a checkpoint after every one (open division, first eval
step 1), checkpoints retained. A random model never passes, so every checkpoint is
evaluated. The run is then evaluated twice from the same checkpoints (copies of its log):
``evaluate_run(workers=1)`` and ``evaluate_run(workers=N)``. Prints one JSON line:

- ``per_checkpoint_s``: the serial run's median time from one ``eval_stop`` to the next
  (the steady cost of one more checkpoint: read wait, refit, validation, commit);
- ``generation_s``, ``refit_s``, ``read_wait_s``: medians over the serial run's
  checkpoints from ``eval/timing.jsonl`` (validation; weights into the engine and
  verified; waiting for the verified read that the prefetch did not hide);
- ``non_generation_s``: ``per_checkpoint_s - generation_s``;
- ``load_limit_s``: median over the checkpoints of ``safetensors.torch.load_file`` of
  the same files to the same device, in the same run (after the evaluations, so the
  page cache is as warm as the evaluator found it; on CPU, where ``load_file`` maps the
  file lazily, ``safetensors.torch.load`` of the file's bytes);
- ``workers``, ``serial_s``, ``parallel_s`` (wall time of each ``evaluate_run``, engine
  and worker start included), ``speedup`` (``serial_s / parallel_s``), the same from the
  first ``eval_start`` to the last ``eval_stop`` (``serial_eval_s``, ``parallel_eval_s``,
  ``eval_speedup``: start-up left out),
  ``parallel_per_rank`` (each worker's checkpoints and median read wait, refit and
  generation seconds), ``logs_identical`` (the two logs apart from ``time_ms``), and the ratios the goals
  are judged by (``refit_over_load``, ``non_generation_over_load``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load, load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint import build_model_dir  # noqa: E402  (benchmarks/checkpoint.py)

from mlperf_grpo.config import parse_config  # noqa: E402
from mlperf_grpo.evaluate.offline import evaluate_run  # noqa: E402
from mlperf_grpo.model import DTYPES  # noqa: E402
from mlperf_grpo.mllog import PREFIX  # noqa: E402
from mlperf_grpo.rundir import RunDir  # noqa: E402
from mlperf_grpo.train.loop import train  # noqa: E402


def make_run(root: Path, args: argparse.Namespace, dtype: str) -> tuple[Path, int]:
    """Train ``args.checkpoints`` steps, a checkpoint after each; returns the run
    directory and the model's parameter count."""
    params = build_model_dir(root / "model", args.params, dtype)
    config = parse_config({
        "model": {"path": str(root / "model"), "dtype": dtype, "device": args.device},
        "grpo": {"num_prompts_per_step": args.prompts, "micro_batch_size": 16, "max_new_tokens": args.max_new_tokens,
                 "max_steps": args.checkpoints, "first_eval_step": 1},
        "task": {"num_train_tasks": 64},
        "validation": {"num_tasks": args.tasks, "batch_size": args.batch_size},
    })
    run = RunDir(root / "trained")
    train(config, run, "benchmarks/evaluate.py", show_progress=False)
    return run.root, params


def copy_run(src: Path, dst: Path) -> Path:
    """A copy of the run's log, config and eval state; the checkpoints are hard links
    (read-only for the evaluator; no second copy on disk)."""
    shutil.copytree(src, dst, copy_function=os.link, ignore=shutil.ignore_patterns(".lock", "eval"))
    for name in ("mlperf.log", "run.json", "config.yaml"):
        if (dst / name).exists():
            (dst / name).unlink()
            shutil.copy(src / name, dst / name)
    (dst / "run.json").write_text(json.dumps({"mllog_file": "mlperf.log"}) + "\n")  # relative to the run
    return dst


def timed_evaluation(run: Path, workers: int) -> float:
    start = time.perf_counter()
    evaluate_run(run, retain_checkpoints=True, show_progress=False, workers=workers)
    return time.perf_counter() - start


def timings(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "eval" / "timing.jsonl").read_text().splitlines()]


def normalized_log(run: Path, keep_time: bool = False) -> list:
    out = []
    for line in (run / "mlperf.log").read_text().splitlines():
        record = json.loads(line.split(PREFIX, 1)[1]) if PREFIX in line else line
        if isinstance(record, dict) and not keep_time:
            record.pop("time_ms", None)
        out.append(record)
    return out


def eval_span_s(run: Path) -> tuple[float, float]:
    """From the log: (first eval_start to last eval_stop, median eval_stop to next
    eval_stop) in seconds; the second is the steady cost of one more checkpoint."""
    starts, stops = [], []
    for record in normalized_log(run, keep_time=True):
        if isinstance(record, dict) and record["key"] in ("eval_start", "eval_stop"):
            (starts if record["key"] == "eval_start" else stops).append(record["time_ms"] / 1000)
    gaps = [b - a for a, b in zip(stops, stops[1:])] or [stops[-1] - starts[0]]
    return stops[-1] - starts[0], statistics.median(gaps)


def load_limit_s(run: Path, device: str) -> float:
    """Median over the checkpoints of ``load_file`` of every shard to ``device``."""
    per_checkpoint = []
    for step_dir in sorted((run / "checkpoints").glob("step_*")):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        if device == "cuda":
            tensors = [load_file(str(path), device=device) for path in sorted(step_dir.glob("*.safetensors"))]
        else:  # load_file on CPU maps the file lazily: read it, as the evaluator must
            tensors = [load(path.read_bytes()) for path in sorted(step_dir.glob("*.safetensors"))]
        if device == "cuda":
            torch.cuda.synchronize()
        per_checkpoint.append(time.perf_counter() - start)
        del tensors
    return statistics.median(per_checkpoint)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--params", type=float, default=2e7, help="model size in parameters (e.g. 1.4e9)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="rollout/checkpoint dtype (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--checkpoints", type=int, default=6, help="checkpoints in the run (training steps)")
    parser.add_argument("--workers", type=int, default=2, help="N of the parallel evaluation")
    parser.add_argument("--tasks", type=int, help="validation tasks, 4 generations each (default: 251 on cuda, 8 on cpu)")
    parser.add_argument("--batch-size", type=int, default=256, help="validation.batch_size")
    parser.add_argument("--prompts", type=int, help="training prompts per step (default: 4 on cuda, 1 on cpu)")
    parser.add_argument("--max-new-tokens", type=int, help="rollout and validation length (default: 16 on cuda, 4 on cpu)")
    parser.add_argument("--run", type=Path, help="evaluate (copies of) this trained run instead of making one")
    parser.add_argument("--dir", type=Path, default=Path("."), help="where the run is made (a real disk)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.tasks = args.tasks or (251 if cuda else 8)
    args.prompts = args.prompts or (4 if cuda else 1)
    args.max_new_tokens = args.max_new_tokens or (16 if cuda else 4)
    os.environ.pop("MLPERF_MLLOG_FILE", None)
    os.environ.pop("RETAIN_GRPO_CHECKPOINTS", None)
    root = Path(tempfile.mkdtemp(prefix="evaluate-bench-", dir=args.dir))
    try:
        trained, params = (args.run, None) if args.run else make_run(root, args, dtype)
        serial, parallel = copy_run(trained, root / "serial"), copy_run(trained, root / "parallel")
        serial_s = timed_evaluation(serial, 1)
        parallel_s = timed_evaluation(parallel, args.workers)
        load_s = load_limit_s(serial, args.device)
        steps, parallel_steps = timings(serial), timings(parallel)
        identical = normalized_log(serial) == normalized_log(parallel)
        (serial_eval_s, per_checkpoint_s), (parallel_eval_s, _) = eval_span_s(serial), eval_span_s(parallel)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    count = len(steps)
    out = {
        "device": args.device,
        "params": params,
        "dtype": dtype,
        "checkpoints": count,
        "per_checkpoint_s": per_checkpoint_s,
        "generation_s": statistics.median(t["generation_s"] for t in steps),
        "refit_s": statistics.median(t["refit_s"] for t in steps),
        "read_wait_s": statistics.median(t["read_wait_s"] for t in steps),
        "load_limit_s": load_s,
        "workers": args.workers,
        "serial_s": serial_s,
        "parallel_s": parallel_s,
        "speedup": serial_s / parallel_s,
        "serial_eval_s": serial_eval_s,
        "parallel_eval_s": parallel_eval_s,
        "eval_speedup": serial_eval_s / parallel_eval_s,
        "logs_identical": identical,
        "parallel_per_rank": {  # checkpoints and median seconds per checkpoint of each worker
            rank: {"checkpoints": len(mine), **{k: round(statistics.median(t[k] for t in mine), 4)
                                                 for k in ("read_wait_s", "refit_s", "generation_s")}}
            for rank in sorted({t["rank"] for t in parallel_steps})
            for mine in [[t for t in parallel_steps if t["rank"] == rank]]
        },
    }
    out["non_generation_s"] = out["per_checkpoint_s"] - out["generation_s"]
    out["refit_over_load"] = out["refit_s"] / load_s
    out["non_generation_over_load"] = out["non_generation_s"] / load_s
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
