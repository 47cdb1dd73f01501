"""Data-parallel GRPO training: N ranks against 1, the same config, launched with torchrun.

    python benchmarks/distributed.py --device cpu --nproc 2                      # CPU, gloo (smoke)
    python benchmarks/distributed.py --device cuda --nproc 2 --steps 5           # 2 GPUs vs 1 GPU, GBS 1024
    python benchmarks/distributed.py --device cuda --nproc 2 --prompts 16        # the same at GBS 256
    python benchmarks/distributed.py --device cuda --large --nproc 2             # ~8B: does not fit on 1 GPU
    python benchmarks/distributed.py --device cpu --nproc 2 --tensor-parallel-size 2  # the split engine's bytes

Builds a random-init Qwen3-shaped model directory (``benchmarks/checkpoint.py``'s
``build_model_dir``; bfloat16 on CUDA, float32 on CPU), then runs the real trainer
(``mlperf_grpo.train.trainer.train``, FSDP2 under torchrun: ``train/fsdp.py``) in a
worker launched with ``torchrun --standalone --nproc-per-node K`` for K = 1 and K =
``--nproc`` (``--large``: K = ``--nproc`` only), same config, same global batch.

Default config on CUDA: a 1.4B model, GBS 1024 (64 prompts x 16, the largest of the
reference's GBS 256 / 512 / 1024), 64 new tokens, micro-batches of 32 rows, 5 steps,
gradients reduced once a step (``distributed.reshard_every_micro_batch: false``;
``--reshard-every-micro-batch`` for FSDP's default) and AdamW's learning rate 1e-12
(``--learning-rate``): every kernel runs, but the updates round away on the fp32
weights, so the policy and its completion lengths stay as initialised and both runs do
the same work at every step (with a real learning rate the format reward teaches each
run to stop early at its own pace, and the per-step work diverges by more than the
parallelism changes it). Data parallelism only pays where each GPU's share of the work
is throughput-bound: at GBS 256 on 2 GPUs each rank generates 128 rows, and a decode
step of 128 rows takes about as long as one of 256 (latency-bound: measured 2.6 s
against 2.4 s), so halving the rows barely shortens generation. The engine generates
in batches of 256 rows, so from 512 rows per rank on, a rank runs its batches one after
another and 2 ranks halve the number of batches; training (micro-batches one after
another) scales the same way. ``--prompts 16`` measures GBS 256. Measured on 2 H200s
(``--steps 5``): 1 GPU 0.0796 steps/s, 2 GPUs 0.1434, speedup 1.80; about 4 min in all
(model build, 2 x start-up and compilation, 2 x 5 steps). ``--keep DIR`` copies each
run's MLPerf log and torchrun's stderr (e.g. with ``TORCH_LOGS=recompiles``) to ``DIR``;
a progress line with each step's phases goes to stderr after each run.

``--large`` (about 8e9 parameters: 144 GB of fp32 weights, gradients and AdamW moments
plus the bfloat16 engine copy, more than one H200's 141 GB) runs ``--nproc`` ranks only,
GBS 256 and micro-batches of 16 rows, 4 steps: it shows that the model starts and trains
sharded, not how fast. Each rank builds the policy on the meta device, shards it, and
reads only its rows of each tensor from the safetensors files; its engine is filled
from the shards (``train/fsdp.py``): no rank holds the whole fp32 model on the
host or on its GPU (``startup_s_n``). Estimated on 2 H200s (40 layers of hidden size
4096): about 1 min to write the model directory, under 1 min to start, under 1 min of
compilation in the first step, about 15 s a step, and one 16 GB checkpoint at the end:
about 5 min in all.

Reward: ``--task format`` (default) rewards the format of the answer only
(``benchmarks/format_task.py``: the completion is a decimal integer), which a
random-init model earns in about a quarter of its completions; with ``--task
arithmetic`` (the real reward) it earns almost nothing, every advantage, loss and
gradient is exactly 0, and the agreement figures below compare zeros. The timed work
is the same with either.

Prints ONE JSON line:

- ``steps_per_s_1`` / ``steps_per_s_n``: 1 / median ``train_step_time`` of the
  ``tracked_stats`` events (steps 2..N-1: the first is warm-up, the last writes the one
  checkpoint), and ``speedup`` (their ratio; the goal on 2 GPUs is >= 1.7);
- the two runs step for step (identical up to the reduction order in fp32 on CPU;
  bfloat16 compute on CUDA, where batches of other shapes may also sample other tokens):
  ``max_grad_norm_rel_diff`` over the steps whose gradient norm is not 0 in both runs
  (null when there is none: zero gradients agree trivially), ``max_loss_rel_diff``
  likewise over the steps whose 1-rank loss is not 0, ``max_loss_abs_diff``,
  ``nonzero_grad_steps`` (steps with a non-zero gradient in both runs), and
  ``same_rollouts_steps`` (steps whose mean reward and valid-token count are equal in
  both: the same completions were trained on, so a difference is training numerics);
- ``phases_s_1`` / ``phases_s_n``: median seconds of the steps' generation (and the part
  of it the step waited for), policy training (loss passes and optimizer step) and
  weight sync (refit of the engine), from the same events;
- ``startup_s_1`` / ``startup_s_n``: launch to ``run_start`` (model loading, sharding,
  engine, staging buffers); ``build_model_s``: writing the random-init model directory;
- ``peak_memory_bytes_per_rank``: ``torch.cuda.max_memory_allocated`` of each rank (the
  process's peak RSS on CPU);
- ``planned_bytes_per_rank_n`` (and ``planned_bytes_per_rank_1``): the memory planner's
  figures for the same model and layout (``mlperf_grpo.plan.memory``, today's replica
  engine: ``device_bytes``, its parts, and rank 0's host ``staging_bytes``), beside the
  measured peak: the peak exceeds the planned device bytes by the activations, the KV
  cache and the allocator's slack, which the plan does not count;
- with ``--tensor-parallel-size T`` > 1 (no training run: this build's trainer refuses
  T > 1 until every rank writes its share of a checkpoint) each of the ``--nproc`` ranks
  builds the sharded policy and its engine split over its group of T
  (``train/engine_setup.engine_from_policy``), generates its group's prompts and refits
  once; the line gives ``total_weight_bytes`` (the model's rollout-dtype bytes, tied
  tensors once), per rank ``engine_bytes`` (the bytes of the tensors the rank's engine
  holds, measured from them), ``staged_bytes`` (``AsyncCheckpointer.staged_bytes``: this
  rank's K = 2 host staging buffers, measured from them; bound K (total/N + the largest
  tensor)), ``generation_s`` and ``refit_s``,
  beside the planner's ``planned_engine_bytes`` and ``planned_staging_bytes``
  (``memory_plan.plan_memory(..., engine="hf")``, the ``sharded`` layout) and the bound
  ``engine_bytes_bound`` = total / T + the largest tensor;
- with ``--large``: ``one_device_state_bytes`` (the planner's device bytes at 1 rank:
  fp32 weights + gradients + AdamW's two moments, 16 bytes a parameter, plus the bfloat16
  engine copy, 2 bytes a parameter: what one GPU would need before any activation) and
  ``device_memory_bytes``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from mlperf_grpo.cli.parser import parse_args_one_line

sys.path.insert(0, str(Path(__file__).resolve().parent))

LARGE_PARAMS = 8e9
FROZEN_LEARNING_RATE = 1e-12
"""AdamW steps of about this size round away on fp32 weights of magnitude >= 1e-5 (their
ulp is larger): the policy, and so the length of its completions, stays as initialised."""


def worker(config_file: Path, out_dir: Path, result_file: Path) -> None:
    """One torchrun rank: train, then rank 0 writes every rank's peak memory to ``result_file``."""
    import torch
    import torch.distributed as dist

    from mlperf_grpo.config.load import load_config
    from mlperf_grpo.config.rundir import RunDir
    from mlperf_grpo.train import ranks
    from mlperf_grpo.train.trainer import train

    config = load_config(str(config_file))
    with ranks.process_group() as here:
        train(config, RunDir(out_dir), config_filename=config_file.name, show_progress=False)
        if config.model.device == "cuda":
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        peaks = [0] * here.world_size
        dist.all_gather_object(peaks, peak)
        if here.rank == 0:
            result_file.write_text(json.dumps({"peak_memory_bytes_per_rank": peaks}))


