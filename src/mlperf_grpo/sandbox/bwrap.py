"""The bubblewrap (``bwrap``) command line of one sandboxed command. Torch-free.

What the command sees (everything else of the host is absent, not just read-only):
``/usr`` (and the ``/bin``, ``/lib``, ... links or binds of the host), the Python
installations named in ``ro_paths`` (read-only: the interpreter and packages the tests
use), a generated ``/etc/passwd`` and ``/etc/group`` and a few read-only ``/etc`` files
the loader and locale need, a new ``/proc`` (its own pid namespace), a minimal ``/dev``,
a private size-limited tmpfs ``/tmp``, and its repository copy read-write at
``/testbed``. Namespaces: user (runs as uid/gid 1000, no capabilities; ``RLIMIT_NPROC``
then counts per sandbox), pid, network (no interface but loopback: no connection leaves
it, nothing on the host's loopback is reachable), ipc, uts, cgroup. ``--die-with-parent``
and the pid namespace end every process of the sandbox when its ``bwrap`` is killed;
``--new-session`` keeps it off the caller's terminal.
Source of the flags: bubblewrap(1), bubblewrap 0.8.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from mlperf_grpo.sandbox.limits import SandboxLimits, limited_shell

INSIDE_UID = 1000
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "nsswitch.conf",
             "alternatives", "os-release", "mime.types", "hosts")
"""Host ``/etc`` entries the sandbox gets read-only (where present): the dynamic loader,
time zone, name service switch, update-alternatives links. No credentials, no keys."""
TOP_LEVEL_SYSTEM = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


def system_args() -> list[str]:
    """Read-only ``/usr`` and the top-level system folders: a link where the host has a
    link (merged /usr), a read-only bind where it has a folder."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in TOP_LEVEL_SYSTEM:
        host = Path("/") / name
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), f"/{name}"]
        elif host.is_dir():
            args += ["--ro-bind", str(host), f"/{name}"]
    for name in ETC_FILES:
        if (Path("/etc") / name).exists():
            args += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    return args


def write_identity(folder: Path) -> tuple[Path, Path]:
    """A passwd and group file for the sandbox user (the host's are not shown)."""
    folder.mkdir(parents=True, exist_ok=True)
    passwd, group = folder / "passwd", folder / "group"
    passwd.write_text(f"root:x:0:0:root:/root:/bin/bash\nsandbox:x:{INSIDE_UID}:{INSIDE_UID}::/tmp:/bin/bash\n"
                      "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
    group.write_text(f"root:x:0:\nsandbox:x:{INSIDE_UID}:\nnogroup:x:65534:\n")
    return passwd, group


def bwrap_argv(bwrap: str, workdir: Path, inside_workdir: str, etc_dir: Path,
               ro_paths: Sequence[Path], limits: SandboxLimits, command: str) -> list[str]:
    """The full argv: ``bwrap`` ... ``bash -c <limits> <command>`` in ``inside_workdir``.

    ro_paths: host folders bound read-only at the same path (Python installations).
    The command's environment is cleared to PATH, HOME=/tmp, LANG, and the first
    ``ro_paths`` entry's ``bin`` leads PATH (the run's Python environment).
    """
    path_dirs = [str(Path(p) / "bin") for p in ro_paths] + ["/usr/local/bin", "/usr/bin", "/bin"]
    args = [
        bwrap, "--unshare-user", "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID),
        "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--hostname", "sandbox", "--die-with-parent", "--new-session", "--disable-userns",
        "--cap-drop", "ALL", "--clearenv",
        "--setenv", "PATH", ":".join(dict.fromkeys(path_dirs)), "--setenv", "HOME", "/tmp",
        "--setenv", "LANG", "C.UTF-8", "--setenv", "TMPDIR", "/tmp",
        *system_args(),
    ]
    for path in dict.fromkeys(str(Path(p)) for p in ro_paths):
        args += ["--ro-bind", path, path]
    args += [
        "--ro-bind", str(etc_dir / "passwd"), "/etc/passwd",
        "--ro-bind", str(etc_dir / "group"), "/etc/group",
        "--proc", "/proc", "--dev", "/dev",
        "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp",
        "--bind", str(workdir), inside_workdir, "--chdir", inside_workdir,
        "--", *limited_shell(limits), command,
    ]
    return args
