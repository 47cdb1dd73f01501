"""The log tools (`check`, `merge`, `report`, `plan`, `package`) run where torch is not
installed: every command, on its success path and on a bad-input path, in a child
process whose import system refuses `torch` as an uninstalled package would."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from logtools_helpers import DATA

ROOT = Path(__file__).resolve().parents[2]

NO_TORCH = """
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            sys.stderr.write("TORCH IMPORTED\\n")
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
from mlperf_grpo.cli import main
sys.exit(main(sys.argv[1:]))
"""
"""``python -c NO_TORCH ARGS``: ``mlperf-grpo ARGS`` with torch uninstallable; every attempt
to import it is said on stderr, whether or not the caller catches the error."""


def run_without_torch(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TORCH, *map(str, args)], capture_output=True, text=True, cwd=cwd)


def logs(tmp_path: Path) -> tuple[Path, Path]:
    """The real run's training lines and its evaluator's lines, as two files."""
    lines = (DATA / "mlperf.log").read_text().splitlines(keepends=True)
    first = next(i for i, ln in enumerate(lines) if '"eval_start"' in ln)
    (tmp_path / "train.log").write_text("".join(lines[:first]))
    (tmp_path / "eval.log").write_text("".join(lines[first:]))
    return tmp_path / "train.log", tmp_path / "eval.log"


CASES = {
    "check": (lambda t: ["check", DATA / "mlperf.log"], 0),
    "check-bad": (lambda t: ["check", t / "missing.log"], 2),
    "merge": (lambda t: ["merge", "--train", logs(t)[0], "--eval", logs(t)[1], "-o", t / "out.log"], 0),
    "merge-bad": (lambda t: ["merge", "--train", t / "missing.log", "--eval", logs(t)[1], "-o", t / "out.log"], 2),
    "report": (lambda t: ["report", DATA / "mlperf.log", "-o", t / "r.png"], 0),
    "report-bad": (lambda t: ["report", t / "missing.log", "-o", t / "r.png"], 2),
    "plan": (lambda t: ["plan", "--global-batch-size", "256"], 0),
    "plan-bad": (lambda t: ["plan", "--global-batch-size", "17"], 2),
    "plan-config": (lambda t: ["plan", "--config", ROOT / "configs" / "open-default.yaml"], 0),
    "plan-config-bad": (lambda t: ["plan", "--config", t / "missing.yaml"], 2),
    "plan-memory": (lambda t: ["plan", "--memory", "--model-shape", "qwen3.5-397b-a17b", "--world-size", "64",
                               "--tensor-parallel-size", "8"], 0),
    "plan-memory-config": (lambda t: ["plan", "--memory", "--model-config", ROOT / "src/mlperf_grpo/assets/arithmetic-tiny",
                                      "--world-size", "2", "--json"], 0),
    "plan-memory-bad": (lambda t: ["plan", "--memory", "--model-shape", "qwen3.5-397b-a17b", "--world-size", "64",
                                   "--tensor-parallel-size", "3"], 2),
    "package-bad": (lambda t: ["package", DATA, "--system", "s", "--output", t / "sub"], 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_log_tool_never_imports_torch(case, tmp_path):
    make_args, code = CASES[case]
    done = run_without_torch(*make_args(tmp_path), cwd=tmp_path)
    assert done.returncode == code, done.stdout + done.stderr
    assert "TORCH IMPORTED" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    if code == 2:
        assert done.stderr.startswith("mlperf-grpo: error: ") and done.stderr.count("\n") == 1, done.stderr


@pytest.mark.slow
def test_package_never_imports_torch(tmp_path):
    """Three copies of the real run, each logging its own seed (package refuses copies of
    one run): the official checkers run to the end (about 20 s)."""
    runs = [shutil.copytree(DATA, tmp_path / f"run{i}") for i in range(3)]
    for i, run in enumerate(runs):
        log = run / "mlperf.log"
        text = log.read_text()
        seeded = re.sub(r'("key": "seed", "value": )\d+', rf"\g<1>{i + 1}", text)
        assert seeded.count('"key": "seed"') == 1 and (i == 0) == (seeded == text)
        log.write_text(seeded)
    done = run_without_torch("package", *runs, "--system", "s", "--output", tmp_path / "sub", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TORCH IMPORTED" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "package_checker: PASS" in done.stdout
