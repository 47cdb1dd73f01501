"""tasks/swe/grade.py in real bubblewrap sandboxes: the known fix of every tiny task gets
reward 1, no change gets 0, a hanging test run is an invalid sample, and what the agent
leaves where the hidden tests go does not count, nor its edits of the files a test
patch touches (reset from the pristine repository, whatever it did to its `.git`)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
from sandbox_helpers import require_bwrap

from mlperf_grpo.agent.swe_session import SweSession, SweSessionSettings
from mlperf_grpo.sandbox import Sandbox, SandboxLimits
from mlperf_grpo.tasks.swe import Edit, Grading, SweTask, grade, known_fix, tiny_suite

TIMEOUT_S = 60.0  # the benchmark's test timeout; a passing tiny run takes well under a second
WORKERS = 4


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> list[SweTask]:
    require_bwrap()
    root = tmp_path_factory.mktemp("swe-tiny")
    return tiny_suite("train", root) + tiny_suite("validation", root)


def _fixed_files(task: SweTask, edits: tuple[Edit, ...]) -> dict[str, str]:
    """The edited files' text, computed from the pristine repository (never from a sandbox)."""
    texts: dict[str, str] = {}
    for edit in edits:
        text = texts.get(edit.path) or (task.repo_dir / edit.path).read_text(encoding="utf-8")
        assert text.count(edit.old) == 1, (task.task_id, edit.path)
        texts[edit.path] = text.replace(edit.old, edit.new)
    return texts


def _grade(task: SweTask, root: Path, edits: tuple[Edit, ...] = (), timeout_s: float = TIMEOUT_S, setup: str = "",
           limits: SandboxLimits = SandboxLimits()):
    with Sandbox(task.repo_dir, limits, root) as sandbox:
        for path, text in _fixed_files(task, edits).items():
            assert sandbox.write_file(path, text.encode()).exit_code == 0
        if setup:
            assert sandbox.run(setup).exit_code == 0
        return grade(task, sandbox, timeout_s)


def test_known_fix_gets_1_and_no_change_gets_0_on_every_tiny_task(suite, tmp_path):
    jobs = [(task, fix) for task in suite for fix in (False, True)]
    started = time.monotonic()
    with ThreadPoolExecutor(WORKERS) as pool:
        grades = list(pool.map(lambda job: _grade(job[0], tmp_path, known_fix(job[0].task_id) if job[1] else ()), jobs))
    seconds = time.monotonic() - started
    for (task, fix), result in zip(jobs, grades):
        assert not result.invalid, (task.task_id, result.reason, result.log_tail)
        assert result.reward == (1.0 if fix else 0.0), (task.task_id, fix, result.reason, result.log_tail)
        assert (result.reason == "passed") == fix
    assert seconds < 120, f"grading {len(jobs)} tiny trajectories took {seconds:.1f} s"
    assert list(tmp_path.iterdir()) == []  # every sandbox removed


def test_a_test_run_that_hangs_is_an_invalid_sample(suite, tmp_path):
    task = suite[0]
    sleeping = "import time\nimport unittest\n\n\nclass Slow(unittest.TestCase):\n    def test_sleeps(self):\n" \
               "        time.sleep(600)\n"
    hanging = replace(task, grading=replace(task.grading, test_files=(("r2e_tests/test_slow.py", sleeping),
                                                                      ("r2e_tests/__init__.py", "")),
                                            expected=(("r2e_tests.test_slow.Slow.test_sleeps", "PASSED"),)))
    started = time.monotonic()
    result = _grade(hanging, tmp_path, timeout_s=1.5)
    assert time.monotonic() - started < 30
    assert result.invalid and result.reward == 0.0
    assert result.reason == "the test run timed out after 1.5 s"


def test_a_fix_that_loops_forever_is_an_invalid_sample(suite, tmp_path):
    task = next(t for t in suite if t.task_id == "swe-tiny__01_clamp")
    looping = Edit("numtools/bounds.py", "    return max(high, min(low, value))\n", "    while True:\n        pass\n")
    result = _grade(task, tmp_path, (looping,), timeout_s=1.5)
    assert result.invalid and "timed out" in result.reason


