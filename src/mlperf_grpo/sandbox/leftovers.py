"""Ownership markers of sandbox folders, and removal of those whose run is dead. Torch-free.

Each sandbox folder ``<root>/sbx-*`` holds ``owner.json``: the pid and the kernel start time
of the process that made it (a reused pid has another start time), and the container it
started, if any. A run killed by SIGKILL leaves its folders; the next run's
:func:`cleanup_leftovers` removes them (its bubblewrap processes are gone already:
``--die-with-parent``).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

MARKER = "owner.json"
PREFIX = "sbx-"
FOLDER_BATCH = 1024  # remove_tree: sub-folder names read per scan of a folder (memory: names x depth at most)


def process_start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks after boot), None if no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2:].split()[19])


def write_marker(folder: Path, container: str | None = None, runtime: str | None = None) -> None:
    """Mark ``folder`` as owned by this process (and the container it runs, if any)."""
    pid = os.getpid()
    record = {"pid": pid, "start_time": process_start_time(pid), "container": container, "runtime": runtime}
    (folder / MARKER).write_text(json.dumps(record))


def read_marker(folder: Path) -> dict | None:
    """``folder``'s marker as :func:`write_marker` wrote it, or None: missing, cut short, or
    not of that shape (a JSON value other than an object with an integer ``pid``)."""
    try:
        record = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or type(record.get("pid")) is not int:
        return None
    return record


def owner_alive(folder: Path) -> bool:
    """The process that made ``folder`` still runs (a folder without a readable marker is
    taken as alive for a minute after it was made: it is being set up)."""
    record = read_marker(folder)
    if record is None:
        return time.time() - folder.stat().st_mtime < 60
    return process_start_time(record["pid"]) == record.get("start_time")


def remove_tree(path: Path) -> None:
    """Remove ``path`` without following links, at any depth (the sandboxed code may nest
    folders deeper than Python's recursion limit and longer than ``PATH_MAX``), opening up
    folders it made unreadable (``chmod 000``: a non-root owner cannot otherwise list them).
    Walks down one folder at a time by descriptor, removes what is there, and climbs back
    through ``..``: at most two descriptors open. A ``..`` that is not the folder it came
    from (a folder moved away while it was being removed) stops it: it never removes
    anything outside ``path``.

    Raises:
        OSError: what could not be removed, or a folder moved during the removal.
    """
    if path.is_symlink() or path.is_file():
        path.unlink()
        return
    if not path.is_dir():
        return
    fd = _open_folder(str(path), None)
    walked: list[tuple[str, int, int, list[str]]] = []  # folders walked into: name, parent's (device, inode), siblings left
    try:
        pending = _empty_but_folders(fd)
        while True:
            if pending:
                child = pending.pop()
                next_fd = _open_folder(child, fd)
                here = os.fstat(fd)
                walked.append((child, here.st_dev, here.st_ino, pending))
                os.close(fd)
                fd = next_fd  # before the scan: a scan that raises must not leave the closed one to close again
                pending = _empty_but_folders(fd)
            elif walked:
                name, device, inode, pending = walked.pop()
                parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = parent
                seen = os.fstat(fd)
                if (seen.st_dev, seen.st_ino) != (device, inode):
                    raise OSError(errno.ESTALE, f"a folder under {path} was moved while it was being removed")
                os.rmdir(name, dir_fd=fd)
                pending = pending or _empty_but_folders(fd)  # a folder wider than one batch
            else:
                break
    finally:
        os.close(fd)
    os.rmdir(path)


def remove_sandbox(folder: Path) -> None:
    """Remove the sandbox folder ``folder`` with :func:`remove_tree`, its marker last: a removal
    cut short (SIGKILL, SIGTERM) leaves a folder naming its dead owner, which the next
    :func:`cleanup_leftovers` removes at once (one without a marker waits a minute: taken
    for a sandbox being set up). Raises OSError as :func:`remove_tree`."""
    if folder.is_dir() and not folder.is_symlink():
        for name in sorted(os.listdir(folder)):  # made by Sandbox: testbed, etc, the marker
            if name != MARKER:
                remove_tree(folder / name)
    remove_tree(folder)


def _open_folder(name: str, dir_fd: int | None) -> int:
    """A descriptor of the folder ``name`` (never a link), its owner given full access
    first where the sandboxed code took it away (``chmod 000``, ``chmod 500``)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except PermissionError:  # not listable: open it up through a handle that cannot be a link
        handle = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
        try:
            os.chmod(f"/proc/self/fd/{handle}", stat.S_IRWXU)
        finally:
            os.close(handle)
        fd = os.open(name, flags, dir_fd=dir_fd)
    if os.fstat(fd).st_mode & stat.S_IRWXU != stat.S_IRWXU:
        try:
            os.fchmod(fd, stat.S_IRWXU)
        except OSError:
            pass
    return fd


def _empty_but_folders(fd: int) -> list[str]:
    """Unlink every non-folder entry of the folder ``fd`` (links included, not followed); the
    names of up to :data:`FOLDER_BATCH` of its sub-folders, empty when the folder is now empty.
    A batch, not one: rescanning a folder from its start after each sub-folder made closing
    50,000 sibling folders take 22 s (ext4 reads past the removed entries each time)."""
    names: list[str] = []
    with os.scandir(fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                names.append(entry.name)
                if len(names) == FOLDER_BATCH:
                    break
                continue
            try:
                os.unlink(entry.name, dir_fd=fd)
            except FileNotFoundError:
                pass
    return names


def kill_processes_naming(text: str) -> int:
    """SIGKILL every process whose command line contains ``text`` (a dead run's ``bwrap``,
    which names its sandbox folder: killing it ends its pid namespace); returns how many."""
    needle, killed = text.encode(), 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if needle in Path(f"/proc/{entry}/cmdline").read_bytes():
                os.kill(int(entry), signal.SIGKILL)
                killed += 1
        except (OSError, ProcessLookupError):
            continue
    return killed


def root_problem(root: Path) -> str:
    """"" when the existing folder ``root`` is safe to make sandboxes in, else why not: it
    must belong to this user (or root) and not be writable by other users unless sticky (as
    ``/tmp``), since whoever can rename entries there could swap a sandbox's folder for a
    link while it is made, bound or removed; and this user must be able to write there.
    Every folder above it (resolved) is held to the same owner and mode rule, as OpenSSH's
    ``StrictModes`` does for ``~/.ssh`` (``safe_path``): whoever may rename an entry of
    ``/a`` can swap ``/a/b/root`` whole; so is every folder of the path as given (a link
    ``/a/link`` to a safe folder is as safe as ``/a``: its owner may point it elsewhere)."""
    info = os.stat(root)
    if info.st_uid not in (os.geteuid(), 0):
        return f"it belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        return f"other users may write there (mode {stat.S_IMODE(info.st_mode):o}, not sticky)"
    if not os.access(root, os.W_OK | os.X_OK):
        return "this user cannot write there"
    for parent in dict.fromkeys([*Path(root).absolute().parents, *Path(root).resolve().parents]):
        info = os.stat(parent)
        if info.st_uid not in (os.geteuid(), 0):
            return (f"the folder {parent} above it belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()}) "
                    "or root, and its owner could swap what is below it")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
            return (f"other users may write the folder {parent} above it (mode {stat.S_IMODE(info.st_mode):o}, "
                    f"not sticky) and swap what is below it: chmod go-w {parent} (or +t)")
    return ""


CONTAINER_RM_TIMEOUT_S = 60.0
"""How long a leftover's container runtime may take to remove its container."""


def cleanup_leftovers(root: Path) -> int:
    """Remove the sandboxes under ``root`` whose owning process is dead: kill what still
    runs there (a ``bwrap`` whose parent died before it could arm ``--die-with-parent``),
    remove their containers and folders; returns how many sandboxes were removed. A
    missing ``root``, or one :func:`root_problem` refuses, has none. A folder that cannot
    be removed (OSError: permissions, a folder moved meanwhile; a container runtime that
    does not remove its container in :data:`CONTAINER_RM_TIMEOUT_S`) is left with one
    warning line on stderr: a killed run's leftover does not stop this run."""
    if not Path(root).is_dir() or root_problem(Path(root)):
        return 0  # a folder not safe to work in is not cleaned either (Sandbox refuses it)
    removed = 0
    for folder in sorted(Path(root).glob(f"{PREFIX}*")):
        try:
            if not folder.is_dir() or folder.is_symlink() or owner_alive(folder):
                continue
            _remove_leftover(folder)
        except (OSError, subprocess.SubprocessError) as error:
            print(f"warning: leftover sandbox {folder} of a killed run not removed "
                  f"({getattr(error, 'strerror', None) or error}); "
                  "remove it by hand", file=sys.stderr)
            continue
        removed += 1
    return removed


def _remove_leftover(folder: Path) -> None:
    """Remove the dead run's sandbox ``folder``: its container, its processes, the folder.
    Raises OSError as :func:`remove_sandbox`; TimeoutExpired: the runtime took longer
    than :data:`CONTAINER_RM_TIMEOUT_S` (the folder is kept: the container may still use it)."""
    record = read_marker(folder) or {}
    container, runtime = record.get("container"), record.get("runtime")
    if isinstance(container, str) and isinstance(runtime, str) and container and shutil.which(runtime):
        subprocess.run([runtime, "rm", "-f", container], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=CONTAINER_RM_TIMEOUT_S, check=False)
    kill_processes_naming(f"{folder}/")
    remove_sandbox(folder)
