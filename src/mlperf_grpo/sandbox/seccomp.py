"""The seccomp filter of bwrap sandboxes: no new user namespaces. Torch-free.

A command that may create a user namespace gets every capability inside it (mounts,
network set-up, ...): the kernel's largest attack surface from an unprivileged process,
and the one Docker's default profile closes too. bubblewrap's ``--disable-userns`` does
this only when bwrap itself makes a user namespace (a non-root run); a root run's bwrap
does not, so this filter refuses ``unshare``/``clone`` with ``CLONE_NEWUSER`` (EPERM) and
``clone3``, whose flags a filter cannot read (ENOSYS: the C library falls back to
``clone``), and refuses the 32-bit and x32 system-call entries outright (EPERM), which
would bypass the checks. x86-64 hosts only (:func:`filter_program` returns None
elsewhere: the sandbox then runs without it).

Format: classic BPF ``struct sock_filter`` records (``code:u16 jt:u8 jf:u8 k:u32``) over
``struct seccomp_data`` (``nr`` at offset 0, ``arch`` at 4, ``args[i]`` at 16 + 8 i), as
bubblewrap's ``--seccomp FD`` reads them (seccomp(2), linux/filter.h, linux/seccomp.h).
"""

from __future__ import annotations

import os
import platform
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
NR_CLONE, NR_UNSHARE, NR_CLONE3 = 56, 272, 435  # x86-64 system call numbers
CLONE_NEWUSER = 0x10000000
EPERM, ENOSYS = 1, 38
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def filter_program() -> bytes | None:
    """The filter as bytes for ``bwrap --seccomp``; None on a host that is not x86-64."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    return b"".join([
        _op(LD_W_ABS, 4),                                  # 0: arch
        _op(JEQ_K, AUDIT_ARCH_X86_64, jt=1, jf=0),         # 1: x86-64 -> 3
        _op(RET_K, RET_ERRNO | EPERM),                     # 2: i386 entry: refused
        _op(LD_W_ABS, 0),                                  # 3: nr
        _op(JGE_K, X32_SYSCALL_BIT, jt=8, jf=0),           # 4: x32 entry -> 13 (refused)
        _op(JEQ_K, NR_UNSHARE, jt=4, jf=0),                # 5: unshare -> 10
        _op(JEQ_K, NR_CLONE, jt=3, jf=0),                  # 6: clone -> 10
        _op(JEQ_K, NR_CLONE3, jt=1, jf=0),                 # 7: clone3 -> 9
        _op(RET_K, RET_ALLOW),                             # 8
        _op(RET_K, RET_ERRNO | ENOSYS),                    # 9: clone3: use clone
        _op(LD_W_ABS, 16),                                 # 10: args[0], low 32 bits (the flags)
        _op(JSET_K, CLONE_NEWUSER, jt=1, jf=0),            # 11: a new user namespace -> 13
        _op(RET_K, RET_ALLOW),                             # 12
        _op(RET_K, RET_ERRNO | EPERM),                     # 13
    ])


def filter_fd() -> int:
    """A fresh readable descriptor holding :func:`filter_program` (bwrap reads it to the
    end, so one per command); -1 where there is no filter. The caller closes it."""
    program = filter_program()
    if program is None:
        return -1
    fd = os.memfd_create("sandbox-seccomp", os.MFD_CLOEXEC)
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