def test_what_the_agent_leaves_in_r2e_tests_does_not_count(suite, tmp_path):
    task = next(t for t in suite if t.task_id == "swe-tiny__05_fizzbuzz")
    fake = ("import unittest\n\n\nclass FizzBuzzTest(unittest.TestCase):\n    def test_fifteen(self):\n        pass\n\n"
            "    def test_three_and_five(self):\n        pass\n\n    def test_number(self):\n        pass\n")
    planted = ("mkdir -p r2e_tests && printf '' > r2e_tests/__init__.py && "
               f"cat > r2e_tests/test_fizz.py <<'EOF'\n{fake}EOF")
    assert _grade(task, tmp_path, setup=planted).reward == 0.0  # the planted tests are replaced by the hidden ones
    extra = ("mkdir -p r2e_tests && printf 'import unittest\\nclass X(unittest.TestCase):\\n"
             "    def test_x(self): pass\\n' > r2e_tests/test_x.py")
    assert _grade(task, tmp_path, known_fix(task.task_id), setup=extra).reward == 1.0  # stale files are removed


FAKE_PASS = """import os, re, sys
for name in sorted(os.listdir("r2e_tests")):
    if name.startswith("test_"):
        cls = None
        for line in open(os.path.join("r2e_tests", name)):
            cls = (re.match(r"class (\\w+)", line) or [0, cls])[1]
            test = re.match(r"    def (test\\w*)", line)
            if test:
                sys.stderr.write(f"{test[1]} (r2e_tests.{name[:-3]}.{cls}.{test[1]}) ... ok\\n")
os._exit(0)
"""
"""Prints a passing unittest line for every hidden test and exits 0, wherever it runs."""
RUNNER_SHADOWS = ("sitecustomize.py", "usercustomize.py", "unittest.py", "unittest/__init__.py",
                  "unittest/__main__.py", "conftest.py")


def test_files_planted_to_shadow_the_test_runner_do_not_earn_a_reward(suite, tmp_path):
    """Reward hacking through the repository's root: ``-I`` keeps it off ``sys.path`` until
    discovery starts, so no planted ``unittest`` or site hook runs (code the tests import
    still runs in their process: docs/agentic.md, "What grading cannot rule out")."""
    task = next(t for t in suite if t.task_id == "swe-tiny__05_fizzbuzz")
    planted = " && ".join(f"mkdir -p \"$(dirname {path})\" && printf %s {shlex.quote(FAKE_PASS)} > {path}"
                          for path in RUNNER_SHADOWS)
    result = _grade(task, tmp_path, setup=planted)
    assert (result.reward, result.invalid) == (0.0, False), result.reason
    assert "FAILED" in result.reason or "ERROR" in result.reason, result.reason
    assert _grade(task, tmp_path, known_fix(task.task_id), setup=planted).reward == 1.0  # a fix still counts
    in_the_code = f"printf %s {shlex.quote(FAKE_PASS)} > games/__init__.py"  # the same script, imported by the tests
    assert _grade(task, tmp_path, setup=in_the_code).reward == 1.0  # the documented opening (and the script works)


def test_a_planted_link_where_the_hidden_tests_go_changes_nothing_outside(suite, tmp_path):
    task = next(t for t in suite if t.task_id == "swe-tiny__08_fahrenheit")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine\n")
    result = _grade(task, tmp_path / "sandboxes", known_fix(task.task_id), setup=f"ln -s {outside} r2e_tests")
    assert result.reward == 1.0
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]
    assert (outside / "keep.txt").read_text() == "mine\n"


def _committed_calc_repo(tmp_path: Path, files: dict[str, str]) -> Path:
    """A git repository of one commit: ``calc.py`` (whose ``add`` subtracts) and ``files``."""
    repo = tmp_path / "repo"
    for relative, text in {"calc.py": "def add(a, b):\n    return a - b\n", **files}.items():
        (repo / relative).parent.mkdir(parents=True, exist_ok=True)
        (repo / relative).write_text(text)
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "base"]):
        subprocess.run(["git", *args], cwd=repo, env=env, check=True)
    return repo


