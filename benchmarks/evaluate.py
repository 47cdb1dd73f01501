"""Cost of offline evaluation per checkpoint, with 1 and N workers, against the load floor.

    python benchmarks/evaluate.py --device cpu --params 2e6 --checkpoints 3 --workers 2
    python benchmarks/evaluate.py --device cuda --params 1.4e9 --checkpoints 6 --workers 1   # one H200
    python benchmarks/evaluate.py --device cuda --params 1.4e9 --checkpoints 6 --workers 2   # nvidia-h200-x2

Without ``--run`` it makes its own run: a Qwen3-shaped model of about ``--params``
parameters from a ``transformers`` config (random init on ``--device``, the shipped
tokenizer; nothing is downloaded, as ``benchmarks/checkpoint.py``), trained by our
trainer for ``--checkpoints`` steps with a checkpoint after every one (open division,
first eval step 1, one prompt a step, ``model.compile: off``: the training only has to
publish a series),
checkpoints retained. A random model never passes, so every checkpoint is evaluated.
The run is then evaluated twice from the same checkpoints (copies of its log), each
time as a user runs it, in a fresh process that pays its own start-up (imports, engine,
device context, worker launch): ``python -m mlperf_grpo.cli evaluate RUN --workers 1``,
then ``--workers N``. Progress goes to stderr with the seconds each phase took. Prints
one JSON line:

- ``per_checkpoint_s``: the serial run's median time from one ``eval_stop`` to the next
  (the steady cost of one more checkpoint: read wait, refit, validation, commit);
- ``generation_s``, ``refit_s``, ``read_wait_s``: medians over the serial run's
  checkpoints from ``eval/timing.jsonl`` (validation; weights into the engine and
  verified; waiting for the verified read that the prefetch did not hide);
  ``by_checkpoint``: each checkpoint's ``generation_s`` and the engine's counts of its
  validation (``decode_steps``, ``rerun_steps``, ``graph_captures``, ``prefills``,
  ``prefill_ms``: the slot decoder's);
- ``non_generation_s``: the median over the serial run's checkpoints of its
  ``eval_stop``-to-``eval_stop`` gap minus its own ``generation_s`` (paired by step);
- ``load_limit_s``: median over the checkpoints of ``safetensors.torch.load_file`` of
  the same files to the same device, in the same run (after the evaluations, so the
  page cache is as warm as the evaluator found it; on CPU, where ``load_file`` maps the
  file lazily, ``safetensors.torch.load`` of the file's bytes);
- ``workers``, ``serial_s``, ``parallel_s`` (wall time of each evaluation process, from
  its start to its exit), ``speedup`` (``serial_s / parallel_s``); the same from the
  first ``eval_start`` to the last ``eval_stop`` (``serial_eval_s``, ``parallel_eval_s``,
  ``eval_speedup``: start-up left out); ``serial_startup_s``, ``parallel_startup_s``:
  process start to the first ``eval_start``; ``serial_exit_s``, ``parallel_exit_s``: from
  ``eval/summary.json`` written (the evaluation's last act) to the process's exit;
- ``serial_worker`` and ``parallel_per_rank``: each worker's start-up from
  ``eval/startup.jsonl`` (``before_engine_s``: from the process's start to its engine
  build, i.e. imports, lock, series checks and, for a rank, the launch; ``launch_s``: the
  evaluator's launch call to the rank's engine build, i.e. spawn, imports, rendezvous;
  ``engine_s``; ``warm_up_s``) and its checkpoints with median read wait, refit and
  generation seconds; ``before_launch_s``: the N-worker evaluator's start to its launch;
- with ``--top-p-candidates K``, ``candidates``: a third, serial evaluation of another
  copy whose ``config.yaml`` sets ``inference.top_p_candidates: K`` (validation's top-p
  from each row's K largest logits, ``inference/sampling.py``; the default is 64, so
  ``0``, the full-vocabulary sort, is the other arm): its median
  ``generation_s``, ``over_serial`` (that over the serial run's, whose config has the
  default), ``logs_identical`` (against the serial run's log) and its ``by_checkpoint``;
- with ``--prefill-graphs``, ``prefill_graphs``: the same for a copy whose config sets
  ``inference.prefill_graphs: true`` (each bucket of admissions a captured CUDA graph;
  the serial run's prefills are eager);
- ``logs_identical`` (the two logs apart from ``time_ms``), ``setup_s`` (model build and
  training, not measured), and the ratios the goals are judged by (``refit_over_load``,
  ``non_generation_over_load``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import load, load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint import build_model_dir  # noqa: E402  (benchmarks/checkpoint.py)

from mlperf_grpo.cli.parser import parse_args_one_line  # noqa: E402
from mlperf_grpo.config.load import parse_config  # noqa: E402
from mlperf_grpo.config.rundir import RunDir  # noqa: E402
from mlperf_grpo.logs.mllog import PREFIX  # noqa: E402
from mlperf_grpo.model.files import DTYPES  # noqa: E402
from mlperf_grpo.train.trainer import train  # noqa: E402


def make_run(root: Path, args: argparse.Namespace, dtype: str) -> tuple[Path, int]:
    """Train ``args.checkpoints`` steps, a checkpoint after each; returns the run
    directory and the model's parameter count."""
    params = build_model_dir(root / "model", args.params, dtype, args.device)
    progress(f"model of {params} parameters built")
    config = parse_config({
        "model": {"path": str(root / "model"), "dtype": dtype, "device": args.device,
                  "compile": "off"},  # the run only has to publish a series: no compilation to wait for
        "grpo": {"num_prompts_per_step": args.prompts, "micro_batch_size": 16, "max_new_tokens": args.max_new_tokens,
                 "max_steps": args.checkpoints, "first_eval_step": 1},
        "task": {"num_train_tasks": 64},
        "validation": {"num_tasks": args.tasks, "batch_size": args.batch_size},
    })
    run = RunDir(root / "trained")
    train(config, run, "benchmarks/evaluate.py", show_progress=False)
    progress(f"trained {args.checkpoints} steps")
    return run.root, params


