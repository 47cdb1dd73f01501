"""Container runtimes for task images: Apptainer/Singularity for SIF files, podman or
docker for OCI images. Command lines only; :mod:`mlperf_grpo.sandbox.sandbox` runs them.
Torch-free.

Apptainer runs each command as its own ``apptainer exec`` (the way NeMo Gym's SWE agents
run R2E-Gym SIF images: ``--writable-tmpfs``, no home/tmp/bind-path mounts) with
``--containall`` (own pid and ipc namespaces, clean environment, no host home), no network
(``--net --network none``: root, or a site that allows it) and the trajectory's repository
copy bound read-write at its place in the image (``/testbed``): the copy persists between
commands, the rest of the image's writable overlay does not.

podman/docker keep one container per trajectory (``run -d ... sleep infinity``, as
R2E-Gym's docker runtime does), run each command with ``exec`` under ``timeout -s KILL``
inside, and ``rm -f`` it on close; no network, all capabilities dropped,
``no-new-privileges``, ``--pids-limit`` and ``--memory`` for the container. A process a
command leaves in the background (``nohup``, ``setsid``, a double fork) outlives it there:
grading first kills every process but the container's PID 1 (:func:`oci_quiesce_argv`).

Not exercised where these runtimes are absent (our CI has none): the tests build the
command lines and check them; bubblewrap is the tested backend.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from mlperf_grpo.sandbox.limits import SandboxLimits, limited_shell

SIF_SUFFIXES = (".sif", ".simg")


def is_sif(image: str) -> bool:
    """A Singularity/Apptainer image file (by name), as opposed to an OCI image reference."""
    return image.endswith(SIF_SUFFIXES) or image.startswith(("docker-archive:", "oras://", "library://"))


def apptainer_binary() -> str | None:
    """``apptainer`` or ``singularity`` on PATH."""
    return shutil.which("apptainer") or shutil.which("singularity")


def oci_binary() -> str | None:
    """``podman`` or ``docker`` on PATH whose service answers (``docker info`` succeeds)."""
    for name in ("podman", "docker"):
        path = shutil.which(name)
        if path and subprocess.run([path, "info"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   timeout=30, check=False).returncode == 0:
            return path
    return None


def apptainer_argv(binary: str, image: str, workdir: Path, inside_workdir: str,
                   limits: SandboxLimits, command: str) -> list[str]:
    """One command in a SIF image, the repository copy bound at ``inside_workdir``."""
    return [
        binary, "exec", "--writable-tmpfs", "--cleanenv", "--containall", "--pid", "--ipc",
        "--no-mount", "home,tmp,bind-paths", "--net", "--network", "none",
        "--bind", f"{workdir}:{inside_workdir}", "--pwd", inside_workdir,
        image, *limited_shell(limits), command,
    ]


def apptainer_copy_out_argv(binary: str, image: str, inside_workdir: str, target: Path) -> list[str]:
    """Copy the image's ``inside_workdir`` (the task's repository) into the host folder ``target``."""
    return [binary, "exec", "--containall", "--no-mount", "home,tmp,bind-paths",
            "--bind", f"{target}:/sandbox-copy-out", image,
            "cp", "-a", f"{inside_workdir}/.", "/sandbox-copy-out/"]


def oci_start_argv(binary: str, image: str, name: str, workdir: Path, inside_workdir: str,
                   limits: SandboxLimits) -> list[str]:
    """Start the trajectory's long-lived container (idle until ``exec``)."""
    return [
        binary, "run", "-d", "--rm", "--name", name, "--network", "none", "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges", "--pids-limit", str(limits.processes),
        "--memory", str(limits.memory_bytes), "--tmpfs", f"/tmp:size={limits.tmp_bytes}",
        "-v", f"{workdir}:{inside_workdir}", "-w", inside_workdir,
        "--entrypoint", "sleep", image, "infinity",
    ]


def oci_exec_argv(binary: str, name: str, inside_workdir: str, limits: SandboxLimits,
                  command: str, timeout_s: float) -> list[str]:
    """One command in the running container, killed inside at ``timeout_s``."""
    return [binary, "exec", "-i", "-w", inside_workdir, name,
            "timeout", "-s", "KILL", f"{timeout_s:g}", *limited_shell(limits), command]


QUIESCE_ROUNDS = 50
"""Rounds of :data:`QUIESCE_SCRIPT` (a kill, a scan of ``/proc``, 0.1 s) before it gives up."""
QUIESCE_SCRIPT = f"""
kill -KILL -1 2>/dev/null
round=0
while :; do
  left=""
  for entry in /proc/[0-9]*; do
    pid=${{entry#/proc/}}
    [ "$pid" = 1 ] || [ "$pid" = $$ ] && continue
    live=""
    for task in "$entry"/task/[0-9]*; do
      state=""
      {{ while read -r key value rest; do [ "$key" = State: ] && state=$value && break; done < "$task/status"; }} 2>/dev/null
      case "$state" in ""|Z*|X*) ;; *) live=1;; esac
    done
    [ -n "$live" ] && left="$left $pid"
  done
  [ -z "$left" ] && echo quiet && exit 0
  round=$((round + 1))
  [ "$round" -ge {QUIESCE_ROUNDS} ] && echo "processes still running:$left" && exit 1
  kill -KILL -1 2>/dev/null
  sleep 0.1 2>/dev/null || sleep 1
done
"""
"""POSIX sh, builtins only while it scans: ``kill -KILL -1`` signals every process the caller
may signal but PID 1 (``sleep infinity``) and the caller itself (kill(2)); it repeats until
no process but those two is left (zombies, which PID 1 never reaps, run nothing and count
as gone, as does one gone before its ``status`` is read). A process runs while any of its
threads does: the ``State:`` line of each ``/proc/PID/task/TID/status`` (a group whose first
thread has exited reads as a zombie in ``/proc/PID/status`` while another thread runs),
whose ``Name:`` line escapes a newline (``stat``'s first line ends wherever a process puts
one in its name). Prints ``quiet`` and exits 0, or names the pids left and exits 1."""


def oci_quiesce_argv(binary: str, name: str) -> list[str]:
    """Kill every process of the running container but its PID 1 and wait until none is left
    (:data:`QUIESCE_SCRIPT`), as the container's user: the user the agent's commands ran as
    (``exec`` without ``--user``, like :func:`oci_exec_argv`)."""
    return [binary, "exec", name, "sh", "-c", QUIESCE_SCRIPT]


def oci_remove_argv(binary: str, name: str) -> list[str]:
    """Remove the container and every process in it."""
    return [binary, "rm", "-f", name]


def oci_copy_out_argv(binary: str, container: str, inside_workdir: str, target: Path) -> list[str]:
    """Copy ``inside_workdir`` of a created (not started) container into ``target``."""
    return [binary, "cp", f"{container}:{inside_workdir}/.", str(target)]