def _swe_bench_grading(patch: str) -> Grading:
    """SWE-bench's rule: ``patch`` adds ``test_add`` (fail to pass) beside ``test_zero`` (pass to pass)."""
    return Grading((), f"{sys.executable} -m pytest -rA -p no:cacheprovider tests/test_calc.py", "pytest-swebench",
                   fail_to_pass=("tests/test_calc.py::test_add",), pass_to_pass=("tests/test_calc.py::test_zero",),
                   test_patch=patch)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_swe_bench_rule_applies_the_test_patch_and_needs_every_named_test(tmp_path):
    require_bwrap()
    repo = _committed_calc_repo(tmp_path, {"tests/__init__.py": ""})
    patch = ("diff --git a/tests/test_calc.py b/tests/test_calc.py\nnew file mode 100644\n--- /dev/null\n"
             "+++ b/tests/test_calc.py\n@@ -0,0 +1,7 @@\n+from calc import add\n+\n+\n+def test_add():\n"
             "+    assert add(2, 3) == 5\n+\n+def test_zero(): assert add(0, 0) == 0\n")
    grading = _swe_bench_grading(patch)
    task = SweTask("calc__1", "add subtracts", repo, None, grading)
    fix = Edit("calc.py", "a - b", "a + b")
    broken, fixed = _grade(task, tmp_path / "s"), _grade(task, tmp_path / "s", (fix,))
    assert (broken.reward, broken.invalid) == (0.0, False)
    assert broken.reason == "FAIL_TO_PASS tests/test_calc.py::test_add: FAILED"
    assert (fixed.reward, fixed.reason) == (1.0, "passed"), fixed.log_tail
    garbled = replace(task, grading=replace(grading, test_patch=patch.replace("@@ -0,0 +1,7 @@", "@@ -0,0 +1,9 @@")))
    assert _grade(garbled, tmp_path / "s", (fix,)).reason.startswith("the hidden test patch does not apply")


HOSTILE_GIT = """
printf '#!/bin/sh\\ntouch "$PWD/.git/ran-${0##*/}"; sed -i "s/== 5/== -1/" .hidden_test_patch.diff\\nexit 0\\n' > .git/hack
chmod +x .git/hack && ln -s hack .git/smudge && mkdir .git/hooks-x
for hook in post-checkout post-index-change reference-transaction pre-applypatch; do ln -s ../hack .git/hooks-x/$hook; done
git config core.fsmonitor "$PWD/.git/hack" && git config core.hooksPath "$PWD/.git/hooks-x"
git config filter.x.smudge "$PWD/.git/smudge; cat" && git config filter.x.clean cat && echo '*.py filter=x' > .gitattributes
"""


def _calc_task(tmp_path: Path) -> SweTask:
    """A git repository whose ``add`` subtracts, graded by a SWE-bench test patch adding ``test_add``."""
    repo = _committed_calc_repo(tmp_path, {
        "tests/test_calc.py": "from calc import add\n\n\ndef test_zero():\n    assert add(0, 0) == 0\n"})
    patch = ("diff --git a/tests/test_calc.py b/tests/test_calc.py\n--- a/tests/test_calc.py\n+++ b/tests/test_calc.py\n"
             "@@ -3,3 +3,7 @@ from calc import add\n \n def test_zero():\n     assert add(0, 0) == 0\n+\n+\n"
             "+def test_add():\n+    assert add(2, 3) == 5\n")
    return SweTask("calc__3", "add subtracts", repo, None, _swe_bench_grading(patch))


EDITED = "from calc import add\n\n\ndef test_zero():\n    assert add(0, 0) == 0  # edited\n"


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_the_repository_s_git_config_runs_nothing_and_changes_nothing_in_grading(tmp_path):
    """The agent owns .git: an fsmonitor, hooks and a smudge filter that rewrite the hidden
    test patch before it applies would grade the unfixed code 1 if grading's git read them."""
    require_bwrap()
    task = _calc_task(tmp_path)
    with Sandbox(task.repo_dir, SandboxLimits(), tmp_path / "s") as sandbox:
        assert sandbox.run(HOSTILE_GIT + f"printf %s {shlex.quote(EDITED)} > tests/test_calc.py").exit_code == 0
        result = grade(task, sandbox, TIMEOUT_S)
        ran = sorted(path.name for path in (sandbox.workdir / ".git").glob("ran-*"))
        test_file = (sandbox.workdir / "tests" / "test_calc.py").read_text()
    assert ran == [], ran
    assert (result.reward, result.reason) == (0.0, "FAIL_TO_PASS tests/test_calc.py::test_add: FAILED"), result.log_tail
    assert "# edited" not in test_file and "assert add(2, 3) == 5" in test_file


