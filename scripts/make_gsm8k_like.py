"""Write a small GSM8K-format data set of generated word problems (no copied data).

    python scripts/make_gsm8k_like.py [--output tests/data/gsm8k_like] [--train 64] [--validation 16]

Each row is ``{"question": ..., "answer": ...}`` as in GSM8K: the answer is a worked
solution ending in ``#### <number>``. The problems are two-step additions and
subtractions about named people and objects, drawn with a fixed seed, so the files are
the same on every run. ``train.jsonl`` and ``validation.jsonl`` share no question. A few
validation rows also carry ``messages`` (the same question as a chat), for prompts built
with a chat template. Used by ``tests/tasks/test_task_sources.py``:
``task: {name: jsonl, id_field: null, prompt_field: question, ...}``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 8_000_013
NAMES = ["Ada", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jun", "Kofi", "Lena"]
THINGS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "shells", "cards"]


def problem(rng: random.Random) -> dict:
    """One GSM8K-format row: ``{"question", "answer"}``."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    start, more, less = rng.randint(10, 60), rng.randint(2, 30), rng.randint(1, 9)
    after_more, final = start + more, start + more - less
    question = (f"{name} has {start} {thing}. {name} gets {more} more {thing} and then gives away {less}. "
                f"How many {thing} does {name} have now?")
    answer = (f"After getting more, {name} has {start} + {more} = <<{start}+{more}={after_more}>>{after_more} {thing}.\n"
              f"After giving some away, {name} has {after_more} - {less} = <<{after_more}-{less}={final}>>{final} {thing}.\n"
              f"#### {final}")
    return {"question": question, "answer": answer}


def make(num_train: int, num_validation: int) -> tuple[list[dict], list[dict]]:
    """Distinct problems: the first ``num_validation`` for validation, the next for training."""
    rng = random.Random(SEED)
    rows: dict[str, dict] = {}
    while len(rows) < num_train + num_validation:
        row = problem(rng)
        rows.setdefault(row["question"], row)
    ordered = list(rows.values())
    validation, train = ordered[:num_validation], ordered[num_validation:]
    for row in validation[:4]:
        row["messages"] = [{"role": "system", "content": "Answer with the number only."},
                           {"role": "user", "content": row["question"]}]
    return train, validation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path(__file__).resolve().parents[1] / "tests" / "data" / "gsm8k_like")
    parser.add_argument("--train", type=int, default=64)
    parser.add_argument("--validation", type=int, default=16)
    args = parser.parse_args()
    train, validation = make(args.train, args.validation)
    args.output.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("validation", validation)):
        (args.output / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(train)} training and {len(validation)} validation rows to {args.output}")


if __name__ == "__main__":
    main()