_START_S = time.perf_counter()


def progress(what: str) -> None:
    """One stderr line: seconds since the benchmark started, and what is done."""
    print(f"[{time.perf_counter() - _START_S:7.1f} s] {what}", file=sys.stderr, flush=True)


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


def timed_evaluation(run: Path, workers: int, timeout_s: float) -> tuple[float, float]:
    """``mlperf-grpo evaluate RUN --workers N`` in a fresh process, as a user runs it;
    returns (its Unix start time, its wall seconds).

    Raises:
        SystemExit: it failed or ran past ``timeout_s`` (its stderr is printed).
    """
    command = [sys.executable, "-m", "mlperf_grpo.cli", "evaluate", str(run), "--retain-checkpoints",
               "--workers", str(workers)]
    start_unix_s, start_s = time.time(), time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"evaluate --workers {workers} ran past {timeout_s:.0f} s (--eval-timeout-s)") from None
    wall_s = time.perf_counter() - start_s
    if done.returncode not in (0, 3):  # 3: evaluated, no checkpoint passed (a random model)
        sys.stderr.write(done.stderr)
        raise SystemExit(f"evaluate --workers {workers} exited {done.returncode}")
    progress(f"evaluated with {workers} worker(s) in {wall_s:.1f} s")
    return start_unix_s, wall_s


def with_inference(trained: Path, dst: Path, settings: dict, timeout_s: float, serial: Path) -> dict:
    """A serial evaluation of a copy of ``trained`` whose config's ``inference`` section
    also sets ``settings``; its median ``generation_s`` against the ``serial`` run's."""
    run = copy_run(trained, dst)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config.setdefault("inference", {}).update(settings)
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    timed_evaluation(run, 1, timeout_s)
    generation_s = statistics.median(t["generation_s"] for t in timings(run))
    serial_s = statistics.median(t["generation_s"] for t in timings(serial))
    return {"generation_s": generation_s, "over_serial": round(generation_s / serial_s, 4),
            "logs_identical": normalized_log(run) == normalized_log(serial), "by_checkpoint": by_checkpoint(run)}