class _TmpKept:
    """The real sandbox, as the docker/podman backend runs it: one container's ``/tmp`` lives
    across all its commands, so what an agent's command left there is still there at grading
    (here: every command runs after ``planted``, which the agent's earlier command would have left)."""

    def __init__(self, sandbox: Sandbox, planted: str):
        self.sandbox, self.planted, self.limits = sandbox, planted, sandbox.limits

    def quiesce(self) -> str:
        return self.sandbox.quiesce()

    def run(self, command: str, **kwargs):
        return self.sandbox.run(f"{{ {self.planted}\n}} >/dev/null 2>&1; {command}", **kwargs)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_a_grading_git_directory_left_in_a_kept_tmp_is_not_used(tmp_path):
    """A container's /tmp outlives a command: a /tmp/grading.git the agent made beforehand,
    with its fsmonitor, hooks and smudge filter, is not the git directory grading uses."""
    require_bwrap()
    task = _calc_task(tmp_path)
    planted = (HOSTILE_GIT.replace("git config ", "git --git-dir=/tmp/grading.git config ")
               .replace("\nchmod", "\ngit init -q --bare /tmp/grading.git\nchmod"))
    with Sandbox(task.repo_dir, SandboxLimits(), tmp_path / "s") as sandbox:
        assert sandbox.run(f"printf %s {shlex.quote(EDITED)} > tests/test_calc.py").exit_code == 0
        result = grade(task, _TmpKept(sandbox, planted), TIMEOUT_S)
        ran = sorted(path.name for path in (sandbox.workdir / ".git").glob("ran-*"))
        test_file = (sandbox.workdir / "tests" / "test_calc.py").read_text()
    assert ran == [], ran
    assert (result.reward, result.reason) == (0.0, "FAIL_TO_PASS tests/test_calc.py::test_add: FAILED"), result.log_tail
    assert "# edited" not in test_file and "assert add(2, 3) == 5" in test_file


def test_a_long_pytest_log_is_read_from_its_summary_at_the_end(tmp_path):
    require_bwrap()
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    noisy = "from calc import add\n\n\ndef test_add():\n    print('x' * 20000)\n    assert add(2, 3) == 5\n"
    grading = Grading((("r2e_tests/test_1.py", noisy),), f"{sys.executable} -m pytest -rA -p no:cacheprovider r2e_tests",
                      "pytest-r2e", expected=(("test_add", "PASSED"),))
    task = SweTask("calc__2", "add", repo, None, grading)
    result = _grade(task, tmp_path / "s", limits=SandboxLimits(output_bytes=4096))  # the -rA output is ~20 kB
    assert (result.reward, result.reason) == (1.0, "passed"), result.log_tail


