"""``benchmarks/fuzz_check.py``: the inputs depend on the seed and the input number only,
so ``--jobs`` changes the speed, not the results."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def fuzz(*args: str) -> dict:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fuzz_check.py"), *args],
                         capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout)


def test_fuzz_results_are_the_same_with_one_or_two_jobs():
    one = fuzz("--n", "4", "--seed", "3", "--jobs", "1")
    two = fuzz("--n", "4", "--seed", "3", "--jobs", "2")
    assert one["contract_violations"] == two["contract_violations"] == 0
    assert one["verdicts"] == two["verdicts"] and sum(one["verdicts"].values()) == 4
    assert (one["jobs"], two["jobs"]) == (1, 2) and one["limit_s"] == 15.0
    last = fuzz("--n", "1", "--seed", "3", "--start", str(one["slowest_input"]))  # one input re-checked alone
    assert last["slowest_input"] == one["slowest_input"] and last["slowest_mutations"] == one["slowest_mutations"]


def test_fuzz_rejects_bad_options():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fuzz_check.py"), "--jobs", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--jobs" in out.stderr and "Traceback" not in out.stderr
