"""Run one host command line (a sandbox runtime's) with bounded output and a wall-clock
limit that kills its whole process group; nothing beyond what is kept is held in memory or
written to disk. Torch-free.

The resource limits of the sandboxed command are not set here: the runtime sets them
inside the sandbox (:func:`mlperf_grpo.sandbox.limits.limited_shell`), where they count per
sandbox; set on the host they would count every process of the user (``RLIMIT_NPROC``).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from mlperf_grpo.sandbox.limits import CommandResult, SandboxLimits

READ_CHUNK_BYTES = 1 << 16
KILL_GRACE_S = 5.0  # after SIGKILL, how long the pipe may stay open before we stop reading
DISK_CHECK_S = 0.25  # how often a running command's file system is checked for free space
MIN_FREE_INODE_SHARE = 0.01
"""A running command is killed ("disk") when fewer than this share of its file system's
inodes are free: empty files take no bytes, and ~40,000 a second for a 60 s command would
use up the host's inodes (the checkpoints, the log) where the byte floor never trips."""


def disk_short(path: str, min_free_bytes: int) -> bool:
    """The file system holding ``path`` has less than ``min_free_bytes`` free to an
    unprivileged writer, or fewer than :data:`MIN_FREE_INODE_SHARE` of its inodes free
    (one that counts no inodes, as btrfs, is judged by bytes only); False when ``path`` is gone."""
    try:
        stats = os.statvfs(path)
    except OSError:
        return False
    return (stats.f_bavail * stats.f_frsize < min_free_bytes
            or 0 < stats.f_files and stats.f_favail < MIN_FREE_INODE_SHARE * stats.f_files)


def data_fd(name: str, data: bytes) -> int:
    """A fresh readable descriptor (a memfd, close-on-exec) holding ``data`` from its start,
    for a child that reads it to the end (bwrap's ``--args`` and ``--seccomp``). The caller
    closes it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads (it was started in a new session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass


class HeadTail:
    """The first and the last ``limit // 2`` bytes of a stream (the error a test run ends
    with is at its end), never more than ``limit`` bytes held."""

    def __init__(self, limit: int) -> None:
        self.head_limit, self.tail_limit = limit - limit // 2, limit // 2
        self.head, self.tail, self.dropped = bytearray(), bytearray(), 0

    def add(self, chunk: bytes) -> None:
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if not chunk:
            return
        self.tail += chunk
        excess = len(self.tail) - self.tail_limit
        if excess > 0:
            self.dropped += excess
            del self.tail[:excess]

    @property
    def kept_bytes(self) -> int:
        return len(self.head) + len(self.tail)

    def text(self) -> str:
        """Head and tail decoded (UTF-8, errors replaced), with a line saying how many bytes
        were left out between them when some were."""
        head = self.head.decode("utf-8", errors="replace")
        tail = self.tail.decode("utf-8", errors="replace")
        if not self.dropped:
            return head + tail
        return f"{head}\n[... {self.dropped} bytes of output left out ...]\n{tail}"


class RunningCommand:
    """A started command; :meth:`finish` reads its output to the end under the limits;
    :meth:`kill` (from another thread: the sandbox's ``close``) ends it early."""

    def __init__(self, argv: Sequence[str], limits: SandboxLimits, input_bytes: bytes = b"",
                 env: dict[str, str] | None = None, pass_fds: tuple[int, ...] = (),
                 disk_path: str | None = None) -> None:
        self.limits, self.disk_path = limits, disk_path
        self.kill_reason = ""
        self.proc = subprocess.Popen(
            list(argv), stdin=subprocess.PIPE if input_bytes else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            close_fds=True, env=env, pass_fds=pass_fds,
        )
        if input_bytes:
            threading.Thread(target=self._feed, args=(input_bytes,), daemon=True).start()

    def _feed(self, data: bytes) -> None:
        try:
            self.proc.stdin.write(data)
        except (BrokenPipeError, OSError, ValueError):
            pass
        finally:
            try:
                self.proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass

    def kill(self, reason: str) -> None:
        """Kill the command's process group, recording why (the first reason stays)."""
        if not self.kill_reason:
            self.kill_reason = reason
        kill_group(self.proc)

    def finish(self, timeout_s: float) -> CommandResult:
        """Read the output until EOF, ``timeout_s``, ``output_drain_bytes`` or, with
        ``disk_path``, its file system's free space under ``min_free_disk_bytes`` or free inodes
        under :data:`MIN_FREE_INODE_SHARE` (checked
        every :data:`DISK_CHECK_S` from the command's start on); wait for exit."""
        try:
            kept, total = self._read(time.monotonic() + timeout_s)
            try:
                code = self.proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                self.kill(self.kill_reason or "timeout")
                code = self.proc.wait()
        except BaseException:  # SIGTERM (Terminated), Ctrl-C: nothing may outlive the caller's unwinding
            self.kill("interrupted")
            self.proc.wait()
            raise
        finally:
            kill_group(self.proc)  # stragglers in the group (none under bwrap: its pid namespace is gone)
            for stream in (self.proc.stdout, self.proc.stdin):
                if stream is not None and not stream.closed:
                    stream.close()
        text = kept.text()
        killed = bool(self.kill_reason)
        return CommandResult(
            exit_code=None if killed else code, output=text,
            timed_out=self.kill_reason == "timeout", output_truncated=total > kept.kept_bytes,
            kill_reason=self.kill_reason,
        )

    def _read(self, deadline: float) -> tuple["HeadTail", int]:
        fd = self.proc.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        kept, total, limits = HeadTail(self.limits.output_bytes), 0, self.limits
        grace_end, next_disk_check = None, time.monotonic() + DISK_CHECK_S
        while True:
            now = time.monotonic()
            if grace_end is None and now >= deadline:
                self.kill("timeout")
            if self.disk_path is not None and grace_end is None and now >= next_disk_check:
                next_disk_check = now + DISK_CHECK_S
                if disk_short(self.disk_path, limits.min_free_disk_bytes):
                    self.kill("disk")
            if self.kill_reason and grace_end is None:
                grace_end = now + KILL_GRACE_S
            end = grace_end if grace_end is not None else deadline
            if now >= end and grace_end is not None:
                break
            if not poller.poll(max(0.0, min(end - now, DISK_CHECK_S)) * 1000):
                continue
            chunk = os.read(fd, READ_CHUNK_BYTES)
            if not chunk:
                break
            total += len(chunk)
            kept.add(chunk)
            if total > limits.output_drain_bytes and not self.kill_reason:
                self.kill("output")
        return kept, total


def wait_gone(pid: int, start_time: int | None, timeout_s: float) -> bool:
    """Wait until process ``pid`` (with kernel start time ``start_time``) has exited (gone or
    a zombie); False if it still runs after ``timeout_s``."""
    from mlperf_grpo.sandbox.leftovers import process_start_time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        fields = text[text.rindex(")") + 2:].split()
        if fields[0] in ("Z", "X") or (start_time is not None and process_start_time(pid) != start_time):
            return True
        time.sleep(0.002)
    return False


def run_command(argv: Sequence[str], limits: SandboxLimits, timeout_s: float,
                input_bytes: bytes = b"", env: dict[str, str] | None = None) -> CommandResult:
    """Run ``argv`` to the end under ``limits`` (see :class:`RunningCommand`)."""
    return RunningCommand(argv, limits, input_bytes, env).finish(timeout_s)