SHADOWED = "import calc\ncalc.add = lambda a, b: a + b\n"
"""Lines an agent puts above the hidden patch's hunk: ``test_add`` passes with unfixed code."""
DESTROY_BASE = {
    "deleted": "rm -rf .git/objects/*",
    "replaced": (  # the base blob's loose object rewritten to hold the agent's text (git does not check its hash)
        "blob=$(git rev-parse HEAD~1:tests/test_calc.py) && chmod -R u+w .git/objects && python3 -c '"
        "import sys, zlib; data = open(\"tests/test_calc.py\", \"rb\").read(); "
        "open(sys.argv[1], \"wb\").write(zlib.compress(b\"blob %d\\0\" % len(data) + data))' "
        ".git/objects/${blob:0:2}/${blob:2}"),
}


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
@pytest.mark.parametrize("how", sorted(DESTROY_BASE))
def test_an_edited_test_file_is_reset_although_the_agent_destroyed_the_base_objects(tmp_path, how):
    """The reset reads the base files from the task's pristine repository: an agent that
    commits its edit to a touched test file and deletes or replaces the base commit's
    objects keeps nothing of it (a checkout from the agent's objects would fail silently
    or write the agent's text, and the patch would apply around the edit)."""
    require_bwrap()
    task = _calc_task(tmp_path)
    commit = "git -c user.name=a -c user.email=a@a commit -qam mine"
    setup = f"printf %s {shlex.quote(SHADOWED)} | cat - tests/test_calc.py > t && mv t tests/test_calc.py && {commit}"
    session = SweSession(task, SweSessionSettings(SandboxLimits(), TIMEOUT_S, tmp_path / "s"), lambda _: [])
    try:  # as the agent loop runs a trajectory: the base files are read when the session opens
        sandbox = session.sandbox
        assert sandbox.run(f"{setup} && {DESTROY_BASE[how]}").exit_code == 0
        if how == "replaced":  # the agent's own git now reads its text as the base version
            assert sandbox.run("git show HEAD~1:tests/test_calc.py").output.startswith("import calc")
        result = session.grade()
        test_file = (sandbox.workdir / "tests" / "test_calc.py").read_text()
    finally:
        session.close()
    assert (result.reward, result.reason) == (0.0, "FAIL_TO_PASS tests/test_calc.py::test_add: FAILED"), result.log_tail
    assert not test_file.startswith("import calc") and "assert add(2, 3) == 5" in test_file


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_honest_trajectories_keep_their_reward_when_the_touched_test_file_is_reset(tmp_path):
    """Fixed code gets 1 and unfixed code 0, with or without an edit of the touched test
    file (SWE-bench resets it: the agent's own test there does not count), also when the
    agent commits it and packs its objects (the base, ``HEAD`` of a row without
    ``base_commit``, is the pristine repository's, not the agent's moved ``HEAD``)."""
    require_bwrap()
    task = _calc_task(tmp_path)
    fix = (Edit("calc.py", "a - b", "a + b"),)
    own_test = "printf '\\ndef test_mine():\\n    assert add(1, 1) == 2\\n' >> tests/test_calc.py"
    gc = "git -c user.name=a -c user.email=a@a commit -qam mine && git gc -q --prune=now"
    for edits, setup, reward in (((), "", 0.0), (fix, "", 1.0), (fix, own_test, 1.0), ((), own_test, 0.0),
                                 (fix, f"{own_test} && {gc}", 1.0)):
        result = _grade(task, tmp_path / "s", edits, setup=setup)
        assert (result.reward, result.invalid) == (reward, False), (setup, result.reason, result.log_tail)


SPACED_PATCH = (
    "diff --git a/tests/test_a b.py b/tests/test_a b.py\n--- a/tests/test_a b.py\t\n+++ b/tests/test_a b.py\t\n"
    "@@ -3,3 +3,4 @@ from calc import add\n \n def test_zero():\n     assert add(0, 0) == 0\n+    assert add(1, 0) == 1\n"
    "diff --git a/tests/test_new.py b/tests/test_new.py\nnew file mode 100644\n--- /dev/null\n+++ b/tests/test_new.py\n"
    "@@ -0,0 +1,4 @@\n+from calc import add\n+\n+\n+def test_add(): assert add(2, 3) == 5\n")
"""A test patch as git writes it for a name with a space (a tab after the name), which also adds a file
(SWE-bench's log reading splits names at spaces: the named test is in the other file)."""


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_a_name_with_a_space_is_reset_and_a_file_the_base_lacks_is_removed(tmp_path):
    """One patch edits ``tests/test_a b.py`` and adds ``tests/test_new.py``: the agent's
    edit of the first is reset and its own ``tests/test_new.py`` removed, so the patch
    applies (a ``git checkout`` of both paths would fail as a whole: the base lacks one)."""
    require_bwrap()
    repo = _committed_calc_repo(tmp_path, {
        "tests/test_a b.py": "from calc import add\n\n\ndef test_zero():\n    assert add(0, 0) == 0\n"})
    grading = Grading((), f"{sys.executable} -m pytest -rA -p no:cacheprovider tests", "pytest-swebench",
                      fail_to_pass=("tests/test_new.py::test_add",), test_patch=SPACED_PATCH)
    task = SweTask("calc__4", "add subtracts", repo, None, grading)
    shadow = f"printf %s {shlex.quote(SHADOWED)} | cat - 'tests/test_a b.py' > t && mv t 'tests/test_a b.py'"
    own_test = "printf '%s\\n' 'from calc import add' 'def test_add(): pass' > tests/test_new.py"
    cheat = _grade(task, tmp_path / "s", setup=shadow)  # collected first, the edited file would patch calc.add
    assert (cheat.reward, cheat.reason) == (0.0, "FAIL_TO_PASS tests/test_new.py::test_add: FAILED"), cheat.log_tail
    fixed = _grade(task, tmp_path / "s", (Edit("calc.py", "a - b", "a + b"),), setup=f"{own_test} && {shadow}")
    assert (fixed.reward, fixed.reason) == (1.0, "passed"), fixed.log_tail