def tp_worker(config_file: Path, result_file: Path) -> None:
    """One torchrun rank of the ``--tensor-parallel-size`` figures: the sharded policy, its
    tensor-parallel engine (refit from it), one generation of the group's prompts and one
    refit; rank 0 writes every rank's figures to ``result_file``."""
    import torch.distributed as dist

    from mlperf_grpo.checkpoint import AsyncCheckpointer, RankGroup, engine_checkpoint_weights
    from mlperf_grpo.config.load import load_config
    from mlperf_grpo.inference.base import SamplingParams
    from mlperf_grpo.inference.tensor_parallel import local_tensor
    from mlperf_grpo.tasks import arithmetic
    from mlperf_grpo.train import collectives, ranks
    from mlperf_grpo.train.engine_setup import engine_from_policy
    from mlperf_grpo.train.fsdp import load_sharded_policy, policy_weights
    from mlperf_grpo.train.rollout import generate_rollouts

    config = load_config(str(config_file))
    g = config.grpo
    with ranks.process_group() as here:
        policy = load_sharded_policy(config.model.path, config.model.device, None, False)
        engine = engine_from_policy(config, policy)
        share = ranks.prompt_share(g.num_prompts_per_step, here, engine.tp_size)
        tasks = arithmetic.train_tasks(g.num_prompts_per_step, 251, seed=config.seed)[share]
        start = time.perf_counter()
        generate_rollouts(engine, tasks, g.num_generations_per_prompt,
                          SamplingParams(1.0, 1.0, g.max_new_tokens), config.seed, 1, share.start)
        generation_s = time.perf_counter() - start
        start = time.perf_counter()
        engine.load_weights(policy_weights(policy))
        refit_s = time.perf_counter() - start
        # the checkpoint's host staging buffers of this rank (the trainer's, before run_start)
        checkpointer = AsyncCheckpointer(result_file.parent / "checkpoints", Path(config.model.path),
                                         config.checkpoint.max_in_flight, group=RankGroup.of_process_group())
        checkpointer.prepare(engine_checkpoint_weights(engine))
        staged_bytes = checkpointer.staged_bytes
        checkpointer.finish(record_end=False)
        held = {t.data_ptr(): t for t in engine.weights().values()}.values()  # tied tensors once
        # the same tensors as DTensors (their full shapes), keyed by their local storage
        full = {local_tensor(t).data_ptr(): t for t in engine.model.state_dict().values()}.values()
        figures = {"engine_bytes": sum(t.numel() * t.element_size() for t in held),
                   "total_weight_bytes": sum(t.numel() * t.element_size() for t in full),
                   "largest_tensor_bytes": max(t.numel() * t.element_size() for t in full),
                   "staged_bytes": staged_bytes,
                   "generation_s": round(generation_s, 3), "refit_s": round(refit_s, 3)}
        gathered = [None] * here.world_size
        dist.all_gather_object(gathered, figures)
        collectives.barrier()
        if here.rank == 0:
            result_file.write_text(json.dumps(gathered))


