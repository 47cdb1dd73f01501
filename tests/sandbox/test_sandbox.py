"""The sandbox's life: its copy, close(), SIGTERM and SIGKILL of the run, leftovers, and
the command lines of the container runtimes (not installed here: checked as argv)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
from sandbox_helpers import descendants, make_repo, new_descendants, processes_with, require_bwrap

from mlperf_grpo.errors import ConfigError
from mlperf_grpo.sandbox import INSIDE_WORKDIR, Sandbox, SandboxLimits, cleanup_leftovers, containers, root_problem, seccomp
from mlperf_grpo.sandbox.limits import limited_shell

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_each_sandbox_has_its_own_copy_and_close_leaves_nothing(tmp_path):
    require_bwrap()
    before = set(descendants(os.getpid()))
    repo = make_repo(tmp_path / "repo")
    (repo / "link").symlink_to("calc.py")
    root = tmp_path / "sandboxes"
    with Sandbox(repo, SandboxLimits(), root) as one, Sandbox(repo, SandboxLimits(), root) as two:
        assert one.inside_workdir == INSIDE_WORKDIR and one.backend == "bwrap"
        assert one.run("sed -i 's/a - b/a + b/' calc.py && cat link").output == "def add(a, b):\n    return a + b\n"
        assert "a - b" in two.run("cat calc.py").output and "a - b" in (repo / "calc.py").read_text()
        assert (one.workdir / "link").is_symlink()
    assert sorted(root.iterdir()) == [] and new_descendants(before) == []
    assert one.run("echo late").kill_reason == "closed"
    one.close()  # idempotent


def test_close_removes_a_tree_deeper_than_python_s_recursion_limit_without_following_links(tmp_path):
    """2100 nested folders (deeper than ``sys.getrecursionlimit()``, longer than PATH_MAX)
    made shutil.rmtree raise RecursionError out of close(), leaving the folder behind."""
    require_bwrap()
    host_file = tmp_path / "host.txt"
    host_file.write_text("keep\n")
    root = tmp_path / "sandboxes"
    with Sandbox(make_repo(tmp_path / "repo"), SandboxLimits(), root) as box:
        deep = ("import os\nfor i in range(2100):\n    os.mkdir('d'); os.chdir('d')\n"
                f"os.symlink({str(host_file)!r}, 'link'); os.symlink('/testbed', 'up'); os.mkdir('shut', 0)\n"
                "open('f', 'w').write('x')\nprint(len(os.getcwd()))")
        result = box.run(f"python3 -c \"{deep}\"")
        assert result.exit_code == 0 and int(result.output) > 4096, result.output
    assert list(root.iterdir()) == [] and host_file.read_text() == "keep\n"


def test_remove_tree_stops_when_a_folder_is_moved_out_from_under_it(tmp_path, monkeypatch):
    """Climbing back through ``..`` from a folder moved elsewhere would empty that elsewhere."""
    from mlperf_grpo.sandbox import leftovers

    (tmp_path / "tree" / "a" / "b").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "keep").write_text("keep\n")
    empty = leftovers._empty_but_folders

    def moving(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/a/b"):
            (tmp_path / "tree" / "a" / "b").rename(tmp_path / "elsewhere" / "b")
        return empty(fd)

    monkeypatch.setattr(leftovers, "_empty_but_folders", moving)
    with pytest.raises(OSError, match="was moved while it was being removed"):
        leftovers.remove_tree(tmp_path / "tree")
    assert (tmp_path / "elsewhere" / "keep").read_text() == "keep\n"


def test_remove_tree_reads_a_wide_folder_a_batch_at_a_time_not_once_per_sub_folder(tmp_path, monkeypatch):
    """Rescanning a folder from its start after each sub-folder made close() of a sandbox
    whose command made 50,000 sibling folders take 22 s (ext4 re-reads the removed entries)."""
    from mlperf_grpo.sandbox import leftovers

    wide, folders = tmp_path / "wide", 2500
    wide.mkdir()
    for i in range(folders):
        (wide / f"w{i}").mkdir()
        (wide / f"w{i}" / "f").touch()
    scans, scandir = [], os.scandir
    monkeypatch.setattr(os, "scandir", lambda fd: scans.append(fd) or scandir(fd))
    leftovers.remove_tree(wide)
    assert not wide.exists()
    assert len(scans) < 1.1 * folders  # each sub-folder once, the wide one once per batch (was once per sub-folder)


def test_a_close_cut_short_keeps_the_marker_so_the_next_run_removes_the_rest(tmp_path, monkeypatch):
    """remove_tree unlinked owner.json first: a run killed (SIGKILL, SIGTERM) while closing a
    large sandbox left a folder without a marker, which cleanup_leftovers kept for a minute."""
    from mlperf_grpo.sandbox import leftovers

    require_bwrap()
    box = Sandbox(make_repo(tmp_path / "repo"), SandboxLimits(), tmp_path / "sandboxes")
    assert box.run("mkdir -p a/b c/d").exit_code == 0
    empty = leftovers._empty_but_folders

    def stopped(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/testbed/c"):
            raise KeyboardInterrupt  # as SIGTERM's Terminated would, mid-removal
        return empty(fd)

    monkeypatch.setattr(leftovers, "_empty_but_folders", stopped)
    with pytest.raises(KeyboardInterrupt):
        box.close()
    assert (box.folder / leftovers.MARKER).exists()
    monkeypatch.setattr(leftovers, "_empty_but_folders", empty)
    leftovers.remove_sandbox(box.folder)
    assert list((tmp_path / "sandboxes").iterdir()) == []


def test_write_file_and_copy_in_do_not_follow_a_link_planted_by_the_model(tmp_path):
    require_bwrap()
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    with Sandbox(make_repo(tmp_path / "repo"), SandboxLimits(), tmp_path / "sandboxes") as box:
        assert box.run(f"ln -s {host_dir} tests").exit_code == 0
        result = box.write_file("tests/test_hidden.py", b"def test_x():\n    pass\n")
        assert result.exit_code != 0  # the link points nowhere inside the sandbox
        assert list(host_dir.iterdir()) == []
        assert box.write_file("hidden/test_ok.py", b"ok\n").exit_code == 0
        assert box.read_file("hidden/test_ok.py").output == "ok\n"
        hidden = tmp_path / "hidden_tests"
        (hidden / "sub").mkdir(parents=True)
        (hidden / "test_a.py").write_text("A\n")
        (hidden / "sub" / "test_b.py").write_text("B\n")
        assert box.copy_in(hidden, "tests").exit_code != 0 and list(host_dir.iterdir()) == []
        assert box.copy_in(hidden, "r2e_tests").exit_code == 0
        assert box.copy_in(hidden / "test_a.py", "single").exit_code == 0
        listing = box.run("cat r2e_tests/test_a.py r2e_tests/sub/test_b.py single/test_a.py")
        assert listing.output == "A\nB\nA\n"


def test_close_from_another_thread_ends_a_running_command(tmp_path):
    require_bwrap()
    before = set(descendants(os.getpid()))
    box = Sandbox(make_repo(tmp_path / "repo"), SandboxLimits(), tmp_path / "sandboxes")
    results = []
    worker = threading.Thread(target=lambda: results.append(box.run("sleep 1000")))
    worker.start()
    time.sleep(0.5)
    start = time.monotonic()
    box.close()
    worker.join(10)
    assert not worker.is_alive() and time.monotonic() - start < 10
    assert results[0].exit_code is None and results[0].kill_reason == "closed"
    assert not box.folder.exists() and new_descendants(before) == []


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from mlperf_grpo.graceful_stop import GracefulStop
    from mlperf_grpo.sandbox import Sandbox, SandboxLimits
    repo, root, marker = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    with GracefulStop():
        with Sandbox(repo, SandboxLimits(), root) as box:
            print("ready", flush=True)
            box.run(f"sleep 1000; echo {marker}")
""")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_run_leaves_no_process_and_the_next_run_removes_its_folder(tmp_path, signum):
    require_bwrap()
    repo, root, marker = make_repo(tmp_path / "repo"), tmp_path / "sandboxes", f"stopped-run-{os.getpid()}-{signum}"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(repo), str(root), marker], stdout=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": SRC}, text=True)
    assert child.stdout.readline() == "ready\n"
    deadline = time.monotonic() + 10
    while len(processes_with(marker)) < 3 and time.monotonic() < deadline:  # bwrap, its init, bash
        time.sleep(0.05)
    assert len(processes_with(marker)) >= 3
    child.send_signal(signum)
    child.wait(10)
    child.stdout.close()
    deadline = time.monotonic() + 5
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker) == []
    left = list(root.iterdir())
    if signum == signal.SIGTERM:
        assert left == []  # the with-blocks closed it
    else:
        assert len(left) == 1 and cleanup_leftovers(root) == 1 and list(root.iterdir()) == []


