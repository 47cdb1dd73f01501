"""Write the tiny software-repair suite as NeMo Gym JSONL rows (the benchmark's format).

    python scripts/make_swe_tiny_jsonl.py --output DIR

Writes ``DIR/swe_tiny_train.jsonl`` (24 rows) and ``DIR/swe_tiny_validation.jsonl`` (12),
row order as the suite's, and each task's repository at its base commit under
``DIR/repos/<split>/<task>/`` (the rows' ``repo_dir``, relative to ``DIR``). Every row is
shaped like a ``benchmark_r2e_gym_easy_*.jsonl`` row (``mlperf_grpo.tasks.swe.nemo_gym``),
so ``task: {name: swe, train_path: DIR/swe_tiny_train.jsonl, validation_path: ...}`` reads
the suite through the same reader as the benchmark's files. Same output on every run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from mlperf_grpo.tasks.swe.nemo_gym import nemo_gym_row
from mlperf_grpo.tasks.swe.tiny import SPLITS, tiny_suite


def write(output: Path, cache: Path | None = None) -> dict[str, Path]:
    """Write both splits' JSONL files and repositories under ``output``; ``{split: file}``.
    cache: where the suite is materialised first (default: a temporary folder)."""
    output.mkdir(parents=True, exist_ok=True)
    files = {}
    with tempfile.TemporaryDirectory() as scratch:
        for split in SPLITS:
            rows = []
            for task in tiny_suite(split, root=cache or Path(scratch)):
                relative = f"repos/{split}/{task.repo_dir.name}"
                shutil.rmtree(output / relative, ignore_errors=True)
                shutil.copytree(task.repo_dir, output / relative, symlinks=True)
                rows.append(nemo_gym_row(task, split, relative))
            files[split] = output / f"swe_tiny_{split}.jsonl"
            files[split].write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="folder for the JSONL files and repositories")
    for split, path in write(parser.parse_args().output).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
