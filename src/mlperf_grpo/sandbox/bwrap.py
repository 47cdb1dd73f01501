"""The bubblewrap (``bwrap``) command line of one sandboxed command. Torch-free.

What the command sees (everything else of the host is absent, not just read-only):
``/usr`` (and the ``/bin``, ``/lib``, ... links or binds of the host), the Python
installations named in ``ro_paths`` (read-only: the interpreter and packages the tests
use), a generated ``/etc/passwd`` and ``/etc/group`` and a few read-only ``/etc`` files
the loader and locale need, a new ``/proc`` (its own pid namespace), a minimal ``/dev``,
a private size-limited tmpfs ``/tmp`` (and ``/dev/shm``, for POSIX semaphores:
``multiprocessing``), and its repository copy read-write at
``/testbed``; nothing else is writable (the root is remounted read-only).
Namespaces: pid, network (no interface but loopback: no connection leaves it, nothing on
the host's loopback is reachable), ipc, uts, cgroup, mount. ``--die-with-parent`` and
the pid namespace end every process of the sandbox when its ``bwrap`` is killed;
``--new-session`` keeps it off the caller's terminal.

Whose processes: ``RLIMIT_NPROC`` (the process limit) is not enforced for host uid 0,
whatever the namespace. So when the run is root, ``bwrap`` runs privileged (no user
namespace) and the command runs through ``setpriv`` as a host uid of its own
(``run_as``: unique per sandbox, so the limit counts that sandbox's processes alone),
with no capabilities (an empty bounding set too) and ``no_new_privs`` (set-uid programs do not elevate). When the
run is not root, ``bwrap`` makes a user namespace (uid 1000 inside, no capabilities);
the limit then counts per namespace, i.e. per sandbox.
Source of the flags: bubblewrap(1), bubblewrap 0.8.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
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


def write_identity(folder: Path, uid: int = INSIDE_UID) -> tuple[Path, Path]:
    """A passwd and group file naming the sandbox user ``uid`` (the host's are not shown)."""
    folder.mkdir(parents=True, exist_ok=True)
    passwd, group = folder / "passwd", folder / "group"
    passwd.write_text(f"root:x:0:0:root:/root:/bin/bash\nsandbox:x:{uid}:{uid}::/tmp:/bin/bash\n"
                      "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
    group.write_text(f"root:x:0:\nsandbox:x:{uid}:\nnogroup:x:65534:\n")
    return passwd, group


@dataclass(frozen=True)
class BwrapLayout:
    """What one sandbox's bwrap shows and as whom it runs.

    bwrap: the binary. workdir: the host copy, bound read-write at ``inside_workdir``.
    etc_dir: holds the generated ``passwd`` and ``group``. ro_paths: host folders bound
    read-only at the same path (Python installations). hidden: folders inside ``ro_paths``
    shown empty (this project's own package, when installed into that environment).
    run_as: None runs in a user namespace as uid 1000 (a non-root run); a host uid runs
    ``bwrap`` privileged and the command as that uid (a root run; see the module doc).
    """

    bwrap: str
    workdir: Path
    inside_workdir: str
    etc_dir: Path
    ro_paths: tuple[Path, ...] = ()
    hidden: tuple[Path, ...] = ()
    run_as: int | None = None


def bwrap_argv(layout: BwrapLayout, limits: SandboxLimits, command: str) -> list[str]:
    """The full argv: ``bwrap`` :func:`bwrap_options` ``--`` :func:`inside_argv`."""
    return [layout.bwrap, *bwrap_options(layout, limits), "--", *inside_argv(layout, limits, command)]


def inside_argv(layout: BwrapLayout, limits: SandboxLimits, command: str) -> list[str]:
    """What bwrap runs: ``bash -c <limits> <command>``, behind ``setpriv`` dropping to
    ``layout.run_as`` on a root run."""
    if layout.run_as is None:
        return [*limited_shell(limits), command]
    return ["setpriv", f"--reuid={layout.run_as}", f"--regid={layout.run_as}", "--clear-groups", "--no-new-privs",
            "--inh-caps=-all", "--bounding-set=-all", "--", *limited_shell(limits), command]


def bwrap_options(layout: BwrapLayout, limits: SandboxLimits) -> list[str]:
    """bwrap's options: namespaces, identity, mounts and environment. The command's
    environment is cleared to PATH, HOME=/tmp, LANG, TMPDIR, and the first ``ro_paths``
    entry's ``bin`` leads PATH (the run's Python environment). They name host paths: the
    sandbox gives them to bwrap through ``--args FD``, off its command line, which the
    sandbox's processes read as ``/proc/1/cmdline``."""
    ro_paths = layout.ro_paths
    path_dirs = [str(Path(p) / "bin") for p in ro_paths] + ["/usr/local/bin", "/usr/bin", "/bin"]
    if layout.run_as is None:
        identity = ["--unshare-user", "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID), "--disable-userns",
                    "--cap-drop", "ALL"]
    else:
        identity = ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                    "--cap-add", "CAP_SETPCAP"]  # without it setpriv skips --bounding-set=-all silently
    args = [
        *identity,
        "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--hostname", "sandbox", "--die-with-parent", "--new-session", "--clearenv",
        "--setenv", "PATH", ":".join(dict.fromkeys(path_dirs)), "--setenv", "HOME", "/tmp",
        "--setenv", "LANG", "C.UTF-8", "--setenv", "TMPDIR", "/tmp",
        "--perms", "0755", "--dir", "/etc",  # bwrap makes it 0700 when privileged: passwd, hosts unreadable
        *system_args(),
        "--ro-bind", str(layout.etc_dir / "passwd"), "/etc/passwd",
        "--ro-bind", str(layout.etc_dir / "group"), "/etc/group",
        "--proc", "/proc", "--dev", "/dev",
        "--perms", "01777", "--size", str(limits.tmp_bytes), "--tmpfs", "/dev/shm",  # POSIX semaphores
        "--perms", "01777", "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp",
    ]
    # after the tmpfs mounts: a Python installation under /tmp (a checkout there) stays visible
    for path in dict.fromkeys(str(Path(p)) for p in ro_paths):
        for parent in reversed(Path(path).parents[:-1]):  # traversable by the sandbox's uid
            if str(parent) not in ("/tmp", "/dev/shm"):  # mount points: keep their own modes
                args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", path, path]
    for path in layout.hidden:
        args += ["--size", "4096", "--tmpfs", str(path)]
    return args + ["--bind", str(layout.workdir), layout.inside_workdir, "--remount-ro", "/", "--remount-ro", "/dev",
                   "--chdir", layout.inside_workdir]

