"""Long trajectories: peak GPU memory against the planner's figure, and step time, per length.

    python benchmarks/long_sequences.py --device cuda [--cases 256x1024 16x16384 16x65536]
                                        [--vocab 151936] [--context 65536] [--train-rows 2]

A 1.4B Qwen3 shape (``grpo_step.SHAPES["qwen3-1.4b"]``) with the given vocabulary and
context, random weights, the default config otherwise (``grpo.micro_batch_tokens`` packing,
``model.activation_checkpointing: auto``) and the reference algorithm. Each case ``PxN``
(P rows of N new tokens after a prompt of at most 40 tokens, N cut to the context less
40; ``overlong_filtering`` off, since every row is truncated):

- the planner first (``train.inputs.check_planned_memory``: what the trainer does before
  ``run_start``): its planned peak, whether it turns checkpointing on, or its refusal line;
- ``real`` (``--real`` cases, default the first): the trainer itself, ``--steps`` steps,
  every completion run to N tokens (no EOS id); the peak is ``max_memory_allocated`` over
  the run, the step time step 2's (``block_stop`` to ``block_stop``);
- otherwise ``synthetic``: the trainer's policy and engine, the engine's KV cache
  allocated for its rows at full length, as many as the planned budget holds (the most
  a rollout holds; freed before training where the plan frees it), and two optimizer steps (``optimize_step``)
  on random ``--train-rows`` rows of the case's length (every pass of the case has one
  row: the same peak; ``update_s`` is one pass's time x rows); a refused case is
  measured without the KV cache, against the planner's figure without it.

Prints one JSON line per case: ``peak_gib``, ``planned_gib``, their ratio, ``checkpointing``,
``step_s`` or ``update_s``, ``refusal``. Bad arguments: one line, exit 2. ``--device cpu``
is a smoke run of the same code at the ``qwen3-tiny`` shape (2,048-token context, cases
32x64 and 16x1024) unless told otherwise.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from generation import bad_input
from grpo_step import SHAPES, engine_decode
from mlperf_grpo import rules
from mlperf_grpo.cli.parser import parse_args_one_line
from mlperf_grpo.config.load import parse_config
from mlperf_grpo.plan.memory import MemoryPlanError
from mlperf_grpo.logs.mllog import read_log
from mlperf_grpo.model.files import BUILTIN_MODEL_DIR
from mlperf_grpo.config.rundir import RunDir
from mlperf_grpo.train import inputs as train_inputs
from mlperf_grpo.train import trainer as trainer_module
from mlperf_grpo.train.optimize import OptimizeSettings, optimize_step
from mlperf_grpo.train.rollout import RolloutBatch

PROMPT_TOKENS = 40
MAX_VOCAB = 1 << 20
"""``--vocab``'s largest: real vocabularies reach 262,144 (Gemma 3); past this the
embedding alone is terabytes at some sizes (an allocation traceback, not a line)."""
GIB = 2**30


def _peak() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def _reset() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def make_model(out: Path, vocab: int, context: int, shape: str = "qwen3-1.4b") -> Path:
    """A random-init Qwen3 of the 1.4B shape with ``vocab`` entries and a ``context``-token
    context, built on the GPU when there is one, saved in bfloat16 with the built-in tokenizer
    (its 15 ids decode; the other ids decode to nothing)."""
    import shutil

    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR)
    config = Qwen3Config(vocab_size=vocab, max_position_embeddings=context, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(BUILTIN_MODEL_DIR / name, out / name)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def case_config(model: Path, device: str, prompts_x_tokens: str, steps: int, context: int):
    rows, new = (int(x) for x in prompts_x_tokens.split("x"))
    new = min(new, context - PROMPT_TOKENS)  # a trajectory of the whole context: its prompt counts in it
    prompts = max(1, rows // rules.NUM_GENERATIONS_PER_PROMPT)
    # every completion runs to N tokens (no EOS): the overlong filter would leave every row out of the loss
    grpo = {**rules.REFERENCE_ALGORITHM, "overlong_filtering": False, "max_trajectory_age_steps": 0,
            "num_prompts_per_step": prompts,
            "max_new_tokens": new, "max_steps": steps, "first_eval_step": steps}
    if rows < rules.NUM_GENERATIONS_PER_PROMPT:
        grpo["num_generations_per_prompt"] = rows
    data = {"seed": 1, "model": {"path": str(model), "dtype": "bfloat16", "device": device},
            "grpo": grpo, "task": {"num_train_tasks": 64}, "validation": {"num_tasks": 20}}
    return parse_config(data, "long_sequences")


def measure_real(config, tmp: Path, checked) -> dict:
    run = RunDir(tmp / f"real-{time.monotonic_ns()}")
    _reset()
    with engine_decode("auto", True, []):
        trainer_module.train(config, run, config_filename="long_sequences", show_progress=False, inputs=checked)
    stops = [ev.time_ms for ev in read_log(run.load()[1]).find("block_stop")]
    return {"mode": "real", "peak_bytes": _peak(),
            "step_s": (stops[-1] - stops[-2]) / 1000 if len(stops) > 1 else None}


def measure_synthetic(config, checkpointing: bool, train_rows: int, kv_rows: int, released: bool,
                      kv_budget: int | None = None) -> dict:
    """The trainer's policy and engine; after a first optimizer step (AdamW's state, as
    from step 2 on): the engine's KV cache of ``kv_rows`` rows at full length allocated as
    the slot decoder does (the generation's peak; as many as ``kv_budget`` holds where
    the plan bounds it), freed first when ``released``, then a second step on
    ``train_rows`` rows (0 ``kv_rows``: no cache)."""
    from mlperf_grpo.inference.slot_schedule import rows_fitting
    from mlperf_grpo.inference.slot_state import SlotCache, row_column_bytes
    from mlperf_grpo.plan.sequences import KEY_BLOCK

    g = config.grpo
    policy, engine = trainer_module.policy_and_engine(config, config.model.compile_policy, checkpointing)
    rows, length = config.global_batch_size, PROMPT_TOKENS + g.max_new_tokens
    optimizer = trainer_module.adamw(config, policy)
    settings = OptimizeSettings.of(config, config.model.compile_policy)
    n = min(train_rows, rows)
    ids = torch.randint(0, 15, (n, length))
    completion = torch.zeros(n, length - 1)
    completion[:, PROMPT_TOKENS - 1:] = 1
    batch = RolloutBatch(ids, torch.ones(n, length, dtype=torch.long), completion, torch.full((n, length - 1), -2.7),
                         torch.randn(n), torch.zeros(1, n), torch.ones(n))
    optimize_step(policy, optimizer, batch, settings)  # AdamW's state exists from here on, as from step 2
    _reset()
    kv = None
    if kv_rows:
        text = engine.model.config
        columns = -(-length // KEY_BLOCK) * KEY_BLOCK
        if kv_budget is not None:
            shapes = [(text.num_key_value_heads, text.head_dim)] * text.num_hidden_layers
            kv_rows = min(kv_rows, rows_fitting(kv_budget, row_column_bytes(shapes, torch.bfloat16), columns))
        kv = SlotCache([(text.num_key_value_heads, text.head_dim)] * text.num_hidden_layers, kv_rows, columns,
                       torch.bfloat16, torch.device(config.model.device))
    if released:
        del kv
        kv = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    start = time.perf_counter()
    optimize_step(policy, optimizer, batch, settings)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    out = {"mode": "synthetic", "peak_bytes": _peak(), "train_rows": n, "update_s": seconds * rows / n,
           "kv_rows": kv_rows, "kv_released_for_training": released}
    del policy, engine, optimizer, kv
    return out


def run_case(model: Path, args: argparse.Namespace, case: str, real: bool, tmp: Path) -> dict:
    config = case_config(model, args.device, case, args.steps, args.context)
    out = {"benchmark": "long_sequences", "case": case, "vocab": args.vocab, "context": args.context,
           "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    run = RunDir(tmp / f"check-{case}")
    try:
        checked = train_inputs.check_training_inputs(config, run)
        fit, refusal = checked.step_fit, None
    except MemoryPlanError as err:
        checked, fit, refusal = None, None, str(err)
    if fit is not None and fit.verdict is not None:
        planned, ckpt = fit.verdict.peak_bytes, fit.checkpointing
        out.update(planned_gib=round(planned / GIB, 2), checkpointing=ckpt, note=fit.note(),
                   kv_budget_gib=round(fit.kv_cache_bytes / GIB, 2), kv_bounded=fit.verdict.bounded,
                   kv_released=fit.release_engine_memory)
    else:  # refused: measure the training phase (checkpointed, no KV cache) against its own figure
        from mlperf_grpo.plan import sequences as seq
        from mlperf_grpo.plan.model_config import load_model_config
        from mlperf_grpo.train.memory_fit import static_bytes, step_shape

        model_cfg = load_model_config(model)
        memory = seq.sequence_memory(model_cfg, step_shape(config, PROMPT_TOKENS, 1), True)
        planned, ckpt = static_bytes(config, model_cfg, 1) + memory.training_bytes, True
        out.update(refusal=refusal, planned_gib_without_kv=round(planned / GIB, 2), checkpointing=True,
                   planned_kv_gib=round(memory.kv_cache_bytes / GIB, 2))
    try:
        if real and checked is not None:
            result = measure_real(config, tmp, checked)
        elif fit is not None:
            result = measure_synthetic(config, ckpt, args.train_rows, min(256, config.global_batch_size),
                                       fit.release_engine_memory,
                                       fit.kv_cache_bytes if fit.verdict is not None and fit.verdict.bounded else None)
        else:
            result = measure_synthetic(config, ckpt, args.train_rows, 0, False)
    except torch.OutOfMemoryError as err:  # the planner let through a step that does not fit: say so
        result = {"mode": "real" if real else "synthetic", "out_of_memory": str(err).splitlines()[0][:200],
                  "peak_bytes": _peak()}
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    out.update({k: v for k, v in result.items() if k != "peak_bytes"})
    out.update(peak_gib=round(result["peak_bytes"] / GIB, 2),
               peak_over_planned=round(result["peak_bytes"] / planned, 3) if planned else None)
    return out


def check_arguments(args: argparse.Namespace) -> None:
    """A bad argument: one line naming it (:func:`generation.bad_input`, exit 2), before the
    model is built."""
    if args.device == "cuda" and not torch.cuda.is_available():
        bad_input("--device cuda but no CUDA device is available; use --device cpu")
    for case in args.cases:
        match = re.fullmatch(r"(\d+)x(\d+)", case)
        rows, new = (int(x) for x in match.groups()) if match else (0, 0)
        if new < 1 or rows < 2 or (rows > rules.NUM_GENERATIONS_PER_PROMPT and rows % rules.NUM_GENERATIONS_PER_PROMPT):
            bad_input(f"--cases {case}: must be ROWSxNEW_TOKENS, NEW_TOKENS >= 1 and ROWS 2 to "
                      f"{rules.NUM_GENERATIONS_PER_PROMPT} or a multiple of it (e.g. 256x1024)")
    unknown = sorted(set(args.real or []) - set(args.cases))
    if unknown:
        bad_input(f"--real {' '.join(unknown)}: not among --cases ({' '.join(args.cases)})")
    tokens = len(AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR))
    if not tokens <= args.vocab <= MAX_VOCAB:
        bad_input(f"--vocab {args.vocab:,}: must hold the built-in tokenizer's {tokens} ids and be at most "
                  f"{MAX_VOCAB:,} (Qwen3's is 151,936)")
    if args.context <= PROMPT_TOKENS:
        bad_input(f"--context {args.context}: must be over the {PROMPT_TOKENS}-token prompts")
    if min(args.steps, args.train_rows) < 1:
        bad_input(f"--steps {args.steps}, --train-rows {args.train_rows}: each must be >= 1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run (no peaks, no plan)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="default qwen3-1.4b (--device cpu: qwen3-tiny)")
    parser.add_argument("--cases", nargs="+", default=None,
                        help="ROWSxNEW_TOKENS (default 256x1024 16x16384 16x65536; --device cpu: 32x64 16x1024)")
    parser.add_argument("--real", nargs="*", default=None, help="cases run through the trainer (default: the first)")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--context", type=int, default=None, help="default 65536 (--device cpu: 2048)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--train-rows", type=int, default=2)
    args = parse_args_one_line(parser)
    cpu = args.device == "cpu"  # a smoke run: the 1.4B shape's fp32 state alone is over 20 GB of host memory
    args.shape = args.shape or ("qwen3-tiny" if cpu else "qwen3-1.4b")
    args.cases = args.cases or (["32x64", "16x1024"] if cpu else ["256x1024", "16x16384", "16x65536"])
    args.context = args.context or (2048 if cpu else 65_536)
    check_arguments(args)
    real = set(args.cases[:1] if args.real is None else args.real)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = make_model(tmp / "model", args.vocab, args.context, args.shape)
        for case in args.cases:
            print(json.dumps(run_case(model, args, case, case in real, tmp)), flush=True)


if __name__ == "__main__":
    main()
