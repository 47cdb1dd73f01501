"""The seccomp filter of bwrap sandboxes: no new user namespaces, no kernel surface a
command never needs. Torch-free.

A command that may create a user namespace gets every capability inside it (mounts,
network set-up, ...): the kernel's largest attack surface from an unprivileged process,
and the one Docker's default profile closes too. bubblewrap's ``--disable-userns`` does
this only when bwrap itself makes a user namespace (a non-root run); a root run's bwrap
does not, so this filter refuses ``unshare``/``clone`` with ``CLONE_NEWUSER`` (EPERM) and
``clone3``, whose flags a filter cannot read (ENOSYS: the C library falls back to
``clone``), and refuses the 32-bit and x32 system-call entries outright (EPERM), which
would bypass the checks. It also refuses (EPERM) the calls of :data:`DENIED` and
``socket(AF_VSOCK, ...)`` (vsock is not network-namespaced: it reaches the host), and
``personality`` with any persona but :data:`PERSONALITY_ALLOWED` (Docker's rule: no
``ADDR_NO_RANDOMIZE``, so a command cannot turn address randomization off for what it
runs, nor the other flags that weaken a process: ``READ_IMPLIES_EXEC``, ...). x86-64
hosts only (:func:`filter_program` returns None elsewhere: the sandbox then runs without it).

bwrap installs the filter as the last step before it executes the command (bubblewrap.c,
``seccomp_programs_apply`` just before ``execvp``), so its own mounts are not filtered.

Format: classic BPF ``struct sock_filter`` records (``code:u16 jt:u8 jf:u8 k:u32``) over
``struct seccomp_data`` (``nr`` at offset 0, ``arch`` at 4, ``args[i]`` at 16 + 8 i), as
bubblewrap's ``--seccomp FD`` reads them (seccomp(2), linux/filter.h, linux/seccomp.h).
"""

from __future__ import annotations

import platform
import struct

from mlperf_grpo.sandbox.process import data_fd

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
NR_SOCKET, NR_CLONE, NR_UNSHARE, NR_CLONE3, NR_PERSONALITY = 41, 56, 272, 435, 135  # x86-64 system call numbers
CLONE_NEWUSER = 0x10000000
AF_VSOCK = 40
EPERM, ENOSYS = 1, 38
PERSONALITY_ALLOWED = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
"""The personas ``personality`` may set, as in Docker's default profile: ``PER_LINUX``,
``PER_LINUX32``, ``UNAME26``, both, and ``0xffffffff`` (a query: changes nothing). The
kernel reads the argument as ``unsigned int`` (kernel/exec_domain.c), so its low 32 bits
are what is compared."""
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000

DENIED = {
    # kernel keyrings, eBPF, perf, userfaultfd, io_uring: large attack surfaces of their own
    "add_key": 248, "request_key": 249, "keyctl": 250, "perf_event_open": 298, "bpf": 321, "userfaultfd": 323,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    # kernels and modules
    "init_module": 175, "delete_module": 176, "kexec_load": 246, "finit_module": 313, "kexec_file_load": 320,
    # mounts and namespaces (the sandbox's own are set up before the filter)
    "pivot_root": 155, "mount": 165, "umount2": 166, "setns": 308, "open_tree": 428, "move_mount": 429,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    # files by handle (the "shocker" escape), whole-system notification and accounting
    "open_by_handle_at": 304, "fanotify_init": 300, "acct": 163, "lookup_dcookie": 212,
    # the machine: swap, reboot, clock, raw I/O ports, kernel log, quotas, terminals, a.out
    "syslog": 103, "uselib": 134, "vhangup": 153, "settimeofday": 164, "swapon": 167, "swapoff": 168,
    "reboot": 169, "iopl": 172, "ioperm": 173, "quotactl": 179, "clock_settime": 227, "quotactl_fd": 443,
}
"""x86-64 system calls refused with EPERM: each one Docker's default seccomp profile refuses
to a container without capabilities (moby ``profiles/seccomp/default.json``: absent from
its allow list, or allowed only with a capability our commands never hold; io_uring since
moby 25), and none a coding agent's shell, git, Python or a repository's tests need.
Numbers: the kernel's ``arch/x86/entry/syscalls/syscall_64.tbl`` (``asm/unistd_64.h``).
Left allowed although Docker refuses them without a capability: ``ptrace`` and
``process_vm_*`` (Docker allows them on kernels from 4.8; debuggers), the NUMA calls
(``mbind``, ``*_mempolicy``: numerical libraries probe them), ``chroot``,
``sethostname`` (the sandbox has its own UTS namespace)."""


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def assemble(program: list) -> bytes:
    """Classic BPF bytes of ``program``: a list of label strings and ``(code, k)`` or
    ``(code, k, jt, jf)`` tuples whose jump targets are labels or 0 (the next record).

    Raises:
        ValueError: a jump further than 255 records or backwards (classic BPF jumps forward only).
    """
    labels, index = {}, 0
    for item in program:
        if isinstance(item, str):
            labels[item] = index
        else:
            index += 1
    records = []
    for item in (item for item in program if not isinstance(item, str)):
        code, k, *jumps = item
        here = len(records) + 1
        offsets = [0 if target == 0 else labels[target] - here for target in jumps]
        if any(not 0 <= offset <= 255 for offset in offsets):
            raise ValueError(f"seccomp: jump {offsets} of record {here - 1} is out of range")
        records.append(_op(code, k, *offsets))
    return b"".join(records)


def filter_program() -> bytes | None:
    """The filter as bytes for ``bwrap --seccomp``; None on a host that is not x86-64."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    return assemble([
        (LD_W_ABS, 4), (JEQ_K, AUDIT_ARCH_X86_64, 0, "refuse"),         # arch: an i386 entry is refused
        (LD_W_ABS, 0), (JGE_K, X32_SYSCALL_BIT, "refuse", 0),            # nr: an x32 entry is refused
        (JEQ_K, NR_UNSHARE, "flags", 0), (JEQ_K, NR_CLONE, "flags", 0),
        (JEQ_K, NR_CLONE3, "enosys", 0), (JEQ_K, NR_SOCKET, "family", 0), (JEQ_K, NR_PERSONALITY, "persona", 0),
        *[(JEQ_K, number, "refuse", 0) for number in sorted(DENIED.values())],
        (RET_K, RET_ALLOW),
        "enosys", (RET_K, RET_ERRNO | ENOSYS),                          # clone3: the C library uses clone
        "flags", (LD_W_ABS, 16), (JSET_K, CLONE_NEWUSER, "refuse", 0),  # args[0], low 32 bits
        (RET_K, RET_ALLOW),
        "family", (LD_W_ABS, 16), (JEQ_K, AF_VSOCK, "refuse", 0),      # socket's domain
        (RET_K, RET_ALLOW),
        "persona", (LD_W_ABS, 16),                                      # personality's persona, low 32 bits
        *[(JEQ_K, persona, "allow", 0) for persona in PERSONALITY_ALLOWED],
        "refuse", (RET_K, RET_ERRNO | EPERM),
        "allow", (RET_K, RET_ALLOW),
    ])


def filter_fd() -> int:
    """A fresh readable descriptor holding :func:`filter_program` (bwrap reads it to the
    end, so one per command); -1 where there is no filter. The caller closes it."""
    program = filter_program()
    if program is None:
        return -1
    return data_fd("sandbox-seccomp", program)