GENERATION_FIELDS = ("generation_s", "decode_steps", "rerun_steps", "graph_captures", "prefills", "prefill_ms")


def by_checkpoint(run: Path) -> list[dict]:
    """Per evaluated checkpoint, in step order: its ``eval/timing.jsonl`` ``step`` and
    :data:`GENERATION_FIELDS` (the engine's counts where it keeps them)."""
    return [{"step": t["step"], **{k: t[k] for k in GENERATION_FIELDS if k in t}}
            for t in sorted(timings(run), key=lambda t: t["step"])]


def startups(run: Path) -> dict[int, dict]:
    """rank -> its line of ``eval/startup.jsonl``."""
    lines = (run / "eval" / "startup.jsonl").read_text().splitlines()
    return {record["rank"]: record for record in map(json.loads, lines)}


def per_worker(run: Path, process_start_unix_s: float) -> dict[int, dict]:
    """Each worker's start-up split and its checkpoints' median timings."""
    steps = timings(run)
    out = {}
    for rank, startup in sorted(startups(run).items()):
        mine = [t for t in steps if t["rank"] == rank]
        launched = startup["launch_unix_s"]
        out[rank] = {
            "before_engine_s": round(startup["start_unix_s"] - process_start_unix_s, 3),
            **({"launch_s": round(startup["start_unix_s"] - launched, 3)} if launched is not None else {}),
            "engine_s": startup["engine_s"],
            "warm_up_s": startup["warm_up_s"],
            "checkpoints": len(mine),
            **{k: round(statistics.median(t[k] for t in mine), 4) if mine else None
               for k in ("read_wait_s", "refit_s", "generation_s")},
        }
    return out


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


def eval_span_s(run: Path) -> tuple[float, float, float, float]:
    """From a serial run's log and ``eval/timing.jsonl``: (first eval_start to last
    eval_stop, median eval_stop to next eval_stop, median over the checkpoints of that
    gap minus the same checkpoint's generation seconds) in seconds, and the first
    eval_start (Unix s). The second is the steady cost of one more checkpoint, the third
    what of it is not generation (paired by step: generation times vary by seconds from
    checkpoint to checkpoint, so a difference of two medians would not be this)."""
    starts, stops, gbs = {}, {}, None
    for record in normalized_log(run, keep_time=True):
        if not isinstance(record, dict):
            continue
        if record["key"] == "global_batch_size":
            gbs = record["value"]
        elif record["key"] in ("eval_start", "eval_stop"):
            step = record["metadata"]["samples_count"] // gbs
            (starts if record["key"] == "eval_start" else stops)[step] = record["time_ms"] / 1000
    steps = sorted(stops)
    gaps = {b: stops[b] - stops[a] for a, b in zip(steps, steps[1:])} or {steps[0]: stops[steps[0]] - starts[steps[0]]}
    generation = {t["step"]: t["generation_s"] for t in timings(run)}
    non_generation = [gap - generation[step] for step, gap in gaps.items()]
    return stops[steps[-1]] - min(starts.values()), statistics.median(gaps.values()), statistics.median(non_generation), \
        min(starts.values())


def keep_files(run: Path, keep: Path) -> None:
    """Copy the run's MLPerf log and ``eval/`` (results, timings; no weights) to ``keep``."""
    keep.mkdir(parents=True, exist_ok=True)
    if (run / "mlperf.log").is_file():
        shutil.copy(run / "mlperf.log", keep / "mlperf.log")
    if (run / "eval").is_dir():
        shutil.copytree(run / "eval", keep / "eval", dirs_exist_ok=True)


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