def test_cleanup_leftovers_keeps_live_sandboxes(tmp_path):
    require_bwrap()
    with Sandbox(make_repo(tmp_path / "repo"), SandboxLimits(), tmp_path / "sandboxes") as box:
        assert cleanup_leftovers(tmp_path / "sandboxes") == 0 and box.folder.exists()
    assert cleanup_leftovers(tmp_path / "missing") == 0


def test_a_sandbox_root_other_users_can_write_or_own_is_refused_and_not_cleaned(tmp_path):
    """Whoever may rename entries in the root could swap a sandbox's folder for a link while
    it is made, bound into the sandbox or removed; another user's root is not writable."""
    require_bwrap()
    repo, shared = make_repo(tmp_path / "repo"), tmp_path / "shared"
    planted = shared / "sbx-1-planted"
    planted.mkdir(parents=True)
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match=r"cannot make sandboxes in .*shared: other users may write there \(mode 777"):
        Sandbox(repo, SandboxLimits(), shared)
    assert cleanup_leftovers(shared) == 0 and planted.is_dir()
    shared.chmod(0o1777)  # sticky, as /tmp: others cannot rename this user's entries
    with Sandbox(repo, SandboxLimits(), shared) as box:
        assert box.run("true").exit_code == 0
    if os.geteuid() == 0:
        shared.chmod(0o755)
        os.chown(shared, 65534, 65534)
        with pytest.raises(ConfigError, match="belongs to uid 65534, not to this user"):
            Sandbox(repo, SandboxLimits(), shared)