def tensor_parallel_figures(args: argparse.Namespace, dtype: str, params: float, prompts: int) -> dict:
    """The ``--tensor-parallel-size`` line's fields (see the module docstring).

    Raises:
        SystemExit: the torchrun job failed (its stderr's tail is printed).
    """
    from checkpoint import build_model_dir  # benchmarks/checkpoint.py

    from mlperf_grpo.plan import memory as memory_plan
    from mlperf_grpo.plan.model_config import load_model_config

    t = args.tensor_parallel_size
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        n_params = build_model_dir(tmp / "model", params, dtype, vocab_multiple=t)
        config = {"seed": 1, "model": {"path": str(tmp / "model"), "dtype": dtype, "device": args.device},
                  "grpo": {"num_prompts_per_step": prompts, "micro_batch_size": 16, "max_steps": 1, "first_eval_step": 1,
                           "max_new_tokens": args.max_new_tokens or (64 if args.device == "cuda" else 8)},
                  "inference": {"tensor_parallel_size": t}}
        (tmp / "tp.yaml").write_text(yaml.safe_dump(config))
        result = tmp / "tp.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               __file__, "--tp-worker", str(tmp / "tp.yaml"), str(result)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not result.is_file():
            sys.exit(f"torchrun with {args.nproc} ranks failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        ranks = json.loads(result.read_text())
        plan = memory_plan.plan_memory(load_model_config(tmp / "model"), args.nproc, t, dtype, 2, engine="hf")
    total, largest = ranks[0]["total_weight_bytes"], ranks[0]["largest_tensor_bytes"]
    return {"benchmark": "distributed", "device": args.device, "nproc": args.nproc, "tensor_parallel_size": t,
            "params": n_params, "dtype": dtype, "prompts": prompts, "total_weight_bytes": total,
            "engine_bytes": [r["engine_bytes"] for r in ranks], "engine_bytes_bound": total // t + largest,
            "staged_bytes": [r["staged_bytes"] for r in ranks], "staged_bytes_bound": 2 * (total // args.nproc + largest),
            "planned_engine_bytes": plan.sharded.engine_bytes, "planned_staging_bytes": plan.sharded.staging_bytes,
            "generation_s": [r["generation_s"] for r in ranks], "refit_s": [r["refit_s"] for r in ranks]}


def launch(nproc: int, config_file: Path, out_dir: Path) -> dict:
    """Run :func:`worker` under ``torchrun --standalone --nproc-per-node nproc``; returns
    the per-step ``tracked_stats``, the seconds from launch to ``run_start`` and the peak
    memory per rank.

    Raises:
        SystemExit: the run failed (its stderr's tail is printed).
    """
    result = out_dir.with_suffix(".json")
    launch_s = time.time()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           __file__, "--worker", str(config_file), str(out_dir), str(result)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "torchrun.err").write_text(proc.stderr)  # kept with --keep (e.g. TORCH_LOGS output)
    if proc.returncode != 0 or not result.is_file():
        sys.exit(f"torchrun with {nproc} ranks failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    from mlperf_grpo.logs.mllog import read_log

    log = read_log(out_dir / "mlperf.log")
    stats = [e.value for e in log.events if e.key == "tracked_stats"]
    startup_s = log.find("run_start")[0].time_ms / 1000 - launch_s
    steps = [{"step_s": s["train_step_time"], **{k: s[k] for k in PHASES}} for s in stats]
    print(f"{nproc} rank(s): start-up {startup_s:.1f} s, {time.time() - launch_s:.0f} s in all, steps (s): "
          + json.dumps([{k: round(v, 2) for k, v in s.items()} for s in steps]),
          file=sys.stderr, flush=True)  # progress, kept if a later run times out
    return {"stats": stats, "startup_s": round(startup_s, 2), **json.loads(result.read_text())}


def planned_bytes_per_rank(model_dir: Path, nproc: int, dtype: str, max_in_flight: int) -> dict[str, int]:
    """The memory planner's per-rank bytes of today's layout (replica engine) for the
    model in ``model_dir`` on ``nproc`` ranks: ``device_bytes`` and its parts, and
    ``staging_bytes`` (host memory, rank 0)."""
    from mlperf_grpo.plan import memory as memory_plan
    from mlperf_grpo.plan.model_config import load_model_config

    rank = memory_plan.plan_memory(load_model_config(model_dir), nproc, 1, dtype, max_in_flight).replica
    parts = ("master_weights_bytes", "gradient_bytes", "adam_bytes", "engine_bytes", "staging_bytes")
    return {"device_bytes": rank.device_bytes, **{name: getattr(rank, name) for name in parts}}


def steps_per_s(stats: list[dict]) -> float:
    """1 / median step time over the steps past the first (warm-up), before the last (checkpoint)."""
    timed = stats[1:-1] or stats[1:] or stats
    return 1.0 / statistics.median(s["train_step_time"] for s in timed)


PHASES = ("generation_time", "exposed_generation_time", "policy_training_time", "weight_sync_time")


def phases_s(stats: list[dict]) -> dict[str, float]:
    """Median seconds of each phase the ``tracked_stats`` events record, over the timed steps."""
    timed = stats[1:-1] or stats[1:] or stats
    return {name: round(statistics.median(s[name] for s in timed), 4) for name in PHASES}


def _max_rel_diff(pairs: list[tuple[float, float]]) -> float | None:
    """``max |b - a| / |a|`` over the pairs whose ``a`` is not 0; None when there is none."""
    diffs = [abs(b - a) / abs(a) for a, b in pairs if a != 0]
    return max(diffs) if diffs else None


def agreement(one: list[dict], many: list[dict]) -> dict[str, object]:
    """How the N-rank run's ``tracked_stats`` agree with the 1-rank run's, step for step.

    Gradient norms are compared on the steps where both are non-zero: when every group's
    rewards are equal the advantages, losses and gradients are exactly 0 in both runs and
    prove nothing, so such steps are counted apart (null when no step is left). Losses
    are compared relative to the 1-rank loss where it is not 0, and absolutely.

    Returns:
        ``max_grad_norm_rel_diff``, ``max_loss_rel_diff`` (float or None),
        ``max_loss_abs_diff``, ``nonzero_grad_steps``, ``same_rollouts_steps``.
    """
    pairs = list(zip(one, many))
    nonzero = [(a, b) for a, b in pairs if a["grad_norm"] != 0 and b["grad_norm"] != 0]
    return {
        "max_grad_norm_rel_diff": _max_rel_diff([(a["grad_norm"], b["grad_norm"]) for a, b in nonzero]),
        "max_loss_rel_diff": _max_rel_diff([(a["reduced_train_loss"], b["reduced_train_loss"]) for a, b in pairs]),
        "max_loss_abs_diff": max(abs(b["reduced_train_loss"] - a["reduced_train_loss"]) for a, b in pairs),
        "nonzero_grad_steps": len(nonzero),
        "same_rollouts_steps": sum(
            (a["reward"], a["global_valid_toks"]) == (b["reward"], b["global_valid_toks"]) for a, b in pairs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the distributed run (GPUs on cuda)")
    parser.add_argument("--params", type=float, default=None, help="model size (default: 8e9 with --large, else 1.4e9 on cuda, 2e6 on cpu)")
    parser.add_argument("--large", action="store_true", help="a model too large for one device: --nproc ranks only, with its memory figures")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default: 5; 4 with --large)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step, 16 completions each (default: 64 on cuda, i.e. GBS 1024; 16 with --large; 2 on cpu)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="rows per micro-batch per rank (default: 32 on cuda, 16 with --large, 8 on cpu)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="rollout length (default: 64 on cuda, 8 on cpu)")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help="AdamW's (default: 1e-12 on cuda, below every weight's rounding step: the weights stay "
                             "as initialised, so every step does the same work in both runs; else the config's)")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--reshard-every-micro-batch", action="store_true",
                        help="FSDP's default (least memory; always with --large); without it gradients are reduced "
                             "once a step (distributed.reshard_every_micro_batch: false)")
    parser.add_argument("--task", choices=("format", "arithmetic"), default="format",
                        help="reward: format (benchmarks/format_task.py, earned by a random model) or the real arithmetic one")
    parser.add_argument("--keep", type=Path, help="copy each run's MLPerf log and torchrun's stderr into this directory")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="T > 1: the bytes of the hf engine split over groups of T ranks (no training run)")
    parser.add_argument("--worker", nargs=3, metavar=("CONFIG", "OUT", "RESULT"), help=argparse.SUPPRESS)
    parser.add_argument("--tp-worker", nargs=2, metavar=("CONFIG", "RESULT"), help=argparse.SUPPRESS)
    args = parse_args_one_line(parser)
    if args.worker:
        worker(*(Path(p) for p in args.worker))
        return
    if args.tp_worker:
        tp_worker(*(Path(p) for p in args.tp_worker))
        return
    if args.tensor_parallel_size < 1 or args.nproc % args.tensor_parallel_size:
        parser.error(f"--tensor-parallel-size {args.tensor_parallel_size} does not divide --nproc {args.nproc}: "
                     f"use a divisor of {args.nproc}")
    if args.learning_rate is not None and not args.learning_rate > 0:
        parser.error(f"--learning-rate {args.learning_rate}: AdamW's learning rate must be > 0 (e.g. 1e-12 to keep "
                     "the weights as initialised)")
    from checkpoint import build_model_dir  # benchmarks/checkpoint.py

    cuda = args.device == "cuda"
    args.steps = args.steps or (4 if args.large else 5)
    params = args.params or (LARGE_PARAMS if args.large else 1.4e9 if cuda else 2e6)
    dtype = "bfloat16" if cuda else "float32"
    prompts = args.prompts or (16 if args.large else 64 if cuda else 2)
    micro = args.micro_batch_size or (16 if args.large else 32 if cuda else 8)
    lr = args.learning_rate if args.learning_rate is not None else (FROZEN_LEARNING_RATE if cuda and not args.large else None)
    reshard = args.reshard_every_micro_batch or args.large  # --large: gathered weights and gradients would not fit
    if args.tensor_parallel_size > 1:
        print(json.dumps(tensor_parallel_figures(args, dtype, params, prompts)))
        return
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        build_start_s = time.perf_counter()
        n_params = build_model_dir(tmp / "model", params, dtype)
        build_model_s = time.perf_counter() - build_start_s
        task = {"name": "python", "entry_point": "format_task:factory"} if args.task == "format" else {"name": "arithmetic"}
        config = {
            "seed": 1,
            "model": {"path": str(tmp / "model"), "dtype": dtype, "device": args.device,
                      "activation_checkpointing": "on" if args.activation_checkpointing else "off"},
            "grpo": {"num_prompts_per_step": prompts, "micro_batch_size": micro, "micro_batch_tokens": None, "max_steps": args.steps,
                     "first_eval_step": args.steps, "max_new_tokens": args.max_new_tokens or (64 if cuda else 8)},
            "task": task,
            **({"optimizer": {"learning_rate": lr}} if lr is not None else {}),
            "checkpoint": {"max_in_flight": 1},
            "distributed": {"reshard_every_micro_batch": reshard},
        }
        planned = {k: planned_bytes_per_rank(tmp / "model", k, dtype, config["checkpoint"]["max_in_flight"])
                   for k in {1, args.nproc}}
        config_file = tmp / "bench.yaml"
        config_file.write_text(yaml.safe_dump(config))
        runs = [tmp / f"run{args.nproc}"] + ([] if args.large else [tmp / "run1"])
        try:
            many = launch(args.nproc, config_file, runs[0])
            one = None if args.large else launch(1, config_file, runs[1])
        finally:
            for run in runs if args.keep else []:
                keep = args.keep / run.name
                keep.mkdir(parents=True, exist_ok=True)
                for name in ("mlperf.log", "torchrun.err"):
                    if (run / name).is_file():
                        shutil.copy(run / name, keep / name)
    line: dict[str, object] = {
        "benchmark": "distributed",
        "device": args.device,
        "nproc": args.nproc,
        "params": n_params,
        "dtype": dtype,
        "global_batch_size": prompts * 16,
        "micro_batch_size": micro,
        "reshard_every_micro_batch": reshard,
        "learning_rate": lr,
        "steps": args.steps,
        "task": args.task,
        "build_model_s": round(build_model_s, 2),
        "startup_s_n": many["startup_s"],
        "steps_per_s_n": round(steps_per_s(many["stats"]), 4),
        "phases_s_n": phases_s(many["stats"]),
        "peak_memory_bytes_per_rank": many["peak_memory_bytes_per_rank"],
        "planned_bytes_per_rank_n": planned[args.nproc],
    }
    if one is not None:
        line.update({
            "startup_s_1": one["startup_s"],
            "steps_per_s_1": round(steps_per_s(one["stats"]), 4),
            "phases_s_1": phases_s(one["stats"]),
            "speedup": round(steps_per_s(many["stats"]) / steps_per_s(one["stats"]), 3),
            "speedup_goal": 1.7 if args.nproc == 2 else None,
            **agreement(one["stats"], many["stats"]),
            "peak_memory_bytes_1": one["peak_memory_bytes_per_rank"][0],
            "planned_bytes_per_rank_1": planned[1],
        })
    if args.large:
        import torch

        line["one_device_state_bytes"] = planned[1]["device_bytes"]
        line["device_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory if cuda else None
    print(json.dumps(line))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
