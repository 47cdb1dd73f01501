"""Model-written code is hostile: each attempt is contained, the command ends with a
clear reason, the sandbox (and the run) go on, and nothing is left behind."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
from sandbox_helpers import descendants, make_repo, new_descendants, processes_with, require_bwrap

import mlperf_grpo
from mlperf_grpo.sandbox import Sandbox, SandboxLimits, cleanup_leftovers, root_problem, seccomp

MIB = 1 << 20
LIMITS = SandboxLimits(command_timeout_s=10, memory_bytes=512 * MIB, processes=64, cpu_s=20,
                       file_bytes=4 * MIB, tmp_bytes=8 * MIB, output_bytes=64 * 1024, output_drain_bytes=4 * MIB)


@pytest.fixture
def sandbox(tmp_path):
    require_bwrap()
    before = set(descendants(os.getpid()))
    box = Sandbox(make_repo(tmp_path / "repo"), LIMITS, tmp_path / "run" / "sandboxes")
    yield box
    box.close()
    assert not box.folder.exists()
    assert new_descendants(before) == []


def still_works(box: Sandbox) -> None:
    result = box.run("echo ok")
    assert (result.exit_code, result.output) == (0, "ok\n")


def test_no_process_inside_reads_the_host_s_paths_in_proc(sandbox, tmp_path):
    """bwrap's options (every bind's host path: the sandbox's folder, the run's) were its
    command line, which the sandbox read as /proc/1/cmdline."""
    result = sandbox.run("cat /proc/[0-9]*/cmdline /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'")
    assert result.exit_code in (0, 1) and "bwrap" in result.output, result.output[:500]
    assert str(tmp_path) not in result.output and str(sandbox.folder) not in result.output, result.output[:2000]


def test_files_outside_the_sandbox_are_not_there(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    (sandbox.workdir / "link").symlink_to(secret)  # as a repository's own link would be copied
    for command in (f"cat {secret}", "cat link", f"ls {tmp_path}", "cat /proc/1/root" + str(secret),
                    "cat /etc/shadow"):
        result = sandbox.run(command)
        assert "TOP-SECRET" not in result.output, command
    assert "secret.txt" not in sandbox.run("find / -name 'secret*' 2>/dev/null").output
    assert sandbox.run(f"cat {secret}").exit_code != 0
    still_works(sandbox)


def test_nothing_outside_the_repository_copy_is_writable(sandbox, tmp_path):
    run_dir = tmp_path / "run"
    for target in (run_dir / "pwned", Path("/usr/pwned"), Path("/etc/pwned"), Path(os.__file__).parent / "pwned",
                   sandbox.folder / "pwned", Path("/dev/pwned"), Path("/pwned")):
        result = sandbox.run(f"echo x > {target}")
        assert result.exit_code != 0, target
        assert not target.exists(), target
    assert sandbox.run("echo x > inside && echo y > /tmp/private && echo z > /dev/shm/semaphores").exit_code == 0
    threads = "from concurrent.futures import ProcessPoolExecutor as P; print(list(P(2).map(abs, [-1, -2])))"
    assert sandbox.run(f"python -c '{threads}'").output == "[1, 2]\n"  # multiprocessing has /dev/shm
    assert (sandbox.workdir / "inside").read_text() == "x\n"


def test_no_network_to_the_host_or_outside(sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    probe = ("import socket,sys\n"
             "for host in sys.argv[1:]:\n"
             "    s = socket.socket(); s.settimeout(2)\n"
             "    try:\n"
             "        s.connect((host.split(':')[0], int(host.split(':')[1]))); print('CONNECTED', host)\n"
             "    except OSError as e: print('blocked', host, e)\n")
    result = sandbox.run(f"python -c \"{probe}\" 127.0.0.1:{port} 1.1.1.1:53 8.8.8.8:443")
    listener_accepted = True
    try:
        listener.accept()
    except BlockingIOError:
        listener_accepted = False
    listener.close()
    assert result.exit_code == 0, result.output
    assert "CONNECTED" not in result.output and result.output.count("blocked") == 3
    assert not listener_accepted


def test_a_fork_bomb_is_held_at_the_process_limit_and_killed(sandbox):
    start = time.monotonic()
    result = sandbox.run("f(){ f | f & }; f 2>/dev/null; sleep 1; echo count=$(ls /proc | grep -c '^[0-9]')",
                         timeout_s=3)
    assert time.monotonic() - start < 3 + 6
    if result.exit_code is not None:  # it ended on its own: the count it printed respects the limit
        assert int(result.output.split("count=")[1].split()[0]) <= LIMITS.processes + 1  # + the namespace's init (bwrap)
    still_works(sandbox)


def test_a_process_ignoring_sigterm_and_a_detached_one_die_with_their_command(sandbox):
    marker = f"sigterm-immune-{os.getpid()}"
    stubborn = f"import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(1000)  # {marker}"
    start = time.monotonic()
    result = sandbox.run(f"python -c '{stubborn}'", timeout_s=1)
    assert result.timed_out and result.exit_code is None and result.kill_reason == "timeout"
    assert time.monotonic() - start < 1 + 6
    result = sandbox.run(f"(setsid nohup python -c '{stubborn}' >/dev/null 2>&1 &); sleep 1000 & echo started")
    assert result.exit_code == 0 and "started" in result.output
    assert processes_with(marker) == []
    still_works(sandbox)


def test_ten_gigabytes_of_output_end_fast_and_bounded(sandbox):
    start = time.monotonic()
    result = sandbox.run("head -c 10000000000 /dev/zero | tr '\\0' y")
    assert time.monotonic() - start < 8
    assert result.kill_reason == "output" and result.exit_code is None and result.output_truncated
    head, left_out, tail = result.output.split("\n")
    assert head == tail == "y" * (LIMITS.output_bytes // 2) and left_out.startswith("[... ")
    result = sandbox.run("echo first; head -c 200000 /dev/zero | tr '\\0' y; echo; echo last")  # not killed
    assert result.exit_code == 0 and result.output_truncated
    assert result.output.startswith("first\ny") and result.output.endswith("y\nlast\n")
    assert f"[... {200000 + 6 + 1 + 5 - LIMITS.output_bytes} bytes of output left out ...]" in result.output
    still_works(sandbox)


def test_files_and_tmp_are_bounded(sandbox):
    result = sandbox.run("head -c 100000000 /dev/zero > big; ls -l big")
    assert result.exit_code != 0 or "File size limit" in result.output
    assert (sandbox.workdir / "big").stat().st_size <= LIMITS.file_bytes
    result = sandbox.run("for i in 1 2 3 4; do head -c 3000000 /dev/zero > /tmp/f$i || exit 9; done")
    assert result.exit_code == 9  # the 8 MiB /tmp is full at the third file
    still_works(sandbox)


def test_a_memory_hog_fails_alone(sandbox):
    result = sandbox.run("python -c 'x = bytearray(8 << 30)'")
    assert result.exit_code != 0 and "MemoryError" in result.output
    still_works(sandbox)


def test_a_timeout_kills_the_tree_in_time(sandbox):
    start = time.monotonic()
    result = sandbox.run("sleep 100 & sleep 100", timeout_s=0.5)
    assert result.timed_out and result.exit_code is None
    assert time.monotonic() - start < 0.5 + 6
    still_works(sandbox)


def test_no_new_user_namespaces_but_threads_and_subprocesses_work(sandbox):
    if seccomp.filter_program() is None and os.geteuid() == 0:
        pytest.skip("the seccomp filter is x86-64 only; this root run's bwrap cannot refuse user namespaces")
    for command in ("unshare -U true", "unshare -r id", "unshare -Upf --mount-proc true"):
        result = sandbox.run(command)
        assert result.exit_code != 0 and "Operation not permitted" in result.output, command
    threads = ("import subprocess, threading\n"
               "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
               "print(subprocess.run(['echo', 'child'], capture_output=True, text=True).stdout.strip())")
    assert sandbox.run(f"python -c \"{threads}\"").output == "thread\nchild\n"


REFUSAL_PROBE = """
import ctypes, errno, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
for number in map(int, sys.argv[1:]):
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(number), *[ctypes.c_long(0)] * 6)
    print(number, result, errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno()))
