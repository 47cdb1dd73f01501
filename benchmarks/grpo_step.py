"""GRPO step time: ours against TRL's ``GRPOTrainer`` on the same model and batch shape, in one run.

    python benchmarks/grpo_step.py [--steps 6] [--repeat 1] [--device cpu|cuda]
                                   [--max-trajectory-age-steps 0|1] [--compute-dtype auto] [--compile auto|on|off] [--no-trl]
                                   [--model builtin:arithmetic-tiny | --model-shape qwen3-1.4b]
                                   [--decode auto|generate|slots ...] [--max-new-tokens T] [--ignore-eos]
                                   [--also-new-tokens T] [--also-micro-batch-size M] [--also-steps 2]
                                   [--profile-update]

**Ours** trains the built-in arithmetic task with the reference algorithm
(``rules.REFERENCE_ALGORITHM``: clip-higher, forced ratio, IS correction with
``seq-mask-tis``, the prev log-prob pass for the log-prob error filter) through the real
trainer (``train.trainer.train``) at the asked ``max_trajectory_age_steps``, and reads each
step's time from its MLPerf log (``block_stop`` to ``block_stop``; ``train_step_time`` of
the ``tracked_stats`` events leaves out what happens between steps). The phase split reads
the ``tracked_stats`` and wraps the loop's ``optimize_step`` with a timer that waits for
the trainer's CUDA stream only (the rollouts of the next step run on their own):

- ``rollout_s``: time the step waited for its rollouts (exposed generation);
- ``reward_s``: time it then waited for their rewards (exposed scoring: with age 1 they
  are scored on the rollout producer's thread while the previous step trains);
  ``logprob_s``: a separate no-grad prev log-prob
  pass, 0 since the prev log-probs come from the loss pass (``train.optimize.optimize_step``);
- ``update_s``: the loss passes over micro-batches, gradient clip and optimizer step;
- ``refit_s``: engine <- policy; ``other_s``: the rest (advantages, batching, logging).

**TRL** (when ``trl`` is importable): ``trl.GRPOTrainer`` on the same model directory in
the same precision regime as ours: float32 master weights (``--trl-model-dtype``), its
default bf16 mixed precision on CUDA (float32 on CPU, as ours), gradient checkpointing
off (its default is on; it only saves memory, which this shape does not need), the same
prompts and the same reward function (through our scorer),
16 prompts x 16 generations = GBS 256 per optimizer step (``per_device_train_batch_size``
= micro-batch, ``gradient_accumulation_steps`` = GBS / micro-batch, one generation per
step), ``max_completion_length`` = the rules' new tokens, temperature 1, top_p 1,
``beta`` 0 (no KL, no reference model), its default token-level ``dapo`` loss. A step is
the time between consecutive ``on_step_end`` callbacks.

``--decode`` sets how the ``hf`` engine decodes (``HFEngine``'s ``decode``: ``auto``
= the slot decoder on CUDA, ``generate`` = the engine before it); with several values,
ours is measured once per value in the same run (TRL once), and ``decode_arms`` gives
each one's ``ours_step_s``, ``phases_s`` and ``engine`` (how its engines decoded, from
``HFEngine.describe()``), and ``rollout_speedup`` the first value's
``rollout_s`` over each other's. ``--max-new-tokens`` sets ``grpo.max_new_tokens``;
``--ignore-eos`` gives the engine no EOS id, so every completion runs to it (a random
model ends rows early and unevenly).

Step 1 of each is left out (warm-up). Each side runs ``--repeat`` times, alternating
which goes first. Prints ONE JSON line: ``ours_step_s`` and ``trl_step_s`` (medians;
``ours_train_step_time_s``: the median ``train_step_time``, for older figures),
``speedup`` = ``trl_step_s / ours_step_s`` (null without TRL) and ``phases_s``, our
per-phase medians in seconds.

More comparisons of both sides, each ``--also-steps`` steps a run (default 2: one
measured step a run, so that a 256-token comparison stays short): ``--also-new-tokens T``
with every completion ``T`` tokens long (our engine without EOS ids, TRL's
``min_new_tokens``: the same tokens on both sides; ours without the overlong filter, as
with ``--ignore-eos``: it would leave every such row out of our update while TRL trains
on them; also under ``longer``), and
``--also-micro-batch-size M`` with ``M`` rows a pass on both sides (the default compares
at ``--micro-batch-size``, 64, as TRL's ``per_device_train_batch_size``). ``comparisons``
lists every comparison side by side: its ``max_new_tokens``, ``micro_batch_size``,
steps measured, both sides' median step seconds and each step's (``ours_steps_s``,
``trl_steps_s``), ``speedup``, our ``update_s`` and the rows our
update trained on (median ``global_valid_seqs``: with the overlong filter, the reference
algorithm's, a completion that hit the limit leaves our loss, and is not run at all
under ``grpo.micro_batch_tokens``; TRL trains on every row: ``--overlong-filtering off``
trains ours on every row too).

TRL is not a dependency of this project. Install it beside, in its own environment
(``pip install trl==1.16.0``, which pulls ``datasets``, ``dill``, ``multiprocess``,
``psutil``), or from wheels: ``pip install --no-deps /path/to/wheels/*.whl``. On Python
3.12 ``datasets`` fails to hash a dataset through ``dill``; this script gives its
``Hasher`` a random fingerprint (nothing is cached across runs here).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from mlperf_grpo import rules, tasks
from mlperf_grpo.cli.parser import parse_args_one_line
from mlperf_grpo.config.load import parse_config
from mlperf_grpo.config.rundir import RunDir
from mlperf_grpo.errors import ConfigError, ModelLoadError
from mlperf_grpo.logs.mllog import read_log
from mlperf_grpo.model.files import BUILTIN_MODEL_DIR, check_model_path
from mlperf_grpo.train import trainer as trainer_module

sys.path.insert(0, str(Path(__file__).resolve().parent))
from update_profile import update_profiler  # noqa: E402  (benchmarks/update_profile.py)

SHAPES = {
    # Qwen3-1.7B's blocks (1.41e9 parameters with the built-in tokenizer's tiny vocabulary)
    "qwen3-1.4b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128},
    # the same code path at a size a CPU smoke run can take
    "qwen3-tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
}
PHASE_NAMES = ("rollout_s", "reward_s", "logprob_s", "update_s", "refit_s", "other_s")


def make_qwen3(shape: str, out: Path) -> Path:
    """A random-init ``Qwen3ForCausalLM`` of :data:`SHAPES` ``[shape]`` with the built-in
    tokenizer, saved in bfloat16 as a Hugging Face model directory."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR)
    config = Qwen3Config(
        vocab_size=len(tokenizer), max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **SHAPES[shape],
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(BUILTIN_MODEL_DIR / name, out / name)
    return out


def run_config(model: str, dtype: str, device: str, age: int, steps: int, prompts: int, micro: int,
               compute_dtype: str = "auto", compile_policy: str = "auto", max_new_tokens: int | None = None,
               ignore_eos: bool = False, overlong_filtering: bool = True):
    """The trainer's config for this benchmark (also where TRL's prompts and reward come from).
    ``ignore_eos`` (no completion ends by itself): without the overlong filter, which would
    take every row out of our loss (and with ``micro_batch_tokens`` out of the passes), while
    TRL trains on them all; ``overlong_filtering`` False: without it too (every row trained, as TRL)."""
    data = {
        "seed": 1,
        "model": {"path": model, "dtype": dtype, "device": device, "compute_dtype": compute_dtype,
                  "compile": compile_policy},
        "grpo": {**rules.REFERENCE_ALGORITHM, "max_trajectory_age_steps": age, "num_prompts_per_step": prompts,
                 "micro_batch_size": micro, "max_steps": steps, "first_eval_step": steps},
    }
    if max_new_tokens is not None:
        data["grpo"]["max_new_tokens"] = max_new_tokens
    if ignore_eos or not overlong_filtering:
        data["grpo"]["overlong_filtering"] = False
    return parse_config(data, "grpo_step")


def _sync(device: str) -> None:
    """Wait for the calling thread's CUDA stream: the trainer's work, not the background
    rollouts on their own stream (a device-wide sync here would make training wait for
    them, which an unmeasured run never does)."""
    if device == "cuda":
        torch.cuda.current_stream().synchronize()


@contextlib.contextmanager
def phase_timers(device: str):
    """Wrap the loop's ``optimize_step`` with a timer;
    yields ``{phase: [seconds per call]}`` (restored on exit)."""
    seconds: dict[str, list[float]] = defaultdict(list)
    phases = {"optimize_step": "optimize_step"}  # trainer name -> phase
    originals = {name: getattr(trainer_module, name) for name in phases}

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            _sync(device)
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            _sync(device)
            seconds[name].append(time.perf_counter() - start)
            return out
        return wrapper

    for name, fn in originals.items():
        setattr(trainer_module, name, timed(phases[name], fn))
    try:
        yield seconds
    finally:
        for name, fn in originals.items():
            setattr(trainer_module, name, fn)


@contextlib.contextmanager
def engine_decode(decode: str, ignore_eos: bool, built: list[str]):
    """Every ``HFEngine`` built inside decodes as ``decode`` (and, with ``ignore_eos``,
    has no EOS id); each one's ``describe()["engine"]`` is appended to ``built``;
    restored on exit."""
    from mlperf_grpo.inference.hf import HFEngine

    original = HFEngine._init

    def _init(self, model, tokenizer, batch_size, model_path, _decode, *args, **kwargs):
        original(self, model, tokenizer, batch_size, model_path, decode, *args, **kwargs)
        built.append(self.describe()["engine"])
        if ignore_eos:
            self.eos_token_ids = []

    HFEngine._init = _init
    try:
        yield
    finally:
        HFEngine._init = original


def measure_ours(config, device: str, tmp: Path, decode: str = "auto", ignore_eos: bool = False,
                 engines: list[str] | None = None, profile: dict | None = None) -> list[dict]:
    """Train ``config`` with the engine decoding as ``decode``; per step from step 2:
    ``step_s`` and the :data:`PHASE_NAMES` seconds. The engines built are described in
    ``engines``; with ``profile`` (a dict), the last step's update is profiled into it
    (:func:`update_profiler`; that step's times include the profiler's cost)."""
    run = RunDir(tmp / f"ours-{len(list(tmp.glob('ours-*')))}")
    with phase_timers(device) as seconds, engine_decode(decode, ignore_eos, [] if engines is None else engines), \
            update_profiler(device, None if profile is None else config.grpo.max_steps, {} if profile is None else profile):
        trainer_module.train(config, run, config_filename="grpo_step", show_progress=False)
    _, log_file = run.load()
    log = read_log(log_file)
    stats = [ev.value for ev in log.find("tracked_stats")]
    stops_ms = [ev.time_ms for ev in log.find("block_stop")]
    steps = []
    for i in range(1, len(stats)):
        s = stats[i]
        phases = {
            "rollout_s": s["exposed_generation_time"],
            "reward_s": s["exposed_reward_time"],
            "logprob_s": 0.0,
            "update_s": seconds["optimize_step"][i],
            "refit_s": s["weight_sync_time"],
        }
        # block_stop to block_stop, as TRL's on_step_end to on_step_end: the log's fsyncs and
        # everything else between steps count (train_step_time leaves them out)
        step_s = (stops_ms[i] - stops_ms[i - 1]) / 1000
        phases["other_s"] = step_s - sum(phases.values())
        steps.append({"step_s": step_s, "train_step_time_s": s["train_step_time"], **phases,
                      "rows_trained": s["global_valid_seqs"]})
    return steps


def measure_trl(config, model_dir: Path, device: str, model_dtype: str, tmp: Path,
                ignore_eos: bool = False) -> list[float]:
    """Step times (s) of ``trl.GRPOTrainer`` from step 2, same model, prompts, reward and
    shape; ``ignore_eos``: every completion runs to ``max_new_tokens`` (``min_new_tokens``
    of its generation config), as ours with ``--ignore-eos``."""
    import datasets.fingerprint
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mlperf_grpo.model.load import load_tokenizer
    from mlperf_grpo.tasks.base import Task
    from mlperf_grpo.tasks.scoring import score

    # datasets on Python 3.12 cannot hash through dill: a random fingerprint (no cache reuse here)
    datasets.fingerprint.Hasher.hash = classmethod(lambda cls, value: datasets.fingerprint.generate_random_fingerprint())
    g = config.grpo
    suite = tasks.load_suite(config)
    pool = tasks.train_tasks(suite, config.task.num_train_tasks, config.validation.num_tasks, config.seed)
    dataset = datasets.Dataset.from_list([{"prompt": t.prompt, "task_id": t.task_id, "answer": t.answer} for t in pool])

    def reward(prompts, completions, task_id, answer, **_):
        return score(suite.reward, [(c, Task(i, p, a)) for p, c, i, a in zip(prompts, completions, task_id, answer)])

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            _sync(device)
            self.ends.append(time.perf_counter())

    gbs = g.num_prompts_per_step * g.num_generations_per_prompt
    args = GRPOConfig(
        output_dir=str(tmp / f"trl-{len(list(tmp.glob('trl-*')))}"),
        max_steps=g.max_steps, learning_rate=config.learning_rate, seed=config.seed,
        per_device_train_batch_size=g.micro_batch_size, gradient_accumulation_steps=gbs // g.micro_batch_size,
        num_generations=g.num_generations_per_prompt, max_completion_length=g.max_new_tokens,
        temperature=g.rollout_temperature, top_p=g.rollout_top_p, beta=0.0, max_grad_norm=config.gradient_clip_norm,
        model_init_kwargs={"dtype": model_dtype}, bf16=device == "cuda", gradient_checkpointing=False,
        use_cpu=device == "cpu", report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
        generation_kwargs={"min_new_tokens": g.max_new_tokens} if ignore_eos else None,
    )
    clock = StepClock()
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=load_tokenizer(str(model_dir)), callbacks=[clock])
    trainer.train()
    return [b - a for a, b in zip(clock.ends, clock.ends[1:])]