CALC_TEST = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
HEADER_ONLY = {  # entries of a git patch without ---/+++ lines: (base files, patch, the file the agent edits)
    "rename": ({"tests/calc_checks.py": CALC_TEST}, "diff --git a/tests/calc_checks.py b/tests/test_calc.py\n"
               "similarity index 100%\nrename from tests/calc_checks.py\nrename to tests/test_calc.py\n",
               "tests/calc_checks.py"),
    "copy": ({"tests/calc_checks.py": CALC_TEST}, "diff --git a/tests/calc_checks.py b/tests/test_calc.py\n"
             "similarity index 100%\ncopy from tests/calc_checks.py\ncopy to tests/test_calc.py\n", "tests/calc_checks.py"),
    "mode": ({"tests/test_calc.py": CALC_TEST}, "diff --git a/tests/test_calc.py b/tests/test_calc.py\n"
             "old mode 100644\nnew mode 100755\n", "tests/test_calc.py"),
}


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
@pytest.mark.parametrize("kind", sorted(HEADER_ONLY))
def test_a_header_only_entry_of_the_test_patch_is_reset_too(tmp_path, kind):
    """A pure rename, copy or mode change (no ``---``/``+++`` lines) touches its files: the
    agent's edit of them is reset, so unfixed code that patches ``add`` there gets 0."""
    require_bwrap()
    files, patch, edited = HEADER_ONLY[kind]
    grading = Grading((), f"{sys.executable} -m pytest -rA -p no:cacheprovider tests/test_calc.py", "pytest-swebench",
                      fail_to_pass=("tests/test_calc.py::test_add",), test_patch=patch)
    task = SweTask("calc__9", "add subtracts", _committed_calc_repo(tmp_path, files), None, grading)
    cheat = _grade(task, tmp_path / "s", setup=f"printf %s {shlex.quote(SHADOWED)} | cat - {edited} > t && mv t {edited}")
    assert (cheat.reward, cheat.reason) == (0.0, "FAIL_TO_PASS tests/test_calc.py::test_add: FAILED"), cheat.log_tail
    fixed = _grade(task, tmp_path / "s", (Edit("calc.py", "a - b", "a + b"),))
    assert (fixed.reward, fixed.reason) == (1.0, "passed"), fixed.log_tail


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_a_hunk_line_that_looks_like_a_file_header_resets_nothing(tmp_path):
    """A test patch whose added test data holds ``++ b/calc.py`` (written ``+++ b/calc.py``)
    and an empty new file: ``calc.py`` is not reset (an honest fix keeps its 1), and the
    agent's own copy of the new file does not stop the patch from applying."""
    require_bwrap()
    patch = (CALC_PATCH_HEAD + "diff --git a/tests/data.txt b/tests/data.txt\nnew file mode 100644\n--- /dev/null\n"
             "+++ b/tests/data.txt\n@@ -0,0 +1,2 @@\n+++ b/calc.py\n+-- a/calc.py\n"
             "diff --git a/tests/__init__.py b/tests/__init__.py\nnew file mode 100644\nindex 0000000..e69de29\n")
    grading = Grading((), f"{sys.executable} -m pytest -rA -p no:cacheprovider tests/test_calc.py", "pytest-swebench",
                      fail_to_pass=("tests/test_calc.py::test_add",), test_patch=patch)
    task = SweTask("calc__10", "add subtracts", _committed_calc_repo(tmp_path, {}), None, grading)
    fixed = _grade(task, tmp_path / "s", (Edit("calc.py", "a - b", "a + b"),), setup="mkdir -p tests && touch tests/__init__.py")
    assert (fixed.reward, fixed.reason) == (1.0, "passed"), fixed.log_tail
    unfixed = _grade(task, tmp_path / "s")
    assert (unfixed.reward, unfixed.reason) == (0.0, "FAIL_TO_PASS tests/test_calc.py::test_add: FAILED"), unfixed.log_tail


CALC_PATCH_HEAD = ("diff --git a/tests/test_calc.py b/tests/test_calc.py\nnew file mode 100644\n--- /dev/null\n"
                   "+++ b/tests/test_calc.py\n@@ -0,0 +1,5 @@\n" + "".join(f"+{line}\n" for line in CALC_TEST.splitlines()))