def test_a_sandbox_root_below_a_folder_other_users_can_write_or_own_is_refused_and_not_cleaned(tmp_path):
    """Whoever may rename entries of a folder above the root can swap the root itself (as
    OpenSSH's StrictModes); the default root's parents (/tmp: root's, sticky) pass."""
    require_bwrap()
    repo, shared = make_repo(tmp_path / "repo"), tmp_path / "shared"
    planted = shared / "deep" / "sandboxes" / "sbx-1-planted"
    planted.mkdir(parents=True)
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match=rf"cannot make sandboxes in .*sandboxes: other users may write the folder "
                                          rf"{shared} above it \(mode 777, not sticky\) and swap what is below it: "
                                          rf"chmod go-w {shared} \(or \+t\); give a folder of your own"):
        Sandbox(repo, SandboxLimits(), shared / "deep" / "sandboxes")
    assert cleanup_leftovers(shared / "deep" / "sandboxes") == 0 and planted.is_dir()
    shared.chmod(0o1777)
    with Sandbox(repo, SandboxLimits(), shared / "deep" / "sandboxes") as box:
        assert box.run("true").exit_code == 0
    if os.geteuid() == 0:
        shared.chmod(0o755)
        os.chown(shared, 65534, 65534)
        with pytest.raises(ConfigError, match=rf"the folder {shared} above it belongs to uid 65534, not to this user"):
            Sandbox(repo, SandboxLimits(), shared / "deep" / "sandboxes")
    assert root_problem(Path(tempfile.gettempdir())) == ""


