"""Start-up and command round trip of the agent's sandbox (bubblewrap), against a plain
``bash -c true`` subprocess measured in the same run.

    python benchmarks/sandbox.py                  # 20 sandboxes, 20 commands each
    python benchmarks/sandbox.py --sandboxes 5 --commands 50 --files 2000 --dir /dev/shm

Makes a repository of ``--files`` small files (a task's checkout), then ``--sandboxes``
times: creates a :class:`~mlperf_grpo.sandbox.Sandbox` on it (copy, ownership, identity
files: ``startup_s``), runs ``true`` ``--commands`` times (``command_s``: bwrap, namespaces,
limits, bash, the wait for the namespace to end) and closes it (``close_s``). Prints ONE
JSON line: the medians, ``plain_command_s`` (a bare ``bash -c true`` through the same
runner, no sandbox) and ``command_over_plain`` (what the sandbox adds per command).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mlperf_grpo.errors import ConfigError
from mlperf_grpo.sandbox import Sandbox, SandboxLimits, backend_name
from mlperf_grpo.sandbox.process import run_command


def make_repo(folder: Path, files: int) -> Path:
    """``files`` small Python files in folders of 50."""
    for index in range(files):
        path = folder / f"pkg{index // 50}" / f"mod{index}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"def f{index}(x):\n    return x + {index}\n")
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sandboxes", type=int, default=20)
    parser.add_argument("--commands", type=int, default=20)
    parser.add_argument("--files", type=int, default=200, help="files in the task's repository")
    parser.add_argument("--dir", default=None, help="where the repository and sandboxes go (default: the temp dir; "
                        "/dev/shm shows the cost without the disk)")
    args = parser.parse_args(argv)
    bad = [f"--{name} {getattr(args, name)}" for name in ("sandboxes", "commands", "files") if getattr(args, name) < 1]
    if bad:
        parser.exit(2, f"benchmarks/sandbox.py: {', '.join(bad)}: must be at least 1\n")
    if args.dir is not None and not Path(args.dir).is_dir():
        parser.exit(2, f"benchmarks/sandbox.py: --dir {args.dir} is not a directory\n")
    try:
        backend = backend_name()
    except ConfigError as error:
        parser.exit(2, f"benchmarks/sandbox.py: {error}\n")
    limits = SandboxLimits()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        repo = make_repo(Path(tmp) / "repo", args.files)
        startup, command, close, plain = [], [], [], []
        for _ in range(args.sandboxes):
            start = time.perf_counter()
            box = Sandbox(repo, limits, Path(tmp) / "sandboxes")
            startup.append(time.perf_counter() - start)
            for _ in range(args.commands):
                start = time.perf_counter()
                result = box.run("true")
                command.append(time.perf_counter() - start)
                assert result.exit_code == 0, result
                start = time.perf_counter()
                run_command(["bash", "-c", "true"], limits, timeout_s=60)
                plain.append(time.perf_counter() - start)
            start = time.perf_counter()
            box.close()
            close.append(time.perf_counter() - start)
    median = statistics.median
    print(json.dumps({
        "backend": backend, "dir": args.dir or tempfile.gettempdir(), "sandboxes": args.sandboxes, "commands_per_sandbox": args.commands,
        "repo_files": args.files, "startup_s": round(median(startup), 4), "command_s": round(median(command), 4),
        "close_s": round(median(close), 4), "plain_command_s": round(median(plain), 4),
        "command_over_plain": round(median(command) / median(plain), 2),
    }))


if __name__ == "__main__":
    sys.exit(main())
