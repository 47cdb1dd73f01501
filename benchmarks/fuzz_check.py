"""Fuzz ``mlperf-grpo check``: every input gets a verdict, in bounded time, without a traceback.

Seeds: our stored real run's log (``tests/data/real_run/mlperf.log``) and logs generated
with the test helpers (``tests/logtools_helpers.py``): a clean deferred log, an aborted
one, and reference-style inline (passing, aborted) and deferred logs. Each input is one
seed with 1-6 mutations drawn from these kinds:

- ``delete``, ``duplicate``, ``swap``: whole lines;
- ``splice``: a token (``"``, ``}``, ``null``, ``9e999``, ``NaN``, a NUL, a non-ASCII
  character, ...) written over one character of a line;
- ``truncate``: a line cut at a random point;
- ``nested``: a line replaced by ``:::MLLOG`` and 500-5,000 nested ``[`` or ``{"a":``
  (the old parser's ``RecursionError``);
- ``metadata``: a ``samples_count``, ``step`` or ``status`` set to a list, a dict, a
  string, a float, a negative number or null (the old lint's ``TypeError``);
- ``long``: a value of 10 kB to 1 MB in one line (the official checker is quadratic in
  line length);
- ``value``: an ``eval_accuracy`` set to null, a string, NaN, 1.5 or a list;
- ``bytes``: random bytes in the middle of a line.

The contract (docs/log-tools.md, "Log tools: check, merge, report"): :func:`mlperf_grpo.logs.check.check_log` returns a report
(exit 0/1) or raises ``UnreadableLog`` (exit 2); nothing else is raised; the report renders
as text and JSON; and it answers within the official checkers' time limit plus the lint's
own time. Prints one JSON line: inputs, contract violations by class (with the first input
numbers of each class; ``worker-died`` when a worker process died, and then only the inputs
before it are answered), verdict counts, the slowest input's number, seconds and mutation
kinds, the slowest time's ratio to the limit, and the CPU seconds per input.

Input ``i`` of seed ``s`` is drawn from its own generator (``random.Random(f"{s}:{i}")``),
so the inputs are the same whatever ``--jobs``, and ``--start i --n 1`` checks input ``i``
alone. ``--jobs J`` checks them in ``J`` worker processes (each forks the official
checkers' child per input, as ``check`` does); the time limit is per input, so give each
worker a core.

    python benchmarks/fuzz_check.py --n 2000 [--seed 0] [--start 0] [--jobs 1] [--time-limit-s 10]
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from logtools_helpers import DATA, reference_style, synth, to_text  # noqa: E402

from mlperf_grpo.cli.parser import parse_args_one_line  # noqa: E402
from mlperf_grpo.logs.check import MAX_LINE_CHARS, UnreadableLog, check_log  # noqa: E402
from mlperf_grpo.logs.check.official import preload_checkers  # noqa: E402
from mlperf_grpo.logs.check.render import format_reports, to_json  # noqa: E402

TOKENS = ["", "x", "null", '"', "}", "{", "[", "]", ",", "9e999", "-1", "NaN", "\\u0000", "ü", "\x00", "\\", "true"]
BAD_VALUES = [[], {}, [1, 2], {"a": 1}, "18", 18.5, -4608, None, True]
SLACK_S = 5.0
"""Time allowed beyond the official checkers' limit for reading, the lint and the fork."""


def seeds() -> list[list[str]]:
    """The seed logs, as lists of lines."""
    texts = [
        (DATA / "mlperf.log").read_text(),
        to_text(synth()),
        to_text(synth(accs=(0.5, 0.6, 0.65), steps=20, status="aborted")),
        to_text(reference_style()),
        to_text(reference_style(accs=(0.5, 0.6, 0.65))),
        to_text(reference_style(accs=(0.5, 0.72), inline=False, max_steps=22)),
    ]
    return [t.splitlines() for t in texts]