def test_a_sandbox_root_that_is_a_file_is_a_one_line_error(tmp_path):
    """A file as the root (or above it) raised FileExistsError out of Sandbox()."""
    require_bwrap()
    repo, a_file = make_repo(tmp_path / "repo"), tmp_path / "a_file"
    a_file.write_text("x\n")
    for root, why in ((a_file, "File exists"), (a_file / "sandboxes", "Not a directory")):
        with pytest.raises(ConfigError, match=rf"cannot make sandboxes in .*{root.name}: it cannot be made a folder "
                                              rf"\({why}\); give a folder of your own"):
            Sandbox(repo, SandboxLimits(), root)
    assert a_file.read_text() == "x\n"


def test_bad_limits_and_a_missing_repository_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="must be positive: processes=0"):
        SandboxLimits(processes=0)
    with pytest.raises(ValueError, match="output_drain_bytes"):
        SandboxLimits(output_bytes=10, output_drain_bytes=5)
    require_bwrap()
    with pytest.raises(ConfigError, match="is not a folder"):
        Sandbox(tmp_path / "nope", SandboxLimits(), tmp_path / "sandboxes")
    assert list((tmp_path / "sandboxes").iterdir()) == []
    with pytest.raises(ConfigError, match="contains the sandbox root"):
        Sandbox(make_repo(tmp_path / "repo"), SandboxLimits(), tmp_path / "sandboxes", ro_paths=[tmp_path])


def test_the_sandbox_user_can_read_its_etc(tmp_path):
    """A root run's bwrap makes /etc 0700: its passwd, hosts and loader cache were unreadable
    to the sandbox's uid (``whoami`` failed, ``localhost`` did not resolve)."""
    require_bwrap()
    with Sandbox(make_repo(tmp_path / "repo"), SandboxLimits(), tmp_path / "sandboxes") as box:
        result = box.run("whoami && python3 -c \"import socket; print(socket.gethostbyname('localhost'))\"")
    assert result.exit_code == 0, result.output
    assert result.output.split() == ["sandbox", "127.0.0.1"]


