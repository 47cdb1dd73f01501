"""Wall time and peak memory of the default run against its budget (10 min, 4 GiB).

    python benchmarks/default_run.py [--repeat N]

Runs ``mlperf-grpo run`` on the built-in default in a child process N times (default 1)
and, as a baseline in the same script, a child that only imports the package and loads
the model (the fixed start-up cost). Prints seconds, peak RSS and the ratios
run/budget and run/baseline. Machines here are shared and noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

from mlperf_grpo.cli.parser import parse_args_one_line

BUDGET_S = 600.0
BUDGET_BYTES = 4 * 1024**3
BASELINE = (
    "from mlperf_grpo.inference.hf import HFEngine; HFEngine('builtin:arithmetic-tiny', 'float32')"
)


def timed_child(argv: list[str]) -> tuple[float, int]:
    """Run a child; return (wall seconds, its peak RSS in bytes)."""
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 3):
        sys.exit(f"child failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    # ru_maxrss of RUSAGE_CHILDREN is the largest child so far (KiB on Linux).
    return wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    args = parse_args_one_line(parser)
    base_s, base_rss = timed_child([sys.executable, "-c", BASELINE])
    print(f"baseline (import + load model): {base_s:.2f} s, peak RSS {base_rss / 2**20:.0f} MiB")
    for i in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            wall, rss = timed_child([sys.executable, "-m", "mlperf_grpo.cli", "run", "--output", f"{tmp}/run"])
        print(
            f"default run {i + 1}: {wall:.2f} s ({wall / BUDGET_S:.3f} of the 10 min budget, "
            f"{wall / base_s:.1f}x baseline), peak RSS {rss / 2**20:.0f} MiB ({rss / BUDGET_BYTES:.3f} of 4 GiB)"
        )


if __name__ == "__main__":
    main()
