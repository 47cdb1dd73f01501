"""GRPO step time with one-step-async rollouts against synchronous ones, in the same run.

    python benchmarks/grpo_step.py [--max-trajectory-age-steps 1] [--steps 6] [--repeat 2] [--device cpu|cuda]
                                   [--model builtin:arithmetic-tiny | --model-shape qwen3-1.4b]

Trains the built-in arithmetic task with the reference algorithm (``rules.REFERENCE_ALGORITHM``:
clip-higher, forced ratio, IS correction with ``seq-mask-tis``, prev log-prob pass) through
the real trainer (``train.loop.train``), once with ``max_trajectory_age_steps`` 0 (the
baseline) and once with the value asked for, and reads each step's phase times from the
``tracked_stats`` events of its MLPerf log. Step 1 is left out (warm-up; it is synchronous
in both modes). ``--model-shape qwen3-1.4b`` builds a random-init Qwen3-shaped model of
1.4B parameters (Qwen3-1.7B's layers with the built-in tokenizer's vocabulary) in bfloat16
(``qwen3-tiny``: the same code path at CPU size).

Each mode is run ``--repeat`` times, alternating which goes first. Prints ONE JSON line:
``ours_step_s`` (median ``train_step_time`` at the asked age), ``baseline_age0_step_s``,
their ratio, and the per-phase medians of both modes in seconds
(``generation_s``: engine time; ``exposed_generation_s``: time the trainer waited for
rollouts; ``policy_training_s``: prev log-prob pass + forward/backward + optimizer step;
``weight_sync_s``: refit; ``other_s``: scoring, advantages, batching, logging).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from mlperf_grpo import rules
from mlperf_grpo.config import parse_config
from mlperf_grpo.mllog import read_log
from mlperf_grpo.model import BUILTIN_MODEL_DIR
from mlperf_grpo.rundir import RunDir
from mlperf_grpo.train.loop import train

PHASES = {
    "generation_s": "generation_time",
    "exposed_generation_s": "exposed_generation_time",
    "policy_training_s": "policy_training_time",
    "weight_sync_s": "weight_sync_time",
}


SHAPES = {
    # Qwen3-1.7B's blocks (1.41e9 parameters with the built-in tokenizer's tiny vocabulary)
    "qwen3-1.4b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128},
    # the same code path at a size a CPU smoke run can take
    "qwen3-tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
}


def make_qwen3(shape: str, out: Path) -> Path:
    """A random-init ``Qwen3ForCausalLM`` of :data:`SHAPES` ``[shape]`` with the built-in
    tokenizer, saved in bfloat16 as a Hugging Face model directory."""
    import torch
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


def measure(model: str, dtype: str, device: str, age: int, steps: int, prompts: int, micro: int, tmp: Path) -> list[dict]:
    """Train ``steps`` steps at ``max_trajectory_age_steps = age``; the ``tracked_stats`` of steps 2.."""
    data = {
        "seed": 1,
        "model": {"path": model, "dtype": dtype, "device": device},
        "grpo": {**rules.REFERENCE_ALGORITHM, "max_trajectory_age_steps": age, "num_prompts_per_step": prompts,
                 "micro_batch_size": micro, "max_steps": steps, "first_eval_step": steps},
    }
    run = RunDir(tmp / f"age{age}-{len(list(tmp.glob('age*')))}")
    train(parse_config(data, "grpo_step"), run, config_filename="grpo_step", show_progress=False)
    _, log_file = run.load()
    return [ev.value for ev in read_log(log_file).find("tracked_stats")][1:]


def summarize(stats: list[dict]) -> dict:
    """Median over steps of the step time and of each phase, in seconds."""
    out = {"step_s": statistics.median(s["train_step_time"] for s in stats)}
    for name, key in PHASES.items():
        out[name] = statistics.median(s[key] for s in stats)
    out["other_s"] = statistics.median(
        s["train_step_time"] - s["exposed_generation_time"] - s["policy_training_time"] - s["weight_sync_time"] for s in stats
    )
    out["num_sequences_masked_by_is"] = sum(s["num_sequences_masked_by_is"] for s in stats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-trajectory-age-steps", type=int, choices=(0, 1), default=1)
    parser.add_argument("--steps", type=int, default=6, help="training steps per mode (>= 2)")
    parser.add_argument("--num-prompts-per-step", type=int, default=16, help="GBS = this x 16")
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2, help="runs per mode, alternating the order")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", default="builtin:arithmetic-tiny")
    parser.add_argument("--model-shape", choices=sorted(SHAPES), help="build a random-init model instead of --model")
    args = parser.parse_args()
    if args.steps < 2:
        sys.exit("--steps must be >= 2 (step 1 is left out)")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model, dtype = args.model, "float32"
        if args.model_shape:
            model, dtype = str(make_qwen3(args.model_shape, tmp / args.model_shape)), "bfloat16"
        shape = (args.steps, args.num_prompts_per_step, args.micro_batch_size, tmp)
        runs: dict[int, list[dict]] = {0: [], args.max_trajectory_age_steps: []}
        for r in range(args.repeat):  # alternate the order: a shared machine's load drifts
            for age in sorted(runs, reverse=bool(r % 2)):
                runs[age] += measure(model, dtype, args.device, age, *shape)
        baseline, ours = summarize(runs[0]), summarize(runs[args.max_trajectory_age_steps])
    print(json.dumps({
        "benchmark": "grpo_step",
        "model": args.model_shape or args.model,
        "device": args.device,
        "global_batch_size": args.num_prompts_per_step * rules.NUM_GENERATIONS_PER_PROMPT,
        "steps_measured_per_mode": (args.steps - 1) * args.repeat,
        "max_trajectory_age_steps": args.max_trajectory_age_steps,
        "ours_step_s": round(ours["step_s"], 4),
        "baseline_age0_step_s": round(baseline["step_s"], 4),
        "ratio_to_age0": round(ours["step_s"] / baseline["step_s"], 4),
        "phases_s": {k: round(v, 4) for k, v in ours.items() if k.endswith("_s") and k != "step_s"},
        "baseline_phases_s": {k: round(v, 4) for k, v in baseline.items() if k.endswith("_s") and k != "step_s"},
        "num_sequences_masked_by_is": ours["num_sequences_masked_by_is"],
    }))


if __name__ == "__main__":
    main()