try:
    socket.socket(40, socket.SOCK_STREAM)  # AF_VSOCK: not network-namespaced
    print("vsock opened")
except OSError as error:
    print("vsock", errno.errorcode.get(error.errno))
socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()
"""


def test_kernel_surface_no_command_needs_is_refused_with_eperm(sandbox):
    """io_uring, keyrings, eBPF, perf, userfaultfd, modules, kexec, mounts, handles, ...
    (seccomp.DENIED, as Docker's default profile) and vsock: each call fails with EPERM,
    and ordinary commands (git, Python, a Unix socket) still work."""
    if seccomp.filter_program() is None:
        pytest.skip("the seccomp filter is x86-64 only")
    numbers = sorted(seccomp.DENIED.values())
    result = sandbox.run("python - " + " ".join(map(str, numbers)), input_bytes=REFUSAL_PROBE.encode())
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[:-1] == [f"{number} -1 EPERM" for number in numbers] and lines[-1] == "vsock EPERM", result.output
    git = sandbox.run("git init -q . && git add -A && git -c user.name=a -c user.email=a@b commit -qm x && "
                      "git log --oneline | wc -l")
    assert (git.exit_code, git.output) == (0, "1\n"), git.output
    still_works(sandbox)


PERSONALITY_PROBE = """
import ctypes, errno, sys
libc = ctypes.CDLL(None, use_errno=True)
for persona in map(int, sys.argv[1:]):
    ctypes.set_errno(0)
    result = libc.personality(ctypes.c_ulong(persona))
    print(hex(persona), "refused" if result == -1 else "set", errno.errorcode.get(ctypes.get_errno(), 0))
    libc.personality(ctypes.c_ulong(0))
"""


def test_personality_sets_only_docker_s_personas(sandbox):
    """ADDR_NO_RANDOMIZE (0x40000) and READ_IMPLIES_EXEC (0x400000) are refused, so a command
    cannot turn address randomization off for what it runs; Docker's five personas work."""
    if seccomp.filter_program() is None:
        pytest.skip("the seccomp filter is x86-64 only")
    assert len(seccomp.filter_program()) // 8 <= 80  # each system call walks at most this many records
    header = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
    assert not header.exists() or f"#define __NR_personality {seccomp.NR_PERSONALITY}\n" in header.read_text()
    personas = [*seccomp.PERSONALITY_ALLOWED, 0x40000, 0x400000, 0x40008, 0x1_0000_0000 | 0x40000]
    result = sandbox.run("python - " + " ".join(map(str, personas)), input_bytes=PERSONALITY_PROBE.encode())
    assert result.output.splitlines() == [f"{hex(p)} set 0" for p in seccomp.PERSONALITY_ALLOWED] + [
        f"{hex(p)} refused EPERM" for p in personas[5:]], result.output
    refused = sandbox.run("setarch -R true")
    assert refused.exit_code != 0 and "Operation not permitted" in refused.output, refused.output
    assert sandbox.run("setarch x86_64 true && python -c 'import os'").exit_code == 0
    still_works(sandbox)


def test_commands_hold_no_capability_not_even_in_their_bounding_set(sandbox):
    """A root run's setpriv lacked CAP_SETPCAP, so its ``--bounding-set=-all`` was skipped
    silently and every command kept the host's full bounding set."""
    status = dict(line.split(":\t", 1) for line in sandbox.run("cat /proc/self/status").output.splitlines()
                  if line.startswith(("Cap", "NoNewPrivs")))
    assert status == {"CapInh": "0000000000000000", "CapPrm": "0000000000000000", "CapEff": "0000000000000000",
                      "CapBnd": "0000000000000000", "CapAmb": "0000000000000000", "NoNewPrivs": "1"}, status


def test_a_command_longer_than_a_command_line_is_refused_before_it_starts(sandbox):
    """execve refuses an argument over 128 KiB (E2BIG): the OSError escaped run()."""
    with pytest.raises(ValueError, match="a command of 140005 bytes is over the 131071"):
        sandbox.run("true " + "#" * 140_000)
    still_works(sandbox)


def test_output_that_is_not_utf8_is_replaced(sandbox):
    result = sandbox.run("printf 'ok\\377\\376\\n'")
    assert result.exit_code == 0 and result.output == "ok\ufffd\ufffd\n"


def test_the_run_s_environment_and_this_package_are_not_shown(tmp_path, monkeypatch):
    require_bwrap()
    monkeypatch.setenv("SECRET_TOKEN", "TOP-SECRET")
    src = Path(mlperf_grpo.__file__).resolve().parents[1]  # the package's folder made visible on purpose
    with Sandbox(make_repo(tmp_path / "repo"), LIMITS, tmp_path / "sandboxes", ro_paths=[src]) as box:
        result = box.run(f"env; ls -A {src}/mlperf_grpo | wc -l; ls {src} | grep -cx mlperf_grpo")
        assert "TOP-SECRET" not in result.output and result.output.split()[-2:] == ["0", "1"], result.output


def test_a_command_running_while_the_disk_fills_is_killed(tmp_path):
    require_bwrap()
    root = tmp_path / "sandboxes"
    root.mkdir()
    stats = os.statvfs(root)
    floor = stats.f_bavail * stats.f_frsize + (1 << 30)  # as if the disk were already nearly full
    limits = SandboxLimits(min_free_disk_bytes=floor)
    with Sandbox(make_repo(tmp_path / "repo"), limits, root) as box:
        start = time.monotonic()
        result = box.run("sleep 30")
        assert result.kill_reason == "disk" and result.exit_code is None and time.monotonic() - start < 5


def test_a_command_running_while_the_inodes_run_out_is_killed(tmp_path, monkeypatch):
    """Empty files take no bytes: the byte floor alone lets them use up the host's inodes."""
    require_bwrap()
    from mlperf_grpo.sandbox import process

    if os.statvfs(tmp_path).f_files == 0:
        pytest.skip("this file system counts no inodes (btrfs)")
    monkeypatch.setattr(process, "MIN_FREE_INODE_SHARE", 1.0)  # as if nearly every inode were used
    with Sandbox(make_repo(tmp_path / "repo"), LIMITS, tmp_path / "sandboxes") as box:
        start = time.monotonic()
        result = box.run("sleep 30")
        assert result.kill_reason == "disk" and result.exit_code is None and time.monotonic() - start < 5


def test_a_sandbox_root_reached_through_a_link_in_a_folder_others_may_write_is_refused(tmp_path):
    """The link's folder is checked, not only the folders above where the link points: whoever
    may write it can point the link (a root given as a path through it) at another folder."""
    shared, mine = tmp_path / "shared", tmp_path / "mine"
    mine.mkdir(mode=0o700)
    shared.mkdir()
    (shared / "link").symlink_to(mine)
    shared.chmod(0o777)
    for root in (shared / "link", shared / "link" / ".." / "mine"):
        assert root_problem(root) == (f"other users may write the folder {shared} above it (mode 777, not sticky) "
                                      f"and swap what is below it: chmod go-w {shared} (or +t)")
    assert root_problem(mine) == ""


def test_a_leftover_whose_marker_is_not_a_record_is_removed_not_an_error(tmp_path):
    """A marker of valid JSON but not an object with an integer pid (``{}``, ``[1]``) raised
    KeyError or AttributeError out of cleanup_leftovers, ending the run that cleaned."""
    root = tmp_path / "sandboxes"
    root.mkdir(mode=0o700)
    for index, text in enumerate(("{}", "[1]", '{"pid": "1"}', '{"pid": 1, "container": 5, "runtime": ["sh"]}')):
        folder = root / f"sbx-1-bad{index}"
        (folder / "testbed").mkdir(parents=True)
        (folder / "owner.json").write_text(text)
        os.utime(folder, (time.time() - 120, time.time() - 120))  # older than a setting-up sandbox's minute
    assert cleanup_leftovers(root) == 4
    assert list(root.iterdir()) == []