def path_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--dir``, ``--run`` or ``--keep`` (one sentence naming the
    fix), or None: the run is made in ``--dir`` (a folder made and removed there proves
    it writable, also for root, whom ``os.access`` never refuses), ``--run``'s
    checkpoints are hard-linked there (one filesystem), and ``--keep`` is made now (its
    files are copied after the evaluations)."""
    if not args.dir.is_dir():
        return f"--dir {args.dir} is not a directory; create it or give another"
    if (why := unwritable(args.dir)) is not None:
        return f"--dir {args.dir}: cannot make a folder there ({why}); give a writable directory"
    if args.run is not None:
        missing = [name for name in ("mlperf.log", "config.yaml", "checkpoints") if not (args.run / name).exists()]
        if missing:
            return (f"--run {args.run} is not a trained run directory (no {', '.join(missing)}); give the output "
                    "of `mlperf-grpo train`, or leave --run out to train one")
        if os.stat(args.run).st_dev != os.stat(args.dir).st_dev:
            return (f"--run {args.run} and --dir {args.dir} are on different filesystems (the checkpoints are "
                    "hard-linked); give a --dir on the run's filesystem")
    if args.keep is not None and (why := unwritable(args.keep, make=True)) is not None:
        return f"--keep {args.keep}: cannot write there ({why}); give a path this user can write to"
    return None


def unwritable(folder: Path, make: bool = False) -> str | None:
    """Why no folder can be made in ``folder`` (the OS's reason), or None: one is made
    and removed (with ``make``, ``folder`` is made first, with its parents)."""
    try:
        if make:
            folder.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".evaluate-bench-probe-", dir=folder))
    except OSError as err:
        return str(err.strerror or err)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--params", type=float, default=2e7, help="model size in parameters (e.g. 1.4e9)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="rollout/checkpoint dtype (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--checkpoints", type=int, default=6, help="checkpoints in the run (training steps)")
    parser.add_argument("--workers", type=int, default=2, help="N of the parallel evaluation")
    parser.add_argument("--tasks", type=int, help="validation tasks, 4 generations each (default: 251 on cuda, 8 on cpu)")
    parser.add_argument("--batch-size", type=int, default=256, help="validation.batch_size")
    parser.add_argument("--prompts", type=int, default=1, help="training prompts per step (16 rollouts each)")
    parser.add_argument("--max-new-tokens", type=int,
                        help="rollout and validation length (default: 256 on cuda, where per-checkpoint validation then "
                             "outweighs a process's start-up as the real benchmark's minutes do; 4 on cpu)")
    parser.add_argument("--run", type=Path, help="evaluate (copies of) this trained run instead of making one")
    parser.add_argument("--dir", type=Path, default=Path("."), help="where the run is made (a real disk)")
    parser.add_argument("--keep", type=Path, help="copy both evaluations' logs and eval/ files into this directory")
    parser.add_argument("--eval-timeout-s", type=float, default=300, help="give up on an evaluation process after this")
    parser.add_argument("--top-p-candidates", type=int,
                        help="also evaluate serially with inference.top_p_candidates K (0: the full-vocabulary sampler)")
    parser.add_argument("--prefill-graphs", action="store_true",
                        help="also evaluate serially with inference.prefill_graphs: true (captured prefills)")
    args = parse_args_one_line(parser)
    at_least_one = {"--checkpoints": args.checkpoints, "--workers": args.workers, "--tasks": args.tasks,
                    "--batch-size": args.batch_size, "--prompts": args.prompts, "--max-new-tokens": args.max_new_tokens}
    bad = [f"{flag} {value}" for flag, value in at_least_one.items() if value is not None and value < 1]
    bad += [f"--top-p-candidates {args.top_p_candidates}"] if (args.top_p_candidates or 0) < 0 else []
    bad += [f"{flag} {value:g}" for flag, value in (("--params", args.params), ("--eval-timeout-s", args.eval_timeout_s))
            if not (math.isfinite(value) and value > 0)]
    if bad:
        parser.exit(2, f"{parser.prog}: error: {', '.join(bad)}: counts must be >= 1 (--top-p-candidates >= 0), "
                       "--params and --eval-timeout-s > 0\n")
    if (problem := path_problem(args)) is not None:
        parser.exit(2, f"{parser.prog}: error: {problem}\n")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: error: --device cuda but no CUDA device is available\n")
    cuda = args.device == "cuda"
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.tasks = args.tasks or (251 if cuda else 8)
    args.max_new_tokens = args.max_new_tokens or (256 if cuda else 4)
    for name in ("MLPERF_MLLOG_FILE", "RETAIN_GRPO_CHECKPOINTS", "DEFERRED_OFFLINE_EVAL"):
        os.environ.pop(name, None)
    root = Path(tempfile.mkdtemp(prefix="evaluate-bench-", dir=args.dir))
    try:
        trained, params = (args.run, None) if args.run else make_run(root, args, dtype)
        setup_s = time.perf_counter() - _START_S
        serial, parallel = copy_run(trained, root / "serial"), copy_run(trained, root / "parallel")
        try:
            serial_start, serial_s = timed_evaluation(serial, 1, args.eval_timeout_s)
            parallel_start, parallel_s = timed_evaluation(parallel, args.workers, args.eval_timeout_s)
        finally:
            for run in (serial, parallel) if args.keep else ():
                keep_files(run, args.keep / run.name)
        serial_exit_s = serial_start + serial_s - (serial / "eval" / "summary.json").stat().st_mtime
        parallel_exit_s = parallel_start + parallel_s - (parallel / "eval" / "summary.json").stat().st_mtime
        load_s = load_limit_s(serial, args.device)
        progress("load limit measured")
        steps = timings(serial)
        serial_by_checkpoint = by_checkpoint(serial)
        identical = normalized_log(serial) == normalized_log(parallel)
        serial_eval_s, per_checkpoint_s, non_generation_s, serial_first_s = eval_span_s(serial)
        parallel_eval_s, _, _, parallel_first_s = eval_span_s(parallel)
        serial_worker = per_worker(serial, serial_start)[0]
        parallel_per_rank = per_worker(parallel, parallel_start)
        launch_unix_s = next(iter(startups(parallel).values()))["launch_unix_s"]
        candidates = None if args.top_p_candidates is None else {"k": args.top_p_candidates, **with_inference(
            trained, root / "candidates", {"top_p_candidates": args.top_p_candidates}, args.eval_timeout_s, serial)}
        prefill_graphs = None if not args.prefill_graphs else with_inference(
            trained, root / "prefill_graphs", {"prefill_graphs": True}, args.eval_timeout_s, serial)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {
        "device": args.device,
        "params": params,
        "dtype": dtype,
        "checkpoints": len(steps),
        "per_checkpoint_s": per_checkpoint_s,
        "non_generation_s": non_generation_s,
        "generation_s": statistics.median(t["generation_s"] for t in steps),
        "by_checkpoint": serial_by_checkpoint,
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
        "serial_exit_s": serial_exit_s,
        "parallel_exit_s": parallel_exit_s,
        "serial_startup_s": serial_first_s - serial_start,
        "parallel_startup_s": parallel_first_s - parallel_start,
        "before_launch_s": None if launch_unix_s is None else launch_unix_s - parallel_start,
        "logs_identical": identical,
        "serial_worker": serial_worker,
        "parallel_per_rank": parallel_per_rank,
        "setup_s": setup_s,
        **({"candidates": candidates} if candidates is not None else {}),
        **({"prefill_graphs": prefill_graphs} if prefill_graphs is not None else {}),
    }
    out["refit_over_load"] = out["refit_s"] / load_s
    out["non_generation_over_load"] = out["non_generation_s"] / load_s
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
