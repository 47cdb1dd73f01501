"""The agent loop on the tiny software-repair suite: trajectories/s, the engine's idle
share of the wall time, sandbox start-up, with a scripted policy and with a model.

    python benchmarks/agent.py                                           # CPU: builtin:swe-tiny
    python benchmarks/agent.py --device cuda --params 1.4e9 --trajectories 64 --tool-threads 16

Both arms run ``--trajectories`` trajectories all in flight (the tiny suite's tasks in row
order, cycled; bubblewrap sandboxes, the real tools and hidden tests):

- ``scripted``: a stand-in for the model that applies each task's known fix in three whole
  turns (``agent/scripted.py``; reward 1 on every task): the loop's own cost with tools,
  sandboxes and grading, the baseline measured in the same run;
- ``model``: the ``hf`` engine with ``builtin:swe-tiny`` (``--params 0``) or a random-init
  Qwen3 shape of ``--params`` parameters with the swe-tiny tokenizer (nothing downloaded),
  sampling at temperature 1 for up to ``--max-turns`` turns of ``--max-new-tokens-per-turn``.

Prints ONE JSON line: per arm ``trajectories``, ``wall_s``, ``trajectories_per_s``,
``engine_busy_s``, ``engine_idle_s`` and ``engine_idle_fraction`` (waiting with no
trajectory due for a turn: all were in their tools, sandbox start-up or grading),
``sandbox_startup_s`` (mean and max), ``reward_mean``, ``sampled_tokens``, ``turns``; and
``model_over_scripted_trajectories_per_s``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint import qwen3_config  # noqa: E402  (benchmarks/checkpoint.py)

from mlperf_grpo.agent.scripted import ScriptedEngine, known_fix_script  # noqa: E402
from mlperf_grpo.agent.suite import AgentRunner  # noqa: E402
from mlperf_grpo.cli.parser import parse_args_one_line  # noqa: E402
from mlperf_grpo.config.sections import AgentConfig  # noqa: E402
from mlperf_grpo.inference.base import SamplingParams  # noqa: E402
from mlperf_grpo.inference.hf import HFEngine  # noqa: E402
from mlperf_grpo.model.load import load_tokenizer  # noqa: E402
from mlperf_grpo.model.files import resolve_model_path  # noqa: E402
from mlperf_grpo.tasks.swe import tiny_suite  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def arm(engine, runner: AgentRunner, tasks, trajectories: int, params: SamplingParams) -> dict:
    jobs = [(tasks[i % len(tasks)], i) for i in range(trajectories)]
    run = runner.trajectories(engine, jobs, params)
    s = run.stats
    return {
        "trajectories": trajectories, "wall_s": round(s.wall_s, 3), "trajectories_per_s": round(trajectories / s.wall_s, 4),
        "engine_busy_s": round(s.engine_busy_s, 3), "engine_idle_s": round(s.engine_idle_s, 3),
        "engine_idle_fraction": round(s.engine_idle_s / s.wall_s, 4), "engine_calls": s.engine_calls,
        "sandbox_startup_s": {"mean": round(statistics.mean(s.session_start_s), 4),
                              "max": round(max(s.session_start_s), 4)},
        "reward_mean": round(statistics.mean(t.reward for t in run.trajectories), 4),
        "invalid": sum(t.invalid for t in run.trajectories),
        "sampled_tokens": sum(t.num_sampled_tokens for t in run.trajectories),
        "turns": sum(len(t.turns) for t in run.trajectories),
    }


def model_dir(params: float, folder: Path) -> Path:
    """``builtin:swe-tiny`` (``params`` 0), or a random-init Qwen3 shape with its tokenizer."""
    tiny = resolve_model_path("builtin:swe-tiny")
    if not params:
        return tiny
    tokenizer = load_tokenizer("builtin:swe-tiny")
    config = qwen3_config(params, len(tokenizer))
    config.update({"bos_token_id": None, "eos_token_id": [258, 256], "pad_token_id": 256,
                   "max_position_embeddings": 65536})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        torch.manual_seed(0)
        model = __import__("transformers").AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    for name in TOKENIZER_FILES:
        shutil.copy(tiny / name, folder / name)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--params", type=float, default=0.0, help="0: builtin:swe-tiny; else a Qwen3 shape (1.4e9)")
    parser.add_argument("--trajectories", type=int, default=12)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-new-tokens-per-turn", type=int, default=32)
    parser.add_argument("--tool-threads", type=int, default=4)
    args = parse_args_one_line(parser)
    bad = [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
           if k in ("trajectories", "max_turns", "max_new_tokens_per_turn", "tool_threads") and v < 1]
    if bad or not args.params >= 0 or args.params == float("inf"):
        parser.exit(2, f"bad arguments: {', '.join(bad) or f'--params {args.params}'} (counts >= 1, params >= 0)\n")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "--device cuda but no CUDA device is available\n")
    with tempfile.TemporaryDirectory(prefix="agent-bench-") as tmp:
        tmp = Path(tmp)
        tasks = tiny_suite("validation", root=tmp / "suite") + tiny_suite("train", root=tmp / "suite")
        agent = AgentConfig(max_turns=args.max_turns, max_context_tokens=8192 if args.params == 0 else 65536,
                            max_new_tokens_per_turn=args.max_new_tokens_per_turn, prompt_style="compact",
                            tool_threads=args.tool_threads, sandbox_root=str(tmp / "sandboxes"))
        runner = AgentRunner(agent)
        tokenizer = load_tokenizer("builtin:swe-tiny")
        whole_turns = AgentRunner(agent.model_copy(update={"max_turns": 3, "max_new_tokens_per_turn": None}))
        scripted = arm(ScriptedEngine(tokenizer, tasks, known_fix_script), whole_turns, tasks, args.trajectories,
                       SamplingParams(1.0, 1.0, 4096))
        dtype = "bfloat16" if args.device == "cuda" else "float32"
        (tmp / "model").mkdir()
        engine = HFEngine(str(model_dir(args.params, tmp / "model")), dtype, batch_size=args.trajectories,
                          device=args.device)
        model = arm(engine, runner, tasks, args.trajectories, SamplingParams(1.0, 1.0, args.max_new_tokens_per_turn))
    print(json.dumps({
        "benchmark": "agent", "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "params": args.params or "builtin:swe-tiny", "scripted": scripted, "model": model,
        "model_over_scripted_trajectories_per_s": round(model["trajectories_per_s"] / scripted["trajectories_per_s"], 4),
    }))


if __name__ == "__main__":
    main()