def trl_available() -> bool:
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-trajectory-age-steps", type=int, choices=(0, 1), default=1)
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (>= 2)")
    parser.add_argument("--num-prompts-per-step", type=int, default=16, help="GBS = this x 16")
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=1, help="runs per side, alternating the order")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", default="builtin:arithmetic-tiny")
    parser.add_argument("--model-shape", choices=sorted(SHAPES), help="build a random-init model instead of --model")
    parser.add_argument("--compute-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="our model.compute_dtype (auto: bfloat16 on cuda with a bfloat16 model)")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                        help="our model.compile (auto: each decoder layer compiled on the cuda bfloat16 path)")
    parser.add_argument("--no-trl", action="store_true", help="measure ours only")
    parser.add_argument("--decode", nargs="+", choices=("auto", "generate", "slots"), default=["auto"],
                        help="the hf engine's decode; several values: ours measured once per value, side by side")
    parser.add_argument("--max-new-tokens", type=int, help="grpo.max_new_tokens (default: the config's)")
    parser.add_argument("--ignore-eos", action="store_true", help="the engine gets no EOS id: completions run to the limit")
    parser.add_argument("--also-new-tokens", type=int,
                        help="also compare both sides at this many new tokens, every completion that long")
    parser.add_argument("--also-steps", type=int, default=2,
                        help="training steps per run of the --also-* comparisons (>= 2; step 1 left out)")
    parser.add_argument("--also-micro-batch-size", type=int,
                        help="also compare both sides with this many rows per pass (e.g. the GBS: one pass)")
    parser.add_argument("--overlong-filtering", choices=("on", "off"), default="on",
                        help="our grpo.overlong_filtering (on: the reference's; off: every row trained, as TRL)")
    parser.add_argument("--profile-update", action="store_true",
                        help="profile our last step's update (torch.profiler): launches, syncs, kernel time")
    parser.add_argument("--trl-model-dtype", choices=("float32", "bfloat16", "auto"), default="float32",
                        help="TRL's weights (float32: master weights as ours; auto: the saved dtype)")
    args = parse_args_one_line(parser)
    bad = [f"{flag} {value}" for flag, value in (("--num-prompts-per-step", args.num_prompts_per_step),
                                                  ("--micro-batch-size", args.micro_batch_size),
                                                  ("--repeat", args.repeat), ("--max-new-tokens", args.max_new_tokens),
                                                  ("--also-new-tokens", args.also_new_tokens),
                                                  ("--also-micro-batch-size", args.also_micro_batch_size))
           if value is not None and value < 1]
    bad += [f"{flag} {value}" for flag, value in (("--steps", args.steps), ("--also-steps", args.also_steps)) if value < 2]
    if bad:
        parser.exit(2, f"{parser.prog}: error: {', '.join(bad)}: counts must be >= 1, --steps and --also-steps >= 2 "
                       "(step 1 is left out)\n")
    try:
        main_measured(args, parser)
    except (ConfigError, ModelLoadError) as error:  # a model or shape the config refuses: one line, as the CLI's
        parser.exit(2, f"{parser.prog}: error: {error}\n")


def main_measured(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Measure ours (each decode arm) and TRL as ``args`` asks; print the JSON line."""
    with_trl = not args.no_trl and trl_available()
    profile: dict | None = {} if args.profile_update else None
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model, dtype = args.model, "float32"
        if args.model_shape:
            model, dtype = str(make_qwen3(args.model_shape, tmp / args.model_shape)), "bfloat16"

        def config_of(max_new_tokens, steps=args.steps, micro=args.micro_batch_size, ignore_eos=args.ignore_eos):
            return run_config(model, dtype, args.device, args.max_trajectory_age_steps, steps,
                              args.num_prompts_per_step, micro, args.compute_dtype, args.compile, max_new_tokens,
                              ignore_eos, args.overlong_filtering == "on")

        config = config_of(args.max_new_tokens)
        arms, engines, trl_steps = _sides(args, config, model, tmp, args.decode, args.ignore_eos, with_trl, profile)
        comparisons = [_comparison(config, args.ignore_eos, arms[args.decode[0]], trl_steps, args.repeat)]
        longer = None
        if args.also_new_tokens:  # both sides again, every completion args.also_new_tokens long, fewer steps
            long_config = config_of(args.also_new_tokens, args.also_steps, ignore_eos=True)
            long_arms, long_engines, long_trl = _sides(args, long_config, model, tmp, args.decode[:1], True, with_trl)
            longer = {"max_new_tokens": args.also_new_tokens, "ignore_eos": True,
                      **_figures(long_arms[args.decode[0]], long_trl),
                      "engine": sorted(set(long_engines[args.decode[0]]))}
            comparisons.append(_comparison(long_config, True, long_arms[args.decode[0]], long_trl, args.repeat))
        if args.also_micro_batch_size:  # both sides again, as many rows a pass as asked
            rows_config = config_of(args.max_new_tokens, args.also_steps, args.also_micro_batch_size)
            rows_arms, _, rows_trl = _sides(args, rows_config, model, tmp, args.decode[:1], args.ignore_eos, with_trl)
            comparisons.append(_comparison(rows_config, args.ignore_eos, rows_arms[args.decode[0]], rows_trl,
                                           args.repeat))
    ours = arms[args.decode[0]]
    print(json.dumps({
        "benchmark": "grpo_step",
        "model": args.model_shape or args.model,
        "device": args.device,
        "global_batch_size": args.num_prompts_per_step * rules.NUM_GENERATIONS_PER_PROMPT,
        "micro_batch_size": args.micro_batch_size,
        "steps_measured_per_side": (args.steps - 1) * args.repeat,
        "max_trajectory_age_steps": args.max_trajectory_age_steps,
        "compute_dtype": config.model.train_compute_dtype,
        "compile": config.model.compile_policy,
        **_figures(ours, trl_steps),
        "max_new_tokens": config.grpo.max_new_tokens,
        "ignore_eos": args.ignore_eos,
        "decode_arms": {d: {"ours_step_s": round(statistics.median(s["step_s"] for s in steps), 4),
                            "phases_s": _phases(steps), "engine": sorted(set(engines[d]))}
                        for d, steps in arms.items()},
        "rollout_speedup": {d: _ratio(statistics.median(s["rollout_s"] for s in arms[args.decode[0]]),
                                      statistics.median(s["rollout_s"] for s in steps)) for d, steps in arms.items()},
        "comparisons": comparisons,
        **({"longer": longer} if longer is not None else {}),
        **({"update_profile": profile} if profile is not None else {}),
        "torch": torch.__version__,
        "trl": _version("trl") if with_trl else None,
        "trl_model_dtype": args.trl_model_dtype if with_trl else None,
    }))


def _sides(args: argparse.Namespace, config, model: str, tmp: Path, decodes: list[str], ignore_eos: bool,
           with_trl: bool, profile: dict | None = None) -> tuple[dict, dict, list[float]]:
    """Ours (once per decode value) and TRL, ``args.repeat`` times, alternating which goes
    first; returns per decode value our steps and engines, and TRL's step times."""
    arms: dict[str, list[dict]] = {d: [] for d in decodes}
    engines: dict[str, list[str]] = {d: [] for d in decodes}
    trl_steps: list[float] = []
    for r in range(args.repeat):  # alternate the order: a shared machine's load drifts
        sides = ["ours", "trl"] if with_trl else ["ours"]
        for side in sides[::-1] if r % 2 else sides:
            if side == "ours":
                for decode in decodes:
                    arms[decode] += measure_ours(config, args.device, tmp, decode, ignore_eos, engines[decode],
                                                 profile if r == args.repeat - 1 and decode == decodes[0] else None)
                    gc.collect()
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
            else:
                trl_steps += measure_trl(config, check_model_path(model), args.device, args.trl_model_dtype, tmp,
                                         ignore_eos)
            gc.collect()  # both sides share this process: free one's model and optimizer first
            if args.device == "cuda":
                torch.cuda.empty_cache()
    return arms, engines, trl_steps


def _figures(ours: list[dict], trl_steps: list[float]) -> dict:
    """Our and TRL's median step seconds, their ratio and our phases."""
    ours_step_s = statistics.median(s["step_s"] for s in ours)
    trl_step_s = statistics.median(trl_steps) if trl_steps else None
    return {
        "ours_step_s": round(ours_step_s, 4),
        "ours_train_step_time_s": round(statistics.median(s["train_step_time_s"] for s in ours), 4),
        "trl_step_s": None if trl_step_s is None else round(trl_step_s, 4),
        "speedup": None if trl_step_s is None else round(trl_step_s / ours_step_s, 4),
        "phases_s": _phases(ours),
    }


def _comparison(config, ignore_eos: bool, ours: list[dict], trl_steps: list[float], repeat: int) -> dict:
    """One comparison's line of ``comparisons``: its shape, both sides' median step
    seconds, their ratio, our update's median seconds, and every measured step's seconds
    of each side (``ours_steps_s``, ``trl_steps_s``: the spread behind the medians)."""
    g = config.grpo
    figures = _figures(ours, trl_steps)
    return {"max_new_tokens": g.max_new_tokens, "ignore_eos": ignore_eos, "overlong_filtering": g.overlong_filtering,
            "micro_batch_size": g.micro_batch_size,
            "steps_measured_per_side": (g.max_steps - 1) * repeat, "ours_step_s": figures["ours_step_s"],
            "trl_step_s": figures["trl_step_s"], "speedup": figures["speedup"],
            "ours_update_s": figures["phases_s"]["update_s"],
            "ours_rows_trained": statistics.median(s["rows_trained"] for s in ours),
            "ours_steps_s": [round(s["step_s"], 4) for s in ours], "trl_steps_s": [round(t, 4) for t in trl_steps]}


def _ratio(numerator: float, denominator: float) -> float | None:
    """``numerator / denominator`` rounded, None when the denominator is 0 (rollouts hidden)."""
    return round(numerator / denominator, 3) if denominator > 0 else None


def _phases(steps: list[dict]) -> dict[str, float]:
    """Median seconds of each of :data:`PHASE_NAMES` over ``steps``."""
    return {k: round(statistics.median(s[k] for s in steps), 4) for k in PHASE_NAMES}


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    main()
