"""A seccomp filter for engine processes, built with libseccomp (the distribution's `libseccomp.so.2`,
through ctypes): system calls that reach into other processes, the kernel or the sandbox itself fail
with EPERM; everything else an honest engine does (threads, forks, compilers, CUDA) is allowed.

libseccomp resolves each name to this machine's architecture and adds the architecture check, so no
syscall numbers are written here. The filter is compiled to BPF once per process (`program()`: the zygote
does it before it forks, ~5 ms) and `install()` loads that program with prctl; the caller has set
no_new_privs first (`evaluators.sandbox.jail`), and the filter holds for every process the engine starts afterwards.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os

# Reading or writing other processes, loading code into the kernel, changing the sandbox's own mounts,
# namespaces or clock, and kernel interfaces an engine never needs.
DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "kcmp", "pidfd_getfd",
    "perf_event_open", "bpf", "userfaultfd",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr", "unshare", "setns", "open_by_handle_at", "name_to_handle_at",
    "keyctl", "add_key", "request_key",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
    "swapon", "swapoff", "acct", "quotactl", "syslog", "settimeofday", "clock_settime", "clock_adjtime",
    "adjtimex", "iopl", "ioperm", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "personality", "vhangup", "lookup_dcookie",
)
# clone() flags that would make a new namespace (clone3 passes its flags in memory a filter cannot
# read: it answers ENOSYS, and the C library falls back to clone).
NAMESPACE_FLAGS = (0x00020000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x02000000)

_ACT_ALLOW = 0x7FFF0000
_CMP_MASKED_EQ = 7
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2


def _errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class SeccompUnavailable(RuntimeError):
    """libseccomp is missing or the kernel refused the filter."""


def library() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise SeccompUnavailable(f"libseccomp not found ({name}): install the distribution's libseccomp2, "
                                 "or set the evaluator's sandbox to 'none'") from exc
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def available() -> str:
    """"" when a filter can be built here, else why not."""
    try:
        library()
    except SeccompUnavailable as exc:
        return str(exc)
    return ""


def install() -> None:
    """Load the filter into this process (irreversible; inherited by every child). no_new_privs must be set."""
    code = program()
    buffer = ctypes.create_string_buffer(code, len(code))
    fprog = _SockFprog(len(code) // 8, ctypes.addressof(buffer))  # 8 bytes per BPF instruction
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise SeccompUnavailable(f"seccomp: loading the filter failed ({os.strerror(ctypes.get_errno())})")


@functools.lru_cache(maxsize=1)
def program() -> bytes:
    """The filter compiled to this architecture's BPF (libseccomp's export), built once per process."""
    lib = library()
    ctx = lib.seccomp_init(_ACT_ALLOW)
    if not ctx:
        raise SeccompUnavailable("seccomp_init failed")
    try:
        for name in DENIED:
            _deny(lib, ctx, name, _errno(errno.EPERM))
        _deny(lib, ctx, "clone3", _errno(errno.ENOSYS))
        clone = lib.seccomp_syscall_resolve_name(b"clone")
        for flag in NAMESPACE_FLAGS:
            cmp = (_ArgCmp * 1)(_ArgCmp(0, _CMP_MASKED_EQ, flag, flag))
            _check(lib.seccomp_rule_add_array(ctx, _errno(errno.EPERM), clone, 1, cmp), "clone flags")
        fd = os.memfd_create("seccomp-bpf")
        try:
            _check(lib.seccomp_export_bpf(ctx, fd), "seccomp_export_bpf")
            return os.pread(fd, 1 << 20, 0)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)


def _deny(lib: ctypes.CDLL, ctx: int, name: str, action: int) -> None:
    number = lib.seccomp_syscall_resolve_name(name.encode())
    if number < 0:  # not a system call on this architecture
        return
    _check(lib.seccomp_rule_add_array(ctx, action, number, 0, None), name)


def _check(rc: int, what: str) -> None:
    if rc < 0:
        raise SeccompUnavailable(f"seccomp: {what} failed ({errno.errorcode.get(-rc, -rc)})")
