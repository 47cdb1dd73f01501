"""Grading starts from a quiet sandbox: what an agent's command leaves running in the
background (setsid, nohup, a double fork) cannot rewrite the hidden tests once they are
written. podman/docker through a fake runtime on PATH (neither is installed here): the
kill runs after the agent's last command and before the hidden files are written, and a
container that cannot be made quiet is graded 0. bubblewrap end to end: nothing survives."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sandbox_helpers import make_repo, require_bwrap

from mlperf_grpo.sandbox import Sandbox, SandboxLimits, containers
from mlperf_grpo.tasks.swe import Grading, SweTask, grade, known_fix, tiny_suite

TIMEOUT_S = 60.0
FAKE_RUNTIME = f"""#!{sys.executable}
import json, os, subprocess, sys
state = os.environ["FAKE_RUNTIME_STATE"]
with open(os.path.join(state, "argv.jsonl"), "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
args = sys.argv[1:]
if args[0] == "run":  # run -d ... --name NAME ... -v HOST:INSIDE ...
    name, volume = args[args.index("--name") + 1], args[args.index("-v") + 1]
    with open(os.path.join(state, name), "w") as mapping:
        mapping.write(volume.split(":")[0])
    print("0123456789ab")
elif args[0] == "exec":  # exec [-i] [-w DIR] NAME ARGV...: ARGV runs on the host in the bound folder
    rest = args[1:]
    while rest[0].startswith("-"):
        rest = rest[2:] if rest[0] == "-w" else rest[1:]
    name, command = rest[0], rest[1:]
    if any("kill -KILL -1" in part for part in command):  # never on the host
        print(os.environ.get("FAKE_QUIESCE_SAYS", "quiet"))
        sys.exit(int(os.environ.get("FAKE_QUIESCE_EXIT", "0")))
    with open(os.path.join(state, name)) as mapping:
        sys.exit(subprocess.run(command, cwd=mapping.read()).returncode)
sys.exit(0)  # info, rm -f
"""


@pytest.fixture
def fake_runtime(tmp_path, monkeypatch, request):
    """A fake ``podman`` or ``docker`` first on PATH; returns the file its argv lines go to."""
    name = request.param
    if name == "docker" and shutil.which("podman"):
        pytest.skip("a real podman on PATH would be picked before a fake docker")
    folder, state = tmp_path / "bin", tmp_path / "state"
    folder.mkdir()
    state.mkdir()
    binary = folder / name
    binary.write_text(FAKE_RUNTIME)
    binary.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_RUNTIME_STATE", str(state))
    return state / "argv.jsonl"


def _fixed_tiny_task(tmp_path: Path) -> tuple[SweTask, dict[str, str]]:
    task = tiny_suite("train", tmp_path / "tiny")[0]
    texts = {}
    for edit in known_fix(task.task_id):
        text = texts.get(edit.path) or (task.repo_dir / edit.path).read_text()
        texts[edit.path] = text.replace(edit.old, edit.new)
    return task, texts


def _grade_in_container(tmp_path: Path):
    task, texts = _fixed_tiny_task(tmp_path)
    with Sandbox(task.repo_dir, SandboxLimits(), tmp_path / "s", image="example.org/r2e:1") as sandbox:
        assert sandbox.backend in ("podman", "docker")
        for path, text in texts.items():
            assert sandbox.write_file(path, text.encode()).exit_code == 0
        return grade(task, sandbox, TIMEOUT_S)


def _calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _is_quiesce(argv: list[str]) -> bool:
    return argv[0] == "exec" and any("kill -KILL -1" in part for part in argv)


@pytest.mark.parametrize("fake_runtime", ["podman", "docker"], indirect=True)
def test_the_container_is_made_quiet_after_the_agent_s_last_command_and_before_the_hidden_files(tmp_path, fake_runtime):
    result = _grade_in_container(tmp_path)
    assert (result.reward, result.reason) == (1.0, "passed"), result.log_tail
    calls = _calls(fake_runtime)
    execs = [index for index, argv in enumerate(calls) if argv[0] == "exec"]
    quiesce = [index for index in execs if _is_quiesce(calls[index])]
    assert len(quiesce) == 1
    before, after = [i for i in execs if i < quiesce[0]], [i for i in execs if i > quiesce[0]]
    assert before and any("cat >" in part for part in calls[before[-1]])  # the agent's write_file
    assert any("tar --no-same-owner -xf -" in part for part in calls[after[0]])  # the hidden files come next
    assert "-u" not in calls[quiesce[0]] and "--user" not in calls[quiesce[0]]  # the agent's user, as its commands
    assert calls[-1][:2] == ["rm", "-f"]


@pytest.mark.parametrize("fake_runtime", ["podman"], indirect=True)
def test_a_container_that_cannot_be_made_quiet_is_graded_0_and_gets_no_hidden_files(tmp_path, fake_runtime,
                                                                                   monkeypatch):
    monkeypatch.setenv("FAKE_QUIESCE_EXIT", "1")
    monkeypatch.setenv("FAKE_QUIESCE_SAYS", "processes still running: 57")
    result = _grade_in_container(tmp_path)
    assert (result.reward, result.invalid) == (0.0, False)
    assert result.reason.startswith("the sandbox is not quiet before grading: podman exec could not kill")
    assert "processes still running: 57" in result.reason
    calls = _calls(fake_runtime)
    first = next(index for index, argv in enumerate(calls) if _is_quiesce(argv))
    assert [argv[:2] for argv in calls[first + 1:]] == [["rm", "-f"]]  # nothing written, nothing run


WATCHER = ("for i in $(seq 3000); do [ -f r2e_tests/test_1.py ] && break; sleep 0.01; done; end=$((SECONDS + 5)); "
           "while [ $SECONDS -lt $end ]; do printf 'def test_add():\\n    pass\\n' > r2e_tests/test_1.py; "
           "sleep 0.002; done")
"""Waits for the hidden test file, then keeps overwriting it with one that passes for 5 s."""
LAUNCHERS = {
    "setsid": f"setsid bash -c {shlex.quote(WATCHER)} </dev/null >/dev/null 2>&1 &",
    "nohup": f"nohup bash -c {shlex.quote(WATCHER)} </dev/null >/dev/null 2>&1 &",
    "double fork": f"( bash -c {shlex.quote(WATCHER)} </dev/null >/dev/null 2>&1 & )",
}


def _calc_task(tmp_path: Path) -> SweTask:
    """``add`` subtracts; the hidden pytest test ``test_add`` fails until it is fixed."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    test = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    grading = Grading((("r2e_tests/test_1.py", test),), f"{sys.executable} -m pytest -rA -p no:cacheprovider r2e_tests",
                      "pytest-r2e", expected=(("test_add", "PASSED"),))
    return SweTask("calc__9", "add subtracts", repo, None, grading)


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_a_background_process_of_the_agent_does_not_survive_into_bwrap_grading(tmp_path, launcher):
    require_bwrap()
    task = _calc_task(tmp_path)
    with Sandbox(task.repo_dir, SandboxLimits(), tmp_path / "s") as sandbox:
        works = sandbox.run(f"{LAUNCHERS[launcher]}\nmkdir -p r2e_tests && : > r2e_tests/test_1.py && for i in "
                            "$(seq 500); do grep -q pass r2e_tests/test_1.py && echo overwritten && break; sleep 0.01; done")
        assert (works.exit_code, works.output) == (0, "overwritten\n")  # it overwrites while its command runs
        assert sandbox.run(f"rm -rf r2e_tests\n{LAUNCHERS[launcher]}").exit_code == 0
        result = grade(task, sandbox, TIMEOUT_S)
        test_file = (sandbox.workdir / "r2e_tests" / "test_1.py").read_text()
    assert (result.reward, result.reason) == (0.0, "test_add: FAILED, expected PASSED"), result.log_tail
    assert "assert add(2, 3) == 5" in test_file


