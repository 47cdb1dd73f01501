"""tasks/swe/base_files.py: the paths a test patch touches, their base versions read with
git from the task's pristine repository (modes, links, absent files), and the fast-import
stream that brings them back, checked by real git."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from sandbox_helpers import require_bwrap

from mlperf_grpo.agent.swe_session import SweSession, SweSessionSettings
from mlperf_grpo.sandbox import Sandbox, SandboxLimits
from mlperf_grpo.tasks.base import TaskError
from mlperf_grpo.tasks.swe import Grading, SweTask, pristine_base_files
from mlperf_grpo.tasks.swe.base_files import BaseFile, diff_paths, fast_import_stream, read_base_files, touched_files

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
       "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
PATCH = ('diff --git "a/t\\303\\251st \\"q\\".py" "b/t\\303\\251st \\"q\\".py"\n--- "a/t\\303\\251st \\"q\\".py"\n'
         '+++ "b/t\\303\\251st \\"q\\".py"\n@@ -1 +1 @@\n-a\n+b\n'
         "diff --git a/run me.sh b/run me.sh\n--- a/run me.sh\t\n+++ b/run me.sh\t\n@@ -1 +1 @@\n-a\n+b\n"
         "diff --git a/gone.py b/gone.py\ndeleted file mode 100644\n--- a/gone.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-a\n"
         "diff --git a/new.py b/new.py\nnew file mode 100644\n--- /dev/null\n+++ b/new.py\t2026-12-07 01:00:00\n"
         "@@ -0,0 +1 @@\n+a\n")
"""Git's C-quoted name, a name with a space (git's tab after it), a deleted and a new file (GNU diff's time stamp)."""


def _git(repo: Path, *args: str, stdin: bytes = b"") -> bytes:
    return subprocess.run(["git", *args], cwd=repo, env=ENV, input=stdin, capture_output=True, check=True).stdout


def _repo(tmp_path: Path) -> Path:
    """Base commit: a file, an executable, a link, a file the next commit deletes; HEAD is that next commit."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "tést \"q\".py").write_bytes(b"a\n\xff raw\n")
    (repo / "run me.sh").write_text("a\n")
    (repo / "run me.sh").chmod(0o755)
    (repo / "gone.py").write_text("a\n")
    os.symlink("run me.sh", repo / "link")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    (repo / "gone.py").unlink()
    _git(repo, "commit", "-qam", "later")
    return repo


def test_the_touched_paths_of_a_patch_are_read_as_git_and_gnu_diff_write_them():
    assert diff_paths(PATCH) == ({'tést "q".py', "run me.sh", "gone.py"}, {'tést "q".py', "run me.sh", "new.py"})
    assert touched_files(PATCH) == ["gone.py", "new.py", "run me.sh", 'tést "q".py']


def test_base_files_keep_bytes_modes_and_links_and_say_which_the_base_lacks(tmp_path):
    repo = _repo(tmp_path)
    paths = [*touched_files(PATCH), "link"]
    files = read_base_files(repo, "HEAD~1", paths)
    assert files == (BaseFile("gone.py", "100644", b"a\n"), BaseFile("new.py", ""), BaseFile("run me.sh", "100755", b"a\n"),
                     BaseFile('tést "q".py', "100644", b"a\n\xff raw\n"), BaseFile("link", "120000", b"run me.sh"))
    assert read_base_files(repo, "HEAD", ["gone.py"]) == (BaseFile("gone.py", ""),)
    out = tmp_path / "out"  # the stream, imported and checked out by git as grading does it
    _git(tmp_path, "init", "-q", str(out))
    _git(out, "fast-import", "--quiet", stdin=fast_import_stream(files, "refs/heads/grading-base"))
    _git(out, "checkout", "-q", "refs/heads/grading-base", "--", ".")
    assert sorted(p.name for p in out.iterdir() if p.name != ".git") == ["gone.py", "link", "run me.sh", 'tést "q".py']
    assert (out / 'tést "q".py').read_bytes() == b"a\n\xff raw\n" and os.readlink(out / "link") == "run me.sh"
    assert os.access(out / "run me.sh", os.X_OK) and not os.access(out / "gone.py", os.X_OK)
    assert fast_import_stream(files, "refs/heads/x") == fast_import_stream(files, "refs/heads/x")


def test_a_repository_without_the_base_is_one_clear_error(tmp_path):
    repo = _repo(tmp_path)
    with pytest.raises(TaskError, match=r"cannot read commit 'f00d' from the task's repository .*base_commit"):
        read_base_files(repo, "f00d", ["gone.py"])
    (tmp_path / "plain").mkdir()
    with pytest.raises(TaskError, match="cannot read commit 'HEAD'"):
        read_base_files(tmp_path / "plain", "HEAD", ["gone.py"])


def _task(repo: Path | None, base: str) -> SweTask:
    grading = Grading((), "true", "pytest-swebench", fail_to_pass=("t",), test_patch=PATCH)
    return SweTask("t__1", "issue", repo, None, grading, {"base_commit": base})


def test_an_image_s_base_files_are_read_from_the_sandbox_s_fresh_copy(tmp_path):
    """Without ``repo_dir`` (an image's ``/testbed``) the base files come from the sandbox's
    copy before the agent runs (as a root run's sandbox, owned by its own uid); no
    repository at all is an error, not a reset skipped."""
    require_bwrap()
    repo = _repo(tmp_path)
    base = _git(repo, "rev-parse", "HEAD~1").decode().strip()
    task = _task(None, base)
    with pytest.raises(TaskError, match="no repository to read"):
        pristine_base_files(task)
    with Sandbox(repo, SandboxLimits(), tmp_path / "s") as sandbox:
        assert pristine_base_files(task, sandbox.workdir) == pristine_base_files(_task(repo, base))
    assert pristine_base_files(_task(repo, base))[2] == BaseFile("run me.sh", "100755", b"a\n")


def test_a_session_whose_base_files_cannot_be_read_fails_and_leaves_no_sandbox(tmp_path):
    require_bwrap()
    plain = tmp_path / "plain"
    plain.mkdir()
    settings = SweSessionSettings(SandboxLimits(), 60.0, tmp_path / "s")
    with pytest.raises(TaskError, match="a SWE-bench row needs the git repository at its base_commit"):
        SweSession(_task(plain, "HEAD"), settings, lambda task: [])
    assert list((tmp_path / "s").iterdir()) == []


def test_git_header_lines_count_and_hunk_lines_never_do():
    """``diff --git`` names (plain, with spaces, C-quoted), ``rename``/``copy`` lines; a
    hunk's lines are content however they look (counted by the ``@@`` header)."""
    patch = ('diff --git "a/t\\303\\251 x.py" "b/t\\303\\251 x.py"\nold mode 100644\nnew mode 100755\n'
             "diff --git a/s p.py b/s p.py\nnew file mode 100644\nindex 0000000..e69de29\n"
             "diff --git a/old.py b/new.py\nrename from old.py\nrename to new.py\n"
             "diff --git a/d.txt b/d.txt\n--- a/d.txt\n+++ b/d.txt\n@@ -1,2 +1,3 @@\n x\n-- a/gone.py\n++++ b/calc.py\n+\n"
             "\\ No newline at end of file\n")
    assert touched_files(patch) == ["d.txt", "new.py", "old.py", "s p.py", "té x.py"]
    assert diff_paths(patch) == ({"d.txt", "old.py"}, {"d.txt", "new.py"})


HUNK = "@@ -1 +1,2 @@\n x\n+y\n"


@pytest.mark.parametrize("patch, touched", [
    ("diff --git i/t/a.py w/t/a.py\n--- i/t/a.py\n+++ w/t/a.py\n" + HUNK, ["t/a.py"]),  # diff.mnemonicPrefix
    ("--- x/t/a.py\n+++ y/t/a.py\n" + HUNK, ["t/a.py"]),  # -p1 strips any first folder
    ("--- a/t/a.py 2020-01-01 00:00:00.000000000 +0000\n+++ b/t/a.py 2020-01-01 00:00:00.000000000 +0000\n" + HUNK,
     ["t/a.py"]),  # GNU diff -u's time stamp after a space
    ("--- a/calc.py\n+++ b/t/a.py\n" + HUNK, ["t/a.py"]),  # a plain diff writes its +++ name only
    ("--- a/t/gone.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-x\n", ["t/gone.py"]),
    ("diff --git a/d.txt b/d.txt\nnew file mode 100644\n--- /dev/null\n+++ b/d.txt\n@@ -0,0 +1,2 @@\n+\x0c\n+++ b/calc.py\n",
     ["d.txt"]),  # a form feed ends no line for git
    ("diff --git a/d.txt b/d.txt\nnew file mode 100644\n--- /dev/null\n+++ b/d.txt\n@@ -0,0 +1 @@\n+x\x0c@@ -1,50 +1,50 @@\n"
     "diff --git a/t/a.py b/t/a.py\n--- a/t/a.py\n+++ b/t/a.py\n" + HUNK, ["d.txt", "t/a.py"]),
])
def test_the_touched_paths_are_the_ones_git_apply_writes(patch, touched):
    """Break-test cases: other prefixes than a/ b/, time stamps, a plain diff's two names,
    separators that ``str.splitlines`` takes for line ends inside a hunk."""
    assert touched_files(patch) == touched


def test_a_path_outside_the_repository_is_never_touched():
    """``a//etc/x`` and ``a/../x`` (git refuses such a patch): nothing to remove or reset."""
    assert touched_files("--- a//etc/x\n+++ b//etc/x\n" + HUNK) == []
    assert touched_files("diff --git a/../x b/../x\n--- a/../x\n+++ b/../x\n" + HUNK) == []
