"""The engine process's confinement, made with the kernel's own interfaces (no helper binary, so it
works where no package can be installed, and keeps the zygote's millisecond forks).

The zygote forks a holder, which joins nothing, unshares PID, mount, IPC, UTS (and network) namespaces
and forks the engine's process: PID 1 of its own namespace, so when it dies the kernel kills every
process it started, whatever they called. That process then, still as root and before any engine code:
1. joins the candidate's cgroups (`evaluators.sandbox.cgroups`);
2. replaces its root with an allow-list view (`evaluators.sandbox.view`): a fresh tmpfs root holding, read-only,
   only what an engine needs (the system's libraries, its Python and the distributions engines import,
   the project's engine-side packages less the hidden files), a fresh /proc (only its own processes) and
   private tmpfs on /tmp, /var/tmp and /dev/shm; the old root is detached, so nothing else exists there;
3. keeps only its channel's descriptor (stdin and stdout go to /dev/null);
4. drops to an unprivileged user with no groups, no capabilities (bounding set included) and
   no_new_privs, and loads the seccomp filter (`evaluators.sandbox.seccomp`).
`JailPlan` is what the judge decides; `enter_namespaces` runs in the holder, `confine` in the engine's process.
"""
from __future__ import annotations

import ctypes
import os
import platform
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from evaluators.sandbox import seccomp
from evaluators.sandbox.view import NOBODY, View, under

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = (
    0x00020000, 0x04000000, 0x08000000, 0x20000000, 0x40000000)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 8192, 16384, 1 << 18)
_PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 24, 38
_MNT_DETACH = 2
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}  # syscall numbers
_MOUNT_SETATTR = {"x86_64": 442, "aarch64": 442, "ppc64le": 442, "s390x": 442}
_AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1


@dataclass(frozen=True)
class JailPlan:
    """How one engine process is confined (JSON-able: it travels in the zygote's spawn request)."""

    cgroup_procs: tuple[str, ...] = ()  # files the process writes its pid into, to join its cgroups
    hidden: tuple[str, ...] = ()  # paths covered by an unreadable empty file or folder
    network: bool = False  # keep the host's network namespace
    cuda: bool = False  # the view adds the NVIDIA device nodes and PCI folders
    trusted: bool = False  # a baseline: the view adds the libraries baselines build on
    readable: tuple[str, ...] = ()  # files the workload's engines read (Workload.engine_files)
    cache: str = ""  # a baseline's: the machine's compile cache for baselines, bound read-write (view.baseline_cache)
    uid: int = NOBODY
    gid: int = NOBODY

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> JailPlan:
        return cls(**{**data, "cgroup_procs": tuple(data.get("cgroup_procs", ())),
                      "hidden": tuple(data.get("hidden", ())), "readable": tuple(data.get("readable", ()))})


class JailError(RuntimeError):
    """The kernel refused a step of the confinement (the engine must not run unconfined)."""


def unavailable() -> str:
    """"" when this process can build the jail, else why not (checked by the judge before it judges)."""
    if os.geteuid() != 0:
        return f"the judge runs as uid {os.geteuid()}: namespaces, mounts and the user switch need root"
    reason = seccomp.available()
    if reason:
        return reason
    for ns in ("pid", "mnt", "ipc", "uts", "net"):
        if not os.path.exists(f"/proc/self/ns/{ns}"):
            return f"this kernel has no {ns} namespaces"
    return ""


def enter_namespaces(plan: JailPlan) -> None:
    """In the holder: new namespaces for the process it forks next (its mount namespace that process
    makes itself: the holder keeps the machine's view, to remove the candidate's cgroups at the end)."""
    _libc_check(_libc().unshare(namespace_flags(plan)), "unshare")


def namespace_flags(plan: JailPlan) -> int:
    """The namespaces the holder unshares: PID, UTS and IPC always (on CUDA too: arenas travel as
    descriptors, so no candidate shares the judge's System V IPC or anyone's /dev/shm), network unless kept."""
    return CLONE_NEWPID | CLONE_NEWUTS | CLONE_NEWIPC | (0 if plan.network else CLONE_NEWNET)


view_in_force: View | None = None  # in an engine's process: the view its root was built from


def confine(plan: JailPlan, keep_fds: tuple[int, ...], view: View) -> None:
    """In the engine's process (PID 1 of its namespace), before any engine code: see the module doc."""
    global view_in_force
    for procs in plan.cgroup_procs:
        Path(procs).write_text("0")  # "0": the writing process itself
    _libc_check(_libc().unshare(CLONE_NEWNS), "unshare the mount namespace")
    _mounts(view)
    view_in_force = view
    _libc_check(_libc().sethostname(b"engine", 6), "sethostname")
    _descriptors(keep_fds)
    _drop_privileges(plan)
    seccomp.install()


def release(plan: JailPlan, pid: int) -> None:
    """End a candidate whose judge is gone (run by its holder, as root): kill every process of its
    cgroups and its first process, and thaw them, so the kills are delivered."""
    for procs in plan.cgroup_procs:
        try:
            pids = [int(p) for p in Path(procs).read_text().split()]
        except OSError:
            pids = []
        for member in pids:
            _kill(member)
    _kill(pid)
    for procs in plan.cgroup_procs:
        folder = Path(procs).parent
        for name, value in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
            try:
                (folder / name).write_text(value)
            except OSError:
                pass