def test_limits_are_set_inside_by_bash_and_cannot_be_raised(tmp_path):
    limits = SandboxLimits(memory_bytes=1 << 30, processes=99, cpu_s=7, file_bytes=1 << 20)
    argv = [*limited_shell(limits), "ulimit -v; ulimit -u; ulimit -t; ulimit -f; ulimit -u 1000"]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert result.stdout.split() == [str((1 << 30) // 1024), "99", "7", "1024"]
    assert result.returncode != 0 and "ulimit" in result.stderr  # the hard limit holds


def test_container_command_lines(tmp_path):
    limits = SandboxLimits(command_timeout_s=60, processes=128, memory_bytes=1 << 30, tmp_bytes=1 << 20)
    assert containers.is_sif("/images/r2e.sif") and not containers.is_sif("docker.io/org/r2e:tag")
    argv = containers.apptainer_argv("apptainer", "/i/x.sif", tmp_path, "/testbed", limits, "ls")
    joined = " ".join(argv)
    for flag in ("exec --writable-tmpfs --cleanenv --containall --pid", "--net --network none",
                 f"--bind {tmp_path}:/testbed", "--pwd /testbed /i/x.sif bash -c"):
        assert flag in joined
    assert argv[-1] == "ls"
    start = " ".join(containers.oci_start_argv("podman", "img", "c1", tmp_path, "/testbed", limits))
    for flag in ("run -d --rm --name c1 --network none --cap-drop ALL", "--pids-limit 128",
                 f"--memory {1 << 30}", f"-v {tmp_path}:/testbed", "--entrypoint sleep img infinity"):
        assert flag in start
    exec_argv = containers.oci_exec_argv("podman", "c1", "/testbed", limits, "ls", 60)
    assert exec_argv[:9] == ["podman", "exec", "-i", "-w", "/testbed", "c1", "timeout", "-s", "KILL"]
    assert containers.oci_remove_argv("docker", "c1") == ["docker", "rm", "-f", "c1"]


def test_the_seccomp_program_is_well_formed():
    program = seccomp.filter_program()
    if program is None:
        pytest.skip("not an x86-64 host: no filter")
    records = [program[i:i + 8] for i in range(0, len(program), 8)]
    assert len(program) % 8 == 0 and records[-1][:2] == b"\x06\x00"  # ends with a return
    for index, record in enumerate(records):
        code, jt, jf = record[0] | record[1] << 8, record[2], record[3]
        if code & 0x07 == 0x05:  # a jump: both targets inside the program
            assert index + 1 + max(jt, jf) < len(records), index


def test_the_refused_system_call_numbers_are_the_kernel_s():
    header = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
    if seccomp.filter_program() is None or not header.exists():
        pytest.skip("no x86-64 kernel header to check the numbers against")
    table = dict(re.findall(r"#define __NR_(\w+) (\d+)", header.read_text()))
    assert {name: str(number) for name, number in seccomp.DENIED.items()} == {name: table[name] for name in seccomp.DENIED}
    assert [table[name] for name in ("socket", "clone", "unshare", "clone3")] == [
        str(seccomp.NR_SOCKET), str(seccomp.NR_CLONE), str(seccomp.NR_UNSHARE), str(seccomp.NR_CLONE3)]


def test_sandboxes_run_commands_from_many_threads_at_once(tmp_path):
    require_bwrap()
    before = set(descendants(os.getpid()))
    repo, root = make_repo(tmp_path / "repo"), tmp_path / "sandboxes"
    boxes = [Sandbox(repo, SandboxLimits(), root) for _ in range(6)]
    outputs: dict[int, list[str]] = {index: [] for index in range(len(boxes))}

    def work(index: int) -> None:
        for step in range(4):
            outputs[index].append(boxes[index].run(f"echo {index}-{step} >> log; cat log | wc -l").output)

    threads = [threading.Thread(target=work, args=(index,)) for index in range(len(boxes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for box in boxes:
        box.close()
    assert all(outputs[index] == ["1\n", "2\n", "3\n", "4\n"] for index in outputs), outputs
    assert list(root.iterdir()) == [] and new_descendants(before) == []


def test_a_sandbox_dropped_without_close_is_removed_at_exit(tmp_path):
    require_bwrap()
    repo, root = make_repo(tmp_path / "repo"), tmp_path / "sandboxes"
    code = ("import sys; from pathlib import Path\n"
            "from mlperf_grpo.sandbox import Sandbox, SandboxLimits\n"
            "Sandbox(Path(sys.argv[1]), SandboxLimits(), Path(sys.argv[2])).run('echo x > y')\n"
            "print(len(list(Path(sys.argv[2]).iterdir())))\n")
    result = subprocess.run([sys.executable, "-c", code, str(repo), str(root)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": SRC}, timeout=60, check=True)
    assert result.stdout == "1\n" and list(root.iterdir()) == []


def test_a_forked_child_exiting_leaves_its_parent_s_sandbox_alone(tmp_path):
    require_bwrap()
    with Sandbox(make_repo(tmp_path / "repo"), SandboxLimits(), tmp_path / "sandboxes") as box:
        code = ("import os, sys\n"
                "from pathlib import Path\n"
                "from mlperf_grpo.sandbox import Sandbox, SandboxLimits\n"
                "box = Sandbox(Path(sys.argv[1]), SandboxLimits(), Path(sys.argv[2]))\n"
                "pid = os.fork()\n"
                "if pid == 0:\n"
                "    sys.exit(0)  # runs atexit in the child\n"
                "os.waitpid(pid, 0)\n"
                "print(box.run('cat calc.py').exit_code)\n")
        result = subprocess.run([sys.executable, "-c", code, str(box.workdir), str(tmp_path / "other")],
                                capture_output=True, text=True, env={**os.environ, "PYTHONPATH": SRC}, timeout=60)
        assert result.stdout == "0\n", result.stderr
        assert list((tmp_path / "other").iterdir()) == []


NON_ROOT_CHILD = textwrap.dedent("""
    import os, sys, tempfile
    from pathlib import Path
    from mlperf_grpo.sandbox import Sandbox, SandboxLimits
    root = Path(sys.argv[1])
    repo = root / "repo"
    repo.mkdir()
    (repo / "a.py").write_text("print('a')\\n")
    (repo / "spawn.py").write_text(
        "import subprocess\\nchildren = []\\ntry:\\n    for _ in range(60):\\n"
        "        children.append(subprocess.Popen(['sleep', '2']))\\nexcept OSError:\\n    pass\\n"
        "print(len(children))\\n")
    with Sandbox(repo, SandboxLimits(processes=32, command_timeout_s=20), root / "sandboxes") as box:
        print(box.run("id -u").output.strip())
        print(box.run("python3 a.py && echo x > b && cat b").output.split())
        print(box.run("python3 spawn.py").output.strip())  # children started before fork failed
        print(box.run("unshare -U true").exit_code != 0, box.run(f"echo x > {root}/pwned").exit_code != 0)
        box.run("mkdir -p locked/in && echo x > locked/in/f && chmod 500 locked/in && chmod 000 locked")  # close() opens them up
    print(sorted(p.name for p in (root / "sandboxes").iterdir()))
""")


def test_a_non_root_run_gets_the_same_bounds_through_a_user_namespace(tmp_path):
    """Run as root here, so a child drops to uid 65534 with the system Python: the path a
    laptop user takes (bwrap makes a user namespace; the process limit counts per sandbox)."""
    require_bwrap()
    system_python = Path("/usr/bin/python3")
    if os.geteuid() != 0 or not system_python.exists() or not shutil.which("setpriv"):
        pytest.skip("needs root, /usr/bin/python3 and setpriv to run a child as an unprivileged user")
    if any(not os.stat(p).st_mode & 0o005 for p in [Path(SRC), *Path(SRC).parents] if p != Path("/")):
        pytest.skip(f"{SRC} is not readable by other users")
    shared = Path(tempfile.mkdtemp(prefix="sandbox-nonroot-"))
    try:
        os.chown(shared, 65534, 65534)  # the child's own folder: one others may write is refused
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(system_python), "-c",
                NON_ROOT_CHILD, str(shared)]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                                env={"PATH": os.environ["PATH"], "PYTHONPATH": SRC})
        lines = result.stdout.splitlines()
        assert result.returncode == 0 and len(lines) == 5, (result.stdout, result.stderr)
        assert lines[0] == "1000" and lines[1] == "['a', 'x']"
        assert int(lines[2]) < 32 and lines[3] == "True True" and lines[4] == "[]"
        assert not (shared / "pwned").exists()
    finally:
        shutil.rmtree(shared)


BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "sandbox.py"


def test_the_benchmark_prints_one_json_line_and_refuses_bad_arguments(tmp_path):
    require_bwrap()
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run([sys.executable, str(BENCHMARK), "--sandboxes", "2", "--commands", "2", "--files", "3",
                           "--dir", str(tmp_path)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout)
    assert line["backend"] == "bwrap" and line["startup_s"] > 0 and line["command_over_plain"] > 0
    assert list(tmp_path.iterdir()) == []
    bad = subprocess.run([sys.executable, str(BENCHMARK), "--sandboxes", "0", "--files", "-1"], capture_output=True,
                         text=True, timeout=60, env=env)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "benchmarks/sandbox.py: --sandboxes 0, --files -1: must be at least 1"]
