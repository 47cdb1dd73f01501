"""The base commit's version of each file a SWE-bench test patch touches, read on the host
from the task's pristine repository, never from the agent's sandbox.

SWE-bench resets those files before it applies the test patch (``git checkout <base> --
<files>``; ``swebench.harness.test_spec``). Run on the agent's repository, that checkout
reads the agent's objects: an agent that deleted or replaced the base commit's objects
would keep its own edits to the test files. So the grader reads the files here, from the
repository the sandbox was copied from, and hands them to the sandbox as a ``git
fast-import`` stream (:func:`fast_import_stream`): grading's own git checks them out
(modes, links and the work tree's text conversions as ``git checkout`` writes them).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from mlperf_grpo.tasks.base import TaskError

GIT_TIMEOUT_S = 60.0
FILE_MODES = ("100644", "100755", "120000")
"""Modes of the tree entries written back: a file, an executable file, a symbolic link."""
_ESCAPES = {"a": 7, "b": 8, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11, '"': 34, "\\": 92}


@dataclass(frozen=True)
class BaseFile:
    """One touched path at the base commit: ``mode`` one of :data:`FILE_MODES` and its
    bytes (a link: its target), or ``mode`` "" where the base has no file there."""

    path: str
    mode: str
    data: bytes = b""


_HUNK = re.compile(r"@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_RENAMES = {"rename from ": 0, "copy from ": 0, "rename to ": 1, "copy to ": 1}


def diff_paths(patch: str) -> tuple[set[str], set[str]]:
    """``(read, written)``: the paths of a unified diff's ``---`` and ``+++`` file headers,
    their first folder stripped as ``git apply -p1`` does, and git's ``rename``/``copy``
    ``from``/``to`` lines (``/dev/null`` left out; git's C-quoted names unquoted; a tab and
    what follows it, which git adds after a name with a space and GNU diff before its time
    stamp, cut). Lines inside a hunk (counted by its ``@@ -l,s +l,s @@`` header, as ``git
    apply`` does) are content, never names."""
    return _diff_paths(patch)[:2]


def touched_files(patch: str) -> list[str]:
    """The paths a test patch reads or writes, sorted: what grading resets to the base;
    with the paths of git's ``diff --git`` lines, so an entry without ``---``/``+++`` lines
    (a pure rename or copy, a mode change, an empty new file) counts too."""
    read, written, headers = _diff_paths(patch)
    return sorted(read | written | headers)


def _diff_paths(patch: str) -> tuple[set[str], set[str], set[str]]:
    """``(read, written, git header paths)`` of :func:`diff_paths` and :func:`touched_files`.
    Lines end at ``\\n`` alone (git's; ``str.splitlines`` also ends them at form feeds and
    other separators a hunk's content may hold). A git entry (``diff --git``) names its old
    and new files; a plain diff's entry writes one file, as ``git apply`` picks it: its
    ``+++`` name, or its ``---`` name where ``+++`` is ``/dev/null``."""
    read, written, headers = set(), set(), set()
    old = new = 0  # lines left in the current hunk
    git_entry, hunk_seen, plain_old = False, False, None
    for line in patch.split("\n"):
        line = line.removesuffix("\r")
        if old > 0 or new > 0:  # a hunk's line: " " (or "", a context line stripped of its space) both, "-", "+"
            tag = line[:1]
            old -= tag in (" ", "", "-")
            new -= tag in (" ", "", "+")
            continue
        if hunk := _HUNK.match(line):
            old, new = (1 if count is None else int(count) for count in hunk.groups())
            hunk_seen = True
        elif line.startswith("diff --git "):
            git_entry, hunk_seen = True, False
            headers.update(_git_header_paths(line[len("diff --git "):]))
        elif line.startswith("--- "):
            if hunk_seen or not git_entry:  # a plain diff's entry begins
                git_entry, hunk_seen = False, False
            plain_old = _stripped(_name(line[4:], git_entry))
            if git_entry and plain_old is not None:
                read.add(plain_old)
        elif line.startswith("+++ "):
            name = _stripped(_name(line[4:], git_entry))
            if name is not None:
                written.add(name)
            elif not git_entry and plain_old is not None:  # a plain diff's deletion: +++ /dev/null
                read.add(plain_old)
        elif git_entry:
            for marker, side in _RENAMES.items():
                if line.startswith(marker):
                    (read, written)[side].add(_name(line[len(marker):], True))
    return read, written, headers


_TIMESTAMP = re.compile(r"\s+(?:\d{4}-\d\d-\d\d|(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) \w{3} [ \d]\d) .*$")


def _name(text: str, git_entry: bool) -> str:
    """A name as a diff writes it: C-quoted, or cut at a tab (and, in a plain diff, before
    a time stamp after a space: GNU diff's ``-u`` and ``-c`` formats)."""
    if text.startswith('"'):
        return _unquote(text)
    name = text.split("\t")[0]
    return name if git_entry else _TIMESTAMP.sub("", name)


def _stripped(name: str) -> str | None:
    """``name`` without its first folder (``git apply``'s ``-p1``, whatever the prefix:
    ``a/``, ``b/``, or ``i/``/``w/`` of ``diff.mnemonicPrefix``); None for ``/dev/null`` or
    a name with no folder to strip, or one that would not be inside the repository
    (absolute after the strip, or climbing with ``..``: git refuses such a patch)."""
    if name == "/dev/null" or "/" not in name:
        return None
    path = name.split("/", 1)[1]
    return None if not path or path.startswith("/") or ".." in path.split("/") else path


def _git_header_paths(text: str) -> set[str]:
    """The paths of ``diff --git``'s ``a/X b/Y`` (each maybe C-quoted): both where they
    can be told apart, else none (an unquoted name with spaces that was renamed: its
    ``rename`` lines or ``---``/``+++`` headers name it)."""
    if text.startswith('"'):
        end = _closing_quote(text)
        first, rest = _unquote(text[:end + 1]), text[end + 2:]
        second = _unquote(rest) if rest.startswith('"') else rest
    elif text.endswith('"'):
        first, second = text[:text.index(' "')], _unquote(text[text.index(' "') + 1:])
    else:
        half = (len(text) - 5) // 2  # "a/" P " b/" P: the same P on both sides
        first, second = text[:half + 2], text[half + 3:]
        if first[2:] != second[2:]:
            return set()
    return {path for path in (_stripped(first), _stripped(second)) if path is not None}


def _closing_quote(text: str) -> int:
    """The index of the quote that closes the C-quoted name ``text`` starts with."""
    i = 1
    while i < len(text) and text[i] != '"':
        i += 2 if text[i] == "\\" else 1
    return i


def read_base_files(repo: Path, base: str, paths: list[str]) -> tuple[BaseFile, ...]:
    """``paths`` as they are in commit ``base`` of the git repository ``repo`` (its work
    tree's folder), one :class:`BaseFile` each, in order. The repository is the task's,
    trusted: its own config is read (object format), no system or global one.

    Raises:
        TaskError: no git, ``repo`` is not a git repository, or ``base`` is not a commit of it.
    """
    commit = _git(repo, ["rev-parse", "--verify", "--quiet", f"{base}^{{commit}}"],
                  f"commit {base!r}").decode().strip()
    listing = _git(repo, ["ls-tree", "-r", "-z", "--full-tree", commit, "--", *paths], "its tree") if paths else b""
    entries = {}
    for record in listing.split(b"\0"):
        meta, _, name = record.partition(b"\t")
        if meta and meta.split()[0].decode() in FILE_MODES:
            mode, _, oid = meta.decode().split()
            entries[os.fsdecode(name)] = (mode, oid)
    wanted = [entries[path][1] for path in paths if path in entries]
    blobs = _git(repo, ["cat-file", "--batch"], "its files", "".join(f"{oid}\n" for oid in wanted).encode()) \
        if wanted else b""
    contents, at = {}, 0
    for oid in wanted:  # each: "<oid> blob <size>\n<bytes>\n"
        end = blobs.index(b"\n", at)
        size = int(blobs[at:end].split()[2])
        contents[oid], at = blobs[end + 1:end + 1 + size], end + 2 + size
    return tuple(BaseFile(path, entries[path][0], contents[entries[path][1]]) if path in entries
                 else BaseFile(path, "") for path in paths)


def fast_import_stream(files: tuple[BaseFile, ...], ref: str) -> bytes:
    """A ``git fast-import`` stream of one commit, on ``ref``, holding the ``files`` the
    base has (fixed author and time: the same files give the same bytes)."""
    out = [f"commit {ref}\ncommitter grader <grader> 0 +0000\ndata 0\n".encode()]
    for file in files:
        if file.mode:
            line = f"M {file.mode} inline {_quote(file.path)}\ndata {len(file.data)}\n"
            out += [line.encode("utf-8", "surrogateescape"), file.data, b"\n"]
    return b"".join(out) + b"\n"


def _git(repo: Path, args: list[str], what: str, stdin: bytes = b"") -> bytes:
    env = {"GIT_DIR": str(Path(repo) / ".git"), "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
           "GIT_NO_REPLACE_OBJECTS": "1", "GIT_LITERAL_PATHSPECS": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    try:
        done = subprocess.run(["git", *args], cwd=repo, env=env, input=stdin, capture_output=True,
                              timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise TaskError(f"grading: cannot run git on the task's repository {repo} ({error}); install git") from None
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().replace("\n", " ")[:200] or f"exit {done.returncode}"
        raise TaskError(f"grading: cannot read {what} from the task's repository {repo} ({why}); a SWE-bench row "
                        "needs the git repository at its base_commit (repo_dir, or /testbed of its image)")
    return done.stdout


def _quote(path: str) -> str:
    """``path`` C-quoted, as fast-import reads a path that would end its line or start with a quote."""
    body = path.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{body}"'


def _unquote(text: str) -> str:
    """A name git wrote C-quoted (``"a/t\\303\\251st.py"``), unquoted (git ``quote.c``)."""
    body, out, i = text[1:text.rfind('"')], bytearray(), 0
    while i < len(body):
        if body[i] != "\\":
            out += body[i].encode("utf-8", "surrogateescape")
            i += 1
        elif body[i + 1:i + 2] in _ESCAPES:
            out.append(_ESCAPES[body[i + 1]])
            i += 2
        elif len(digits := body[i + 1:i + 4]) == 3 and set(digits) <= set("01234567"):
            out.append(int(digits, 8) & 0xFF)
            i += 4
        else:  # not git's quoting: the name as written
            return text
    return out.decode("utf-8", "surrogateescape")
