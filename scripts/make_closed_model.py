"""Make ``arithmetic-tiny-closed``: starting weights for closed-division runs of the built-in task.

Re-run to rebuild ``src/mlperf_grpo/assets/arithmetic-tiny-closed`` (a few minutes on 2 cores):

    python scripts/make_closed_model.py

Why: the built-in model (``arithmetic-tiny``) needs the open learning rate 4e-6 to cross
the 0.69 target in about 20 steps at GBS 256; at the closed learning rate 1e-6 it moves
about four times slower and stays below target for far more steps than a test can run.
Rather than bend a closed value, the closed configs start from a later point of the same
model: the built-in model after ``--steps`` (18) GRPO steps of the *open* default run
(seed 1, GBS 256, lr 4e-6) with the group-mean baseline it had then. Its pass@4 is below
the target (170, 173 and 173 of 251 tasks with validation seeds 1, 2, 3; passing needs
174), and the closed run's own training at lr 1e-6 lifts it above (docs/closed-division.md,
"Closed division and plan"). Model and tokenizer files are copied from ``arithmetic-tiny``;
only ``model.safetensors`` changes. ``provenance.json`` records how the weights were made.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from mlperf_grpo.checkpoint import discover_checkpoints, read_weights, sha256_file
from mlperf_grpo.config.load import parse_config
from mlperf_grpo.config.rundir import RunDir
from mlperf_grpo.model.files import BUILTIN_MODEL_DIR
from mlperf_grpo.train.trainer import train

OUT = BUILTIN_MODEL_DIR.parent / "arithmetic-tiny-closed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=18, help="open-division GRPO steps to take (>= 18, the first checkpoint)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output", type=Path, default=OUT)
    args = parser.parse_args()

    # The open default run as it was when the shipped weights were made: the group-mean
    # baseline, no overlong filter (the open default now uses the reference's; pinned so
    # that this still reproduces src/mlperf_grpo/assets/arithmetic-tiny-closed).
    grpo = {"max_steps": args.steps, "use_leave_one_out_baseline": False, "overlong_filtering": False}
    config = parse_config({"seed": args.seed, "grpo": grpo})
    with tempfile.TemporaryDirectory() as tmp:
        run = RunDir(Path(tmp) / "run")
        train(config, run, config_filename="make_closed_model", show_progress=True)
        final = [c for c in discover_checkpoints(run.checkpoints)[0] if c.step == args.steps][0]
        weights = read_weights(final)
    weights.pop("lm_head.weight", None)  # tied to the embeddings, as in arithmetic-tiny
    if args.output.exists():
        shutil.rmtree(args.output)
    shutil.copytree(BUILTIN_MODEL_DIR, args.output)
    save_file({k: v.contiguous() for k, v in weights.items()}, args.output / "model.safetensors", metadata={"format": "pt"})
    provenance = {
        "base_model": "builtin:arithmetic-tiny",
        "base_model_sha256": sha256_file(BUILTIN_MODEL_DIR / "model.safetensors"),
        "grpo_steps": args.steps,
        "division": config.division,
        "global_batch_size": config.global_batch_size,
        "learning_rate": config.learning_rate,
        "seed": args.seed,
        "sha256": sha256_file(args.output / "model.safetensors"),
        "made_by": "scripts/make_closed_model.py",
    }
    (args.output / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(f"saved {args.output}")


if __name__ == "__main__":
    main()
