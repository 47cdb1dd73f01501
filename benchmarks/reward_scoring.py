"""Cost of scoring rewards in killable worker processes against in-process threads.

    python benchmarks/reward_scoring.py [--repeat N]

Scores the built-in arithmetic reward on a GRPO step's rollouts (256 completions) and on
a validation (1,004 completions) with :func:`mlperf_grpo.tasks.scoring.score` (a warm
pool of worker processes; what training and validation use) and, as the baseline in the
same run, with 4 threads of this process calling the same function (what the thread
scorer did before rewards moved to processes). Also times the pool's cold start (first
call: worker start-up and import). Prints one JSON line: median seconds per call and the
ratio pool/threads. Machines here are shared and noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from mlperf_grpo.cli.parser import parse_args_one_line
from mlperf_grpo.tasks import arithmetic, scoring

SIZES = {"step": 256, "validation": 1004}


def _items(n: int) -> list:
    tasks = arithmetic.validation_tasks(251)
    return [(tasks[i % 251].answer if i % 3 else "99=" + tasks[i % 251].answer, tasks[i % 251]) for i in range(n)]


def _threads(items: list) -> list[float]:
    with ThreadPoolExecutor(max_workers=scoring.REWARD_WORKERS) as pool:
        return list(pool.map(lambda item: arithmetic.reward(*item), items))


def _median_s(fn, items: list, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(items)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parse_args_one_line(parser)
    t0 = time.perf_counter()
    scoring.score(arithmetic.reward, _items(8))
    figures: dict[str, float] = {"pool_cold_start_s": round(time.perf_counter() - t0, 4)}
    for name, n in SIZES.items():
        items = _items(n)
        assert scoring.score(arithmetic.reward, items) == _threads(items)
        pool_s = _median_s(lambda it: scoring.score(arithmetic.reward, it), items, args.repeat)
        threads_s = _median_s(_threads, items, args.repeat)
        figures[f"{name}_pool_s"] = round(pool_s, 5)
        figures[f"{name}_threads_s"] = round(threads_s, 5)
        figures[f"{name}_overhead_s"] = round(pool_s - threads_s, 5)
        figures[f"{name}_ratio_pool_to_threads"] = round(pool_s / threads_s, 2)
    figures["workers"] = scoring.REWARD_WORKERS
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
