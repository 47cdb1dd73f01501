"""One sandbox per trajectory: its own writable copy of the task's repository and a
runtime that runs the model's commands there and nowhere else. Torch-free.

Backends (:func:`backend_name`): a SIF image runs under Apptainer, an OCI image under
podman or docker, and without an image under bubblewrap (``bwrap``; the tested one, see
:mod:`mlperf_grpo.sandbox.bwrap` for what a command can see). Every command is its own
process tree (no shell state carries over between commands but the files); it ends with
the command under bubblewrap (its own pid namespace) and Apptainer (``--containall --pid``):
a ``sleep 1000 &`` dies when its command returns. A podman/docker container outlives its
commands, and so does what they leave running: :meth:`Sandbox.quiesce` kills it (grading
calls it first).

Host code must not open paths under :attr:`Sandbox.workdir` directly once the model has
run commands: the model may have planted symbolic links there that point at host files.
Use :meth:`Sandbox.write_file` / :meth:`Sandbox.read_file`, which act inside the sandbox.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import random
import shutil
import sys
import tarfile
import tempfile
import threading
import uuid
from functools import lru_cache
from pathlib import Path

from mlperf_grpo.errors import ConfigError
from mlperf_grpo.sandbox import bwrap, containers, leftovers, seccomp
from mlperf_grpo.sandbox.limits import MAX_COMMAND_BYTES, CommandResult, SandboxLimits
from mlperf_grpo.sandbox.process import RunningCommand, data_fd, run_command, wait_gone

INSIDE_WORKDIR = "/testbed"
"""Where the repository copy appears inside the sandbox (R2E-Gym's and SWE-bench's images' place)."""
BWRAP_INSTALL = "install bubblewrap (Debian/Ubuntu: apt-get install -y bubblewrap)"
QUIESCE_TIMEOUT_S = 60.0  # quiesce(): the runtime's exec plus the script's at most ~5 s of polling
CLOSE_WAIT_S = 30.0  # close(): how long killed commands may take to be gone before the folder goes
SANDBOX_UID_BASE, SANDBOX_UID_SPAN = 2_000_000_000, 100_000_000
"""Host uids of root runs' sandboxes: one drawn at random from this range per sandbox (no
account has them; 64 sandboxes at once collide with probability 2e-5, and a collision
only merges two sandboxes' process limits)."""


def sandbox_uid() -> int | None:
    """The host uid a new bwrap sandbox runs its commands as: a fresh one when this process
    is root (see :mod:`mlperf_grpo.sandbox.bwrap`), None (a user namespace) otherwise."""
    if os.geteuid() != 0:
        return None
    return SANDBOX_UID_BASE + random.SystemRandom().randrange(SANDBOX_UID_SPAN)


def give_to(folder: Path, uid: int) -> None:
    """Make ``folder`` and everything in it belong to ``uid`` (links themselves, not their targets)."""
    os.lchown(folder, uid, uid)
    for parent, dirs, files in os.walk(folder):
        for name in dirs + files:
            os.lchown(os.path.join(parent, name), uid, uid)


@lru_cache(maxsize=None)
def _bwrap_problem() -> str:
    """"" if ``bwrap`` makes a sandbox and runs a command in it here, else why not."""
    path = shutil.which("bwrap")
    if path is None:
        return f"bwrap is not installed: {BWRAP_INSTALL}"
    with tempfile.TemporaryDirectory() as tmp:
        etc = Path(tmp)
        bwrap.write_identity(etc)
        layout = bwrap.BwrapLayout(path, etc, "/probe", etc, run_as=sandbox_uid())
        argv = bwrap.bwrap_argv(layout, SandboxLimits(), "true")
        result = run_command(argv, SandboxLimits(), timeout_s=30)
    if result.exit_code == 0:
        return ""
    why = result.output.strip().replace("\n", " ")[:200]
    if os.geteuid() == 0:
        return (f"bwrap cannot make a sandbox here ({why}); as root it needs CAP_SYS_ADMIN and namespaces "
                "(a VM or a privileged container)")
    return (f"bwrap cannot make a sandbox here ({why}); it needs user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0)")


def backend_name(image: str | None = None) -> str:
    """The runtime that runs sandboxes for ``image`` (None: no image): "apptainer" for a
    SIF file, "podman" or "docker" for an OCI image, "bwrap" without one.

    Raises ConfigError (one line: what to install) when none is usable.
    """
    if image is None:
        problem = _bwrap_problem()
        if problem:
            raise ConfigError(f"sandbox: {problem}")
        return "bwrap"
    if containers.is_sif(image):
        binary = containers.apptainer_binary()
        if binary is None:
            raise ConfigError(f"sandbox: image {image} is a SIF image: install Apptainer (or Singularity)")
        return Path(binary).name
    binary = containers.oci_binary()
    if binary is None:
        raise ConfigError(f"sandbox: image {image} is an OCI image: install podman or docker (with its service running)")
    return Path(binary).name


def hidden_inside(ro_paths: list[Path]) -> list[Path]:
    """This project's package folder where it lies inside ``ro_paths`` (a non-editable
    install into the run's environment): shown empty, so the model cannot read the
    grader, the task suites or their fixes."""
    package = Path(os.path.dirname(os.path.abspath(__file__))).parent
    return [package] if any(package.is_relative_to(path) for path in ro_paths) else []


def python_roots() -> list[Path]:
    """The running Python's environment and installation (read-only in a bwrap sandbox, so
    its ``python`` and test packages run there), leaving out those under ``/usr``."""
    roots = []
    for prefix in (sys.prefix, sys.base_prefix):
        path = Path(prefix)
        if path.is_dir() and not Path(os.path.realpath(path)).is_relative_to("/usr"):
            roots.append(path)
    return list(dict.fromkeys(roots))


_LIVE: "set[Sandbox]" = set()
"""Sandboxes not closed yet (held, so one dropped without close() is still closed at exit)."""


@atexit.register
def close_all() -> None:
    """Close every sandbox of this process (at exit; the CLI's SIGTERM path unwinds through
    ``with Sandbox(...)`` blocks first)."""
    for sandbox in list(_LIVE):
        if sandbox.owner_pid == os.getpid():  # not in a forked child: the sandboxes are its parent's
            sandbox.close()


class Sandbox:
    """A trajectory's sandbox; use as a context manager or call :meth:`close`.

    repo: the task's repository, copied (links kept as links) to :attr:`workdir`; None with
        an image copies the image's ``/testbed`` out instead.
    limits: per-command limits. root: folder under which the sandbox's folder is made.
    image: SIF path or OCI image name; None runs under bubblewrap.
    ro_paths: host folders visible read-only under bubblewrap (default: :func:`python_roots`).

    Raises ConfigError (one line) for a ``root`` that cannot be a folder (a file) or is not
    safe (:func:`~mlperf_grpo.sandbox.leftovers.root_problem`), a missing ``repo``, no runtime.
    """

    def __init__(self, repo: Path | None, limits: SandboxLimits, root: Path, image: str | None = None,
                 ro_paths: list[Path] | None = None) -> None:
        self.limits, self.image = limits, image
        self.backend = backend_name(image)
        self.inside_workdir = INSIDE_WORKDIR
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._running: set[RunningCommand] = set()
        self._closed = False
        self._container: str | None = None
        self._uid: int | None = None
        self.owner_pid = os.getpid()
        root = Path(root).resolve()
        self._ro_paths = _checked_ro_paths(python_roots() if ro_paths is None else ro_paths, root)
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            problem = leftovers.root_problem(root)
        except OSError as error:  # a file there or above it, a folder this user cannot write
            problem = f"it cannot be made a folder ({error.strerror})"
        if problem:
            raise ConfigError(f"sandbox: cannot make sandboxes in {root}: {problem}; give a folder of your own "
                              "(agent.sandbox_root)")
        self.folder = Path(tempfile.mkdtemp(prefix=f"{leftovers.PREFIX}{os.getpid()}-", dir=root))
        leftovers.write_marker(self.folder)
        _LIVE.add(self)
        try:
            self.workdir = self.folder / "testbed"
            self._populate(repo)
            self._start()
        except BaseException:
            self.close()
            raise

    def _populate(self, repo: Path | None) -> None:
        if repo is not None:
            if not Path(repo).is_dir():
                raise ConfigError(f"sandbox: repository {repo} is not a folder")
            shutil.copytree(repo, self.workdir, symlinks=True)
        elif self.image is None:
            raise ConfigError("sandbox: give a repository folder or an image that holds /testbed")
        else:
            self.workdir.mkdir()
            self._copy_out_of_image()

    def _copy_out_of_image(self) -> None:
        binary = shutil.which(self.backend)
        if self.backend in ("apptainer", "singularity"):
            argv = containers.apptainer_copy_out_argv(binary, self.image, INSIDE_WORKDIR, self.workdir)
            result = run_command(argv, self.limits, timeout_s=600, env=dict(os.environ))
        else:
            name = f"mlperf-grpo-copy-{uuid.uuid4().hex[:12]}"
            created = run_command([binary, "create", "--name", name, self.image], self.limits, 600, env=dict(os.environ))
            result = created if created.exit_code else run_command(
                containers.oci_copy_out_argv(binary, name, INSIDE_WORKDIR, self.workdir), self.limits, 600,
                env=dict(os.environ))
            run_command(containers.oci_remove_argv(binary, name), self.limits, 60, env=dict(os.environ))
        if result.exit_code != 0:
            raise ConfigError(f"sandbox: cannot copy {INSIDE_WORKDIR} out of image {self.image}: {result.output.strip()[:300]}")

    def _start(self) -> None:
        if self.backend == "bwrap":
            self._uid = sandbox_uid()
            if self._uid is not None:
                give_to(self.workdir, self._uid)
            bwrap.write_identity(self.folder / "etc", bwrap.INSIDE_UID if self._uid is None else self._uid)
        elif self.backend in ("podman", "docker"):
            name = f"mlperf-grpo-{self.folder.name}"
            leftovers.write_marker(self.folder, container=name, runtime=shutil.which(self.backend))
            argv = containers.oci_start_argv(shutil.which(self.backend), self.image, name, self.workdir,
                                             INSIDE_WORKDIR, self.limits)
            result = run_command(argv, self.limits, timeout_s=600, env=dict(os.environ))
            if result.exit_code != 0:
                raise ConfigError(f"sandbox: cannot start image {self.image}: {result.output.strip()[:300]}")
            self._container = name

    def _argv(self, command: str, timeout_s: float, info_fd: int = -1,
              seccomp_fd: int = -1) -> tuple[list[str], dict[str, str], int]:
        """The command's argv, environment and the descriptor of bwrap's options (``--args``:
        off the command line, which the sandbox reads as ``/proc/1/cmdline``; -1 for the
        other runtimes), which the caller passes and closes."""
        binary = shutil.which(self.backend)
        if self.backend == "bwrap":
            layout = bwrap.BwrapLayout(binary, self.workdir, INSIDE_WORKDIR, self.folder / "etc",
                                       tuple(self._ro_paths), tuple(hidden_inside(self._ro_paths)), self._uid)
            options = (["--info-fd", str(info_fd)] + (["--seccomp", str(seccomp_fd)] if seccomp_fd >= 0 else [])
                       + bwrap.bwrap_options(layout, self.limits))
            args_fd = data_fd("sandbox-bwrap-args", b"".join(o.encode("utf-8", "surrogateescape") + b"\0"
                                                              for o in options))
            argv = [binary, "--args", str(args_fd), "--", *bwrap.inside_argv(layout, self.limits, command)]
            setpriv = shutil.which("setpriv")
            if setpriv:  # armed before bwrap starts: --die-with-parent is armed only once bwrap runs
                argv = [setpriv, "--pdeathsig", "KILL", "--", *argv]
            return argv, {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, args_fd
        if self.backend in ("apptainer", "singularity"):
            return containers.apptainer_argv(binary, self.image, self.workdir, INSIDE_WORKDIR, self.limits,
                                             command), dict(os.environ), -1
        return containers.oci_exec_argv(binary, self._container, INSIDE_WORKDIR, self.limits, command,
                                        timeout_s), dict(os.environ), -1

    def run(self, command: str, timeout_s: float | None = None, input_bytes: bytes = b"") -> CommandResult:
        """Run ``command`` with ``bash -c`` in :attr:`inside_workdir` (``input_bytes`` on its
        stdin). timeout_s: None for ``limits.command_timeout_s``. After :meth:`close`, or
        when closed meanwhile: exit_code None, kill_reason "closed".

        Raises:
            ValueError: ``command`` is longer than :data:`MAX_COMMAND_BYTES` (no command line
                carries it; pass long input as ``input_bytes``).
        """
        size = len(command.encode("utf-8", "surrogateescape"))
        if size > MAX_COMMAND_BYTES:
            raise ValueError(f"sandbox: a command of {size} bytes is over the {MAX_COMMAND_BYTES} a command line "
                             "carries; pass long input on stdin (input_bytes)")
        timeout = self.limits.command_timeout_s if timeout_s is None else float(timeout_s)
        info_read, info_write = os.pipe() if self.backend == "bwrap" else (-1, -1)
        filter_fd = seccomp.filter_fd() if self.backend == "bwrap" else -1
        args_fd = -1
        try:
            with self._lock:
                if self._closed:
                    return CommandResult(None, "", False, False, "closed")
                argv, env, args_fd = self._argv(command, timeout, info_write, filter_fd)
                running = RunningCommand(argv, self.limits, input_bytes, env,
                                         pass_fds=tuple(fd for fd in (info_write, filter_fd, args_fd) if fd >= 0),
                                         disk_path=str(self.folder.parent))
                self._running.add(running)
            for fd in (info_write, filter_fd, args_fd):
                if fd >= 0:
                    os.close(fd)
            info_write = filter_fd = args_fd = -1
            try:
                return running.finish(timeout)
            finally:
                if info_read >= 0:
                    _await_namespace_end(info_read)
                with self._lock:
                    self._running.discard(running)
                    self._idle.notify_all()
        finally:
            for fd in (info_read, info_write, filter_fd, args_fd):
                if fd >= 0:
                    os.close(fd)

    def write_file(self, path: str, data: bytes) -> CommandResult:
        """Write ``data`` to ``path`` (inside; relative to :attr:`inside_workdir`), making its
        folders: done inside the sandbox, so links the model planted resolve there."""
        quoted = _shell_quote(path)
        return self.run(f"mkdir -p -- \"$(dirname -- {quoted})\" && cat > {quoted}", input_bytes=data)

    def copy_in(self, source: Path, inside: str) -> CommandResult:
        """Copy the host file or folder ``source`` (trusted input: a task's hidden tests) into
        the folder ``inside`` (relative to :attr:`inside_workdir`; made if missing): a folder's
        contents, or the file under its own name. Unpacked by ``tar`` inside the sandbox,
        so links the model planted resolve there."""
        source = Path(source)
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            if source.is_dir():
                for child in sorted(source.iterdir()):
                    tar.add(child, arcname=child.name)
            else:
                tar.add(source, arcname=source.name)
        quoted = _shell_quote(inside)
        return self.run(f"mkdir -p -- {quoted} && tar -x -f - -C {quoted}", input_bytes=buffer.getvalue())

    def read_file(self, path: str) -> CommandResult:
        """``path``'s contents (inside; at most ``limits.output_bytes``), read inside the sandbox."""
        return self.run(f"cat -- {_shell_quote(path)}")

    def quiesce(self) -> str:
        """Kill every process the agent's commands left running and wait until none is left,
        so that what runs next (grading) starts from a quiet sandbox. "" when quiet, else one
        line saying why it cannot be confirmed. Nothing survives a command under bubblewrap
        or Apptainer (own pid namespace per command; run() returns once bwrap's is gone):
        "" at once. A podman/docker container runs :func:`~mlperf_grpo.sandbox.containers.oci_quiesce_argv`."""
        with self._lock:
            if self._closed:
                return "the sandbox is closed"
            if self._running:
                return f"{len(self._running)} command(s) still running"
        if self._container is None:
            return ""
        argv = containers.oci_quiesce_argv(shutil.which(self.backend), self._container)
        result = run_command(argv, self.limits, timeout_s=QUIESCE_TIMEOUT_S, env=dict(os.environ))
        if result.exit_code == 0 and result.output.strip() == "quiet":
            return ""
        said = " ".join(result.output.split())[:200] or f"exit {result.exit_code}"
        return f"{self.backend} exec could not kill every process of container {self._container} ({said})"

    def close(self) -> None:
        """Kill every command still running, remove the container (if any) and the
        sandbox's folder. Idempotent; safe from another thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            running = list(self._running)
        for command in running:
            command.kill("closed")
        with self._lock:  # their run() calls return once the processes and namespaces are gone
            self._idle.wait_for(lambda: not self._running, timeout=CLOSE_WAIT_S)
        if self._container is not None:
            run_command(containers.oci_remove_argv(shutil.which(self.backend), self._container), self.limits,
                        timeout_s=120, env=dict(os.environ))
        leftovers.remove_sandbox(self.folder)
        _LIVE.discard(self)

    @property
    def closed(self) -> bool:
        """close() has been called."""
        return self._closed

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _await_namespace_end(info_fd: int) -> None:
    """Return once the command's pid namespace is gone. bwrap exits as soon as the command
    does, while the kernel is still killing the namespace's other processes (a ``sleep &``);
    its init (``child-pid`` on bwrap's ``--info-fd``) exits only after all of them."""
    data = b""
    while chunk := os.read(info_fd, 4096):
        data += chunk
    try:
        pid = int(json.loads(data.decode())["child-pid"])
    except (ValueError, KeyError):
        return  # bwrap failed before starting a namespace
    wait_gone(pid, None, timeout_s=10.0)


def _shell_quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def _checked_ro_paths(paths: list[Path], root: Path) -> list[Path]:
    """Refuse a read-only path that would show the sandboxes' root (or ``/``) to the command."""
    checked = []
    for path in paths:
        real = Path(os.path.realpath(path))
        if real == Path("/") or root.is_relative_to(real):
            raise ConfigError(f"sandbox: read-only path {path} contains the sandbox root {root}; "
                              "use a Python environment outside it")
        checked.append(Path(path))
    return checked