def test_the_watcher_turns_the_grade_to_1_where_it_survives(tmp_path):
    """The control: the same watcher run where grading cannot kill it (a host process in
    the sandbox's folder, as one left in a container would be) makes the unfixed code pass."""
    require_bwrap()
    task = _calc_task(tmp_path)
    with Sandbox(task.repo_dir, SandboxLimits(), tmp_path / "s") as sandbox:
        watcher = subprocess.Popen(["bash", "-c", WATCHER], cwd=sandbox.workdir)
        try:
            result = grade(task, sandbox, TIMEOUT_S)
        finally:
            watcher.kill()
            watcher.wait()
    assert (result.reward, result.reason) == (1.0, "passed"), result.log_tail


def test_the_quiesce_script_kills_every_process_but_pid_1_and_itself_in_a_real_pid_namespace(tmp_path):
    """The script podman/docker run, run where it can do no harm: a bwrap command's pid
    namespace (its PID 1 is bwrap's init, as a container's is ``sleep infinity``)."""
    require_bwrap()
    with Sandbox(make_repo(tmp_path / "repo"), SandboxLimits(), tmp_path / "s") as sandbox:
        left = ("setsid sleep 100 </dev/null >/dev/null 2>&1 & nohup sleep 101 >/dev/null 2>&1 & "
                "( sleep 102 </dev/null >/dev/null 2>&1 & ); sleep 0.2; ")
        result = sandbox.run(f"{left}exec sh -c {shlex.quote(containers.QUIESCE_SCRIPT)}")
        assert (result.exit_code, result.output) == (0, "quiet\n")
        idle = containers.QUIESCE_SCRIPT.replace("kill -KILL -1", ":").replace(f"-ge {containers.QUIESCE_ROUNDS}", "-ge 3")
        listed = sandbox.run(f"{left}sh -c {shlex.quote(idle)}")  # kills nothing: names what is left
        disguised = sandbox.run(  # a live process named to end stat's first line in a zombie's state
            f"{sys.executable} -c \"import ctypes, time; ctypes.CDLL(None).prctl(15, b'a) Z\\nx'); time.sleep(100)\" "
            f"</dev/null >/dev/null 2>&1 & sleep 0.5; sh -c {shlex.quote(idle)}")
        headless = sandbox.run(  # the group's first thread exits (a zombie in /proc/PID/status); another runs on
            f"{sys.executable} -c \"import ctypes, threading, time; threading.Thread(target=time.sleep, args=(100,)).start(); "
            f"ctypes.CDLL(None).pthread_exit(None)\" </dev/null >/dev/null 2>&1 & sleep 0.5; sh -c {shlex.quote(idle)}")
    assert listed.exit_code == 1 and listed.output.startswith("processes still running: "), listed.output
    assert len(listed.output.split(":")[1].split()) == 3  # the three sleeps (sh is the command's bash, exec'd)
    assert disguised.exit_code == 1 and len(disguised.output.split(":")[1].split()) == 1, disguised.output
    assert headless.exit_code == 1 and len(headless.output.split(":")[1].split()) == 1, headless.output