def _mutate_json(line: str, rng: random.Random, kind: str) -> str:
    try:
        d = json.loads(line[line.index(":::MLLOG ") + 9:])
    except (ValueError, IndexError, RecursionError):
        return line
    if not isinstance(d, dict):
        return line
    if kind == "metadata":
        md = d.get("metadata") if isinstance(d.get("metadata"), dict) else {}
        md[rng.choice(["samples_count", "step", "status"])] = rng.choice(BAD_VALUES)
        d["metadata"] = md
    elif kind == "value":
        d["key"] = "eval_accuracy" if rng.random() < 0.5 else d.get("key")
        d["value"] = rng.choice([None, "0.7", float("nan"), 1.5, [0.7]])
    else:  # long
        # just under, at and over the line limit, and far over it
        d["value"] = "v" * rng.choice([MAX_LINE_CHARS // 2, MAX_LINE_CHARS - 200, MAX_LINE_CHARS + 100, 100_000, 1_000_000])
    return ":::MLLOG " + json.dumps(d)


def mutate(lines: list[str], rng: random.Random) -> tuple[list[str], list[str]]:
    """``lines`` with 1-6 random mutations; returns the new lines and the kinds applied."""
    lines, kinds = list(lines), []
    for _ in range(rng.randint(1, 6)):
        if not lines:
            break
        kind = rng.choice(["delete", "duplicate", "swap", "splice", "truncate", "nested", "metadata", "long", "value", "bytes"])
        kinds.append(kind)
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        if kind == "delete":
            del lines[i]
        elif kind == "duplicate":
            lines.insert(j, lines[i])
        elif kind == "swap":
            lines[i], lines[j] = lines[j], lines[i]
        elif kind == "splice":
            k = rng.randrange(max(len(lines[i]), 1))
            lines[i] = lines[i][:k] + rng.choice(TOKENS) + lines[i][k + 1:]
        elif kind == "truncate":
            lines[i] = lines[i][: rng.randrange(max(len(lines[i]), 1))]
        elif kind == "nested":
            depth = rng.randint(500, 5000)
            lines[i] = ":::MLLOG " + (rng.choice(["[", '{"a":']) * depth)
        elif kind == "bytes":
            k = rng.randrange(max(len(lines[i]), 1))
            noise = bytes(rng.randrange(256) for _ in range(rng.randint(1, 20))).decode("latin-1")
            lines[i] = lines[i][:k] + noise + lines[i][k:]
        else:
            lines[i] = _mutate_json(lines[i], rng, kind)
    return lines, kinds


def run_one(path: Path, time_limit_s: float) -> tuple[str, str | None]:
    """``(verdict, violation)``: the verdict (``exit-0``, ``exit-1``, ``exit-2``) and the
    contract violation's class, or None."""
    try:
        report = check_log(path, auto_run_dir=False, time_limit_s=time_limit_s)
    except UnreadableLog:
        return "exit-2", None
    except BaseException as err:  # noqa: BLE001  (this is what the fuzzer counts)
        return "raised", type(err).__name__
    try:
        format_reports([report])
        json.loads(to_json([report]))
    except BaseException as err:  # noqa: BLE001
        return "render-raised", f"render:{type(err).__name__}"
    return ("exit-0" if report.clean else "exit-1") + f" official:{report.official.verdict}", None


def make_input(base: list[list[str]], seed: int, index: int) -> tuple[list[str], list[str]]:
    """Input ``index`` of ``seed``: a seed log and its mutations, from a generator of its own."""
    rng = random.Random(f"{seed}:{index}")
    return mutate(rng.choice(base), rng)


_worker: dict = {}
"""Per process: the seed logs, the seed, the time limit and a scratch file."""


def _start_worker(seed: int, time_limit_s: float) -> None:
    folder = Path(tempfile.mkdtemp(prefix="fuzz-check-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    _worker.update(base=seeds(), seed=seed, time_limit_s=time_limit_s, path=folder / "mutated.log")


def check_input(index: int) -> tuple[int, str, str | None, float, list[str]]:
    """``(index, verdict, violation, seconds, mutation kinds)`` for input ``index``."""
    lines, kinds = make_input(_worker["base"], _worker["seed"], index)
    path = _worker["path"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
    t = time.perf_counter()
    verdict, violation = run_one(path, _worker["time_limit_s"])
    return index, verdict, violation, time.perf_counter() - t, kinds


def _cpu_s() -> float:
    """CPU seconds of this process and every finished descendant (workers, checker children)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000, help="inputs to check")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0, help="number of the first input (to re-check one)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (one core each)")
    parser.add_argument("--time-limit-s", type=float, default=10.0, help="the official checkers' limit per input")
    args = parse_args_one_line(parser)
    if args.n < 1 or args.jobs < 1 or args.start < 0 or args.time_limit_s <= 0:
        parser.error("--n and --jobs must be at least 1, --start at least 0, --time-limit-s above 0")
    preload_checkers()  # before the workers fork: they start with the checkers loaded
    limit = args.time_limit_s + SLACK_S
    violations: Counter[str] = Counter()
    examples: dict[str, list[int]] = {}
    verdicts: Counter[str] = Counter()
    slowest = (0.0, -1, [])
    start, cpu_start = time.perf_counter(), _cpu_s()
    indices = range(args.start, args.start + args.n)
    with contextlib.ExitStack() as stack:
        if args.jobs == 1:
            _start_worker(args.seed, args.time_limit_s)
            results = map(check_input, indices)
        else:
            pool = stack.enter_context(ProcessPoolExecutor(
                args.jobs, mp_context=multiprocessing.get_context("fork"),
                initializer=_start_worker, initargs=(args.seed, args.time_limit_s)))
            results = pool.map(check_input, indices, chunksize=8)
        try:
            for index, verdict, violation, seconds, kinds in results:
                verdicts[verdict] += 1
                for name in ([violation] if violation else []) + (["over-time"] if seconds > limit else []):
                    violations[name] += 1
                    examples.setdefault(name, [])
                    if len(examples[name]) < 5:
                        examples[name].append(index)
                if seconds > slowest[0]:
                    slowest = (seconds, index, kinds)
        except BrokenProcessPool:  # a worker died inside check (a signal, the interpreter crashed)
            violations["worker-died"] += 1
            examples["worker-died"] = [args.start + sum(verdicts.values())]  # the first input not answered
    print(json.dumps({
        "inputs": args.n, "answered": sum(verdicts.values()), "seed": args.seed, "start": args.start, "jobs": args.jobs,
        "contract_violations": sum(violations.values()), "violations_by_class": dict(violations),
        "first_violating_inputs": examples, "verdicts": dict(verdicts),
        "slowest_s": round(slowest[0], 3), "slowest_input": slowest[1], "slowest_mutations": slowest[2],
        "limit_s": limit, "slowest_to_limit": round(slowest[0] / limit, 3),
        "total_s": round(time.perf_counter() - start, 1),
        "cpu_s_per_input": round((_cpu_s() - cpu_start) / max(sum(verdicts.values()), 1), 4),
    }))


if __name__ == "__main__":
    main()