def remove_groups(plan: JailPlan) -> None:
    """Remove the candidate's (emptied) cgroups, best effort."""
    for procs in plan.cgroup_procs:
        for _ in range(200):
            try:
                Path(procs).parent.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.005)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _mounts(view: View) -> None:
    """A new root holding only `view`: a tmpfs on a scratch base becomes the root (the old one stays
    reachable under /oldroot while the view is bound in from it), then the view's root replaces it and the
    old tree is detached, so nothing outside the view can be reached by any path."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    base = "/tmp"  # any folder: the tmpfs mounted on it becomes the root, uncovering it again
    _mount("tmpfs", base, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for folder in ("/newroot", "/oldroot"):
        os.mkdir(base + folder, 0o755)
    _pivot_root(base, base + "/oldroot")
    os.chdir("/")
    new = "/newroot"
    _mount("tmpfs", new, "tmpfs", MS_NOSUID, "mode=0755,size=1m")
    # What lies under a private folder (a checkout or venv in /tmp) is placed once its tmpfs is mounted.
    inside = lambda path: any(under(path, p) for p in view.private)  # noqa: E731
    _place(view, new, lambda path: not inside(path))
    for path in ("/proc", *view.private, *(inside_path for _, inside_path in view.writable)):
        os.makedirs(new + path, 0o755, exist_ok=True)
    _read_only_tree(new, [new + p for p in view.read_only if not inside(p)])
    for host, inside_path in view.writable:  # after the read-only pass: the one folder it may write (baselines)
        _mount("/oldroot" + host, new + inside_path, None, MS_BIND)
        _mount(None, new + inside_path, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)
    _mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for path in view.private:
        _mount("tmpfs", new + path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=50%")
    for path in _place(view, new, inside):
        _mount(None, new + path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _flags_of(new + path))
    empty_file, empty_dir = _empties(new + "/tmp/.evo-hidden")
    for path in view.hidden:
        if os.path.isdir(new + path):
            _mount(empty_dir, new + path, None, MS_BIND)
        elif os.path.lexists(new + path):
            _mount(empty_file, new + path, None, MS_BIND)
    os.chdir(new)
    _pivot_root(".", ".")  # the view's root on top of the scratch root, which is then detached
    _libc_check(_libc().umount2(b".", _MNT_DETACH), "detach the old root")
    os.chdir("/")


def _place(view: View, new: str, where: Callable[[str], bool]) -> list[str]:
    """Bind, link and write the view's entries for which `where(path)` holds under `new`; the bound paths."""
    bound = [path for path in view.read_only if where(path)]
    for path in bound:
        _bind("/oldroot" + path, new + path)
    for path, target in view.links:
        if where(path):
            _make_parents(new + path)
            os.symlink(target, new + path)
    for path, text in view.files:
        if where(path):
            _make_parents(new + path)
            with open(new + path, "w") as f:
                f.write(text)
            os.chmod(new + path, 0o644)
    return bound


def _read_only_tree(root: str, binds: list[str]) -> None:
    """Make `root` and every mount under it read-only: one mount_setattr (Linux 5.12+), else one remount
    per bind and one of the root."""
    attr = (ctypes.c_uint64 * 4)(_MOUNT_ATTR_RDONLY, 0, 0, 0)  # struct mount_attr: set, clear, propagation, userns
    number = _MOUNT_SETATTR.get(platform.machine())
    if number is not None and _libc().syscall(number, _AT_FDCWD, _b(root), _AT_RECURSIVE, attr, 32) == 0:
        return
    for target in binds:
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _flags_of(target))
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID)


def _bind(source: str, target: str) -> None:
    """Bind one file or folder (not its submounts) at `target`, made as a folder or an empty file."""
    _make_parents(target)
    if os.path.isdir(source):
        os.makedirs(target, 0o755, exist_ok=True)
    elif not os.path.lexists(target):
        open(target, "w").close()
    _mount(source, target, None, MS_BIND)


def _make_parents(path: str) -> None:
    os.makedirs(os.path.dirname(path), 0o755, exist_ok=True)


def _pivot_root(new_root: str, put_old: str) -> None:
    number = _PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise JailError(f"pivot_root: no syscall number known for {platform.machine()}; known: {sorted(_PIVOT_ROOT)}")
    _libc_check(_libc().syscall(number, _b(new_root), _b(put_old)), "pivot_root")


def _empties(base: str) -> tuple[str, str]:
    """An empty file and folder only root may read (root-owned, mode 000) under `base`."""
    os.makedirs(base + "/dir", mode=0o000, exist_ok=True)
    with open(base + "/file", "w"):
        pass
    for p in (base + "/file", base + "/dir", base):
        os.chmod(p, 0o000 if p != base else 0o711)
    return base + "/file", base + "/dir"


def _flags_of(target: str) -> int:
    """The nosuid/nodev/noexec flags a bind remount must keep (the kernel refuses to drop them)."""
    try:
        st = os.statvfs(target)
    except OSError:
        return 0
    flags = 0
    for bit, ours in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC)):
        if st.f_flag & bit:
            flags |= ours
    return flags


def _descriptors(keep_fds: tuple[int, ...]) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        if fd not in keep_fds:
            os.dup2(null, fd)
    os.close(null)
    start = 3
    for fd in sorted(keep_fds):
        if fd >= start:
            os.closerange(start, fd)
            start = fd + 1
    os.closerange(start, 1 << 16)


def _drop_privileges(plan: JailPlan) -> None:
    libc = _libc()
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for cap in range(last + 1):
        _libc_check(libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
    os.setgroups([])
    os.setresgid(plan.gid, plan.gid, plan.gid)
    os.setresuid(plan.uid, plan.uid, plan.uid)  # from root: permitted, effective and ambient sets cleared
    _libc_check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    os.chdir("/tmp")  # its environment (HOME, TMPDIR) comes from the judge's spec


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    rc = _libc().mount(_b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data))
    _libc_check(rc, f"mount {target}")


def _b(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def _libc_check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise JailError(f"{what}: {os.strerror(err)}")
