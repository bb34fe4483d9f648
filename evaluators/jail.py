"""The engine process's confinement, made with the kernel's own interfaces (no helper binary, so it
works where no package can be installed, and keeps the zygote's millisecond forks).

The zygote forks a holder, which joins nothing, unshares PID, mount, IPC, UTS (and network) namespaces
and forks the engine's process: PID 1 of its own namespace, so when it dies the kernel kills every
process it started, whatever they called. That process then, still as root and before any engine code:
1. joins the candidate's cgroups (`evaluators.cgroups`);
2. makes its mounts private: a fresh /proc (only its own processes), private tmpfs on /tmp, /var/tmp
   and /dev/shm (CPU) (its Python and the project bound back in where they live there), folders it must walk through but may not (e.g. /root holding pyenv's Python)
   replaced by just the subtrees it needs, every other mount read-only, the hidden paths (the reference, the baselines, the
   judge's modules, the project's git objects) covered by an unreadable empty file or folder;
3. keeps only its channel's descriptor (stdin and stdout go to /dev/null);
4. drops to an unprivileged user with no groups, no capabilities (bounding set included) and
   no_new_privs, and loads the seccomp filter (`evaluators.seccomp`).
`JailPlan` is what the judge decides; `enter_namespaces` runs in the holder, `confine` in the engine's process.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from evaluators import seccomp

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = (
    0x00020000, 0x04000000, 0x08000000, 0x20000000, 0x40000000)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 8192, 16384, 1 << 18)
_PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 24, 38
NOBODY = 65534
_PRIVATE_TMP = ("/tmp", "/var/tmp")
_SKIP_READONLY = ("/proc", "/dev", "/sys/fs/cgroup")


@dataclass(frozen=True)
class JailPlan:
    """How one engine process is confined (JSON-able: it travels in the zygote's spawn request)."""

    cgroup_procs: tuple[str, ...] = ()  # files the process writes its pid into, to join its cgroups
    hidden: tuple[str, ...] = ()  # paths covered by an unreadable empty file or folder
    network: bool = False  # keep the host's network namespace
    private_shm: bool = True  # a private /dev/shm (CUDA IPC needs the shared one)
    ipc_namespace: bool = True
    uid: int = NOBODY
    gid: int = NOBODY

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> JailPlan:
        return cls(**{**data, "cgroup_procs": tuple(data.get("cgroup_procs", ())),
                      "hidden": tuple(data.get("hidden", ()))})


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
    """In the holder: new namespaces for the process it forks next."""
    flags = CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWUTS
    if plan.ipc_namespace:
        flags |= CLONE_NEWIPC
    if not plan.network:
        flags |= CLONE_NEWNET
    _libc_check(_libc().unshare(flags), "unshare")


def confine(plan: JailPlan, keep_fds: tuple[int, ...]) -> None:
    """In the engine's process (PID 1 of its namespace), before any engine code: see the module doc."""
    for procs in plan.cgroup_procs:
        Path(procs).write_text("0")  # "0": the writing process itself
    _mounts(plan)
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


def _mounts(plan: JailPlan) -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    private = [p for p in _PRIVATE_TMP if os.path.isdir(p)]
    if plan.private_shm and os.path.isdir("/dev/shm"):
        private.append("/dev/shm")
    needed = _needed_paths()
    # Needed paths under a folder about to get a private tmpfs (a checkout or venv in /tmp): held open
    # now, bound back in place once the tmpfs covers them (a bind from /proc/self/fd reaches the old tree).
    kept = [(path, os.open(path, os.O_PATH)) for path in _tops(needed)
            if any(path.startswith(folder + "/") for folder in private)]
    for path in private:
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=50%")
    for path, fd in kept:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(path, mode=0o755, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            open(path, "w").close()
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)
    _reachable(needed)
    for target in _mount_points():
        if target in private or target == "/proc" or target.startswith(_SKIP_READONLY):
            continue
        try:
            _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _flags_of(target))
        except JailError:
            pass  # a mount the kernel will not remount (e.g. already read-only with other flags)
    empty_file, empty_dir = _empties()
    for path in plan.hidden:
        if os.path.isdir(path):
            _mount(empty_dir, path, None, MS_BIND)
        elif os.path.exists(path):
            _mount(empty_file, path, None, MS_BIND)


def _needed_paths() -> list[str]:
    """What the engine's process must be able to open: its Python (prefixes, interpreter, every
    import path) and the project."""
    paths = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    paths |= {p for p in sys.path if p}
    paths.add(str(Path(__file__).resolve().parents[1]))
    return sorted(os.path.realpath(p) for p in paths if os.path.exists(p))


def _reachable(needed: list[str]) -> None:
    """The unprivileged user cannot walk through a folder without o+x (e.g. /root, where pyenv puts
    Python): cover each such folder with a tmpfs holding only the needed subtrees, bound back in place
    (so the rest of it, e.g. root's home and its keys, stays out of sight)."""
    blocked: dict[str, list[str]] = {}
    for path in needed:
        parts = Path(path).parts
        for depth in range(2, len(parts) + 1):
            ancestor = str(Path(*parts[:depth - 1]))
            if ancestor != "/" and not os.stat(ancestor).st_mode & 0o001:
                blocked.setdefault(ancestor, []).append(path)
                break
    for ancestor, paths in blocked.items():
        tops = _tops(paths)
        stages = []
        for i, path in enumerate(tops):
            stage = f"/tmp/.evo-stage/{len(stages)}-{i}"
            os.makedirs(stage, exist_ok=True)
            if os.path.isfile(path):
                stage += ".file"
                open(stage, "w").close()
            _mount(path, stage, None, MS_BIND | MS_REC)
            stages.append((stage, path))
        _mount("tmpfs", ancestor, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
        for stage, path in stages:
            if os.path.isfile(stage):
                os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
                open(path, "w").close()
            else:
                os.makedirs(path, mode=0o755, exist_ok=True)
            _mount(stage, path, None, MS_MOVE)


def _tops(paths: list[str]) -> list[str]:
    """The paths not inside another of them."""
    return [p for p in sorted(set(paths)) if not any(p != q and p.startswith(q + "/") for q in paths)]


def _empties() -> tuple[str, str]:
    """An empty file and folder only root may read (in the private /tmp, root-owned, mode 000)."""
    base = "/tmp/.evo-hidden"
    os.makedirs(base + "/dir", mode=0o000, exist_ok=True)
    with open(base + "/file", "w"):
        pass
    for p in (base + "/file", base + "/dir", base):
        os.chmod(p, 0o000 if p != base else 0o711)
    return base + "/file", base + "/dir"


def _mount_points() -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        target = line.split()[4].replace("\\040", " ")
        if target not in points:
            points.append(target)
    return points


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
