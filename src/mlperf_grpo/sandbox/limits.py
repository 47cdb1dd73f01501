"""What a sandboxed command may use, and what it gave back. Torch-free.

The defaults bound one tool command of an agent trajectory on a small machine; the
reference's figures are the command timeout (60 s a command, NeMo Gym's SWE agents) and
nothing else: memory, processes, CPU time, file size and output are our bounds, chosen so
that 64 sandboxes at once cannot take a 2-core, 8 GiB machine down.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
MIB = 1 << 20
MAX_COMMAND_BYTES = 32 * 4096 - 1
"""The longest command (UTF-8 bytes) one ``bash -c`` argument carries: Linux's
``MAX_ARG_STRLEN`` (32 pages, the terminating NUL included); execve refuses a longer one
(E2BIG)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one command in a sandbox (every process it starts inherits them).

    command_timeout_s: wall-clock limit of one command; the whole process tree is killed.
    memory_bytes: address space of each process (``RLIMIT_AS``; ``RLIMIT_DATA`` too).
    processes: processes and threads alive at once in the sandbox (``RLIMIT_NPROC``,
        counted per sandbox: each has its own user namespace).
    cpu_s: CPU seconds of each process (``RLIMIT_CPU``; SIGKILL at the limit).
    file_bytes: size of any one file written (``RLIMIT_FSIZE``; the write fails).
    tmp_bytes: size of the command's private ``/tmp``, and of its ``/dev/shm`` (each a tmpfs: memory).
    output_bytes: stdout+stderr kept of one command: its first and last halves, with a
        line saying how many bytes between them were left out.
    output_drain_bytes: output read in all from one command before it is killed
        (``yes`` would otherwise keep the reader busy until the timeout).
    min_free_disk_bytes: a command still running when the file system holding the
        repository copies has less free space than this is killed (many files, each under
        ``file_bytes``, would otherwise fill the disk the run's checkpoints need); so is
        one when fewer than 1% of its inodes are free (``process.MIN_FREE_INODE_SHARE``).
    """

    command_timeout_s: float = 60.0
    memory_bytes: int = 4 * GIB
    processes: int = 256
    cpu_s: int = 120
    file_bytes: int = 1 * GIB
    tmp_bytes: int = 512 * MIB
    output_bytes: int = 1 * MIB
    output_drain_bytes: int = 64 * MIB
    min_free_disk_bytes: int = 1 * GIB

    def __post_init__(self) -> None:
        bad = [f"{name}={value!r}" for name, value in vars(self).items() if not value > 0]
        if bad:
            raise ValueError(f"sandbox limits must be positive: {', '.join(bad)}")
        if self.output_drain_bytes < self.output_bytes:
            raise ValueError(
                f"sandbox limits: output_drain_bytes ({self.output_drain_bytes}) must be at least "
                f"output_bytes ({self.output_bytes})"
            )


@dataclass(frozen=True)
class CommandResult:
    """One command's outcome.

    exit_code: the command's exit status; None when it was killed (timeout or a limit).
    output: stdout and stderr interleaved, decoded as UTF-8 (errors replaced): all of it,
        or its first and last ``output_bytes / 2`` around a line
        ``[... N bytes of output left out ...]``.
    timed_out: the wall-clock limit killed it.
    output_truncated: more output came than was kept.
    kill_reason: "" when it ended by itself, else why it was killed: "timeout",
        "output" (more than ``output_drain_bytes``), "disk" (free space under
        ``min_free_disk_bytes``), "closed" (the sandbox was closed),
        "interrupted" (the caller was interrupted: SIGTERM, Ctrl-C).
    """

    exit_code: int | None
    output: str
    timed_out: bool
    output_truncated: bool
    kill_reason: str = ""


def limited_shell(limits: SandboxLimits) -> list[str]:
    """argv prefix that runs a shell command (the next argument) under ``limits``, set
    inside the sandbox with bash's ``ulimit`` (works in any image with bash; soft = hard,
    so the command cannot raise them): ``[*limited_shell(l), command]``."""
    kib = 1024
    settings = (
        f"ulimit -c 0 && ulimit -v {limits.memory_bytes // kib} && ulimit -d {limits.memory_bytes // kib}"
        f" && ulimit -u {limits.processes} && ulimit -t {limits.cpu_s}"
        f" && ulimit -f {max(1, limits.file_bytes // kib)}"  # bash counts -f in 1024-byte blocks
    )
    return ["bash", "-c", f'{settings} || exit 125; exec bash -c "$1"', "sandbox-limits"]
