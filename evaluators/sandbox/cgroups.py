"""One control group per candidate, made and removed by the judge (root): every process of the engine
joins it before any engine code runs, and none can leave (the files belong to root).

Through it the judge freezes the candidate as a whole between calls (the freezer: whatever the engine
started, with `setsid`, `vfork` or a double fork, stops with it), bounds its cores (`cpuset`), memory
and process count (and, where it is given fewer threads than cores, its CPU time) from outside, lists its processes and kills them all at the end. cgroup v1
hierarchies (freezer, cpuset, memory, pids) and the unified v2 hierarchy are both used as this machine
mounts them; `CandidateCgroup.controls` says which controls are in effect. Where no freezer exists the sandbox
freezes by signals to the candidate's PID namespace instead (`evaluators.sandbox.process`).
"""
from __future__ import annotations

import itertools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

_FREEZE_TIMEOUT_S = 10.0
_PERIOD_US = 100_000
_counter = itertools.count()


@dataclass(frozen=True)
class Hierarchy:
    """A mounted cgroup hierarchy: its mount point, version, controllers, and this process's place in it."""

    mount: Path
    version: int  # 1 or 2
    controllers: frozenset[str]
    own: str  # this process's cgroup path relative to the mount

    def base(self) -> Path:
        return self.mount / self.own.lstrip("/")


def hierarchies() -> list[Hierarchy]:
    """The cgroup hierarchies this process can make groups in (empty if none is mounted or writable)."""
    own: dict[str, str] = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            number, names, path = line.split(":", 2)
            for name in (names.split(",") if names else ["<v2>"]):
                own[name] = path
    except OSError:
        return []
    found = []
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    for line in mountinfo:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or not tail:
            continue
        mount, fstype, options = Path(fields[4]), tail[0], tail[-1].split(",")
        if fstype == "cgroup":
            names = frozenset(o for o in options if o in ("freezer", "cpuset", "cpu", "memory", "pids"))
            if names:
                found.append(Hierarchy(mount, 1, names, own.get(next(iter(names)), "/")))
        elif fstype == "cgroup2":
            path = own.get("<v2>", "/")
            try:
                names = frozenset((mount / path.lstrip("/") / "cgroup.controllers").read_text().split())
            except OSError:
                continue
            found.append(Hierarchy(mount, 2, names | {"freezer"}, path))  # the v2 freezer is core
    return [h for h in found if os.access(h.base(), os.W_OK)]


class CandidateCgroup:
    """The groups of one candidate (one per hierarchy used). `procs_files` are what a process writes
    its pid into to join; `freeze`, `thaw`, `kill`, `pids` and `remove` act on the whole candidate."""

    def __init__(self, cores: tuple[int, ...], memory_bytes: int | None, max_pids: int,
                 threads: int | None = None, found: list[Hierarchy] | None = None) -> None:
        name = f"evo-{os.getpid()}-{next(_counter)}"
        self.groups: list[tuple[Hierarchy, Path]] = []
        self.controls: set[str] = set()
        for h in hierarchies() if found is None else found:
            wanted = h.controllers - self.controls
            if h.version == 2:
                wanted &= {"freezer"} | self._enabled_v2(h)
            if not wanted:
                continue
            path = h.base() / name
            try:
                path.mkdir()
                self._limit(h, path, wanted, cores, memory_bytes, max_pids, threads)
            except OSError:
                _rmdir(path)
                continue
            self.groups.append((h, path))
            self.controls |= wanted

    @staticmethod
    def _enabled_v2(h: Hierarchy) -> set[str]:
        try:
            return set((h.base() / "cgroup.subtree_control").read_text().split())
        except OSError:
            return set()

    @staticmethod
    def _limit(h: Hierarchy, path: Path, wanted: set[str], cores: tuple[int, ...], memory_bytes: int | None,
               max_pids: int, threads: int | None) -> None:
        # CPU time: `threads` cores' worth per period, where it is fewer than the cores given
        quota = threads * _PERIOD_US if threads is not None and threads < len(cores) else None
        v1 = h.version == 1
        writes: list[tuple[str, str, str]] = []  # (controller, file, value), in order
        if v1:  # a v1 cpuset takes no task before its memory nodes are set
            writes.append(("cpuset", "cpuset.mems", (path.parent / "cpuset.mems").read_text()))
        writes += [("cpuset", "cpuset.cpus", ",".join(str(c) for c in cores)), ("pids", "pids.max", str(max_pids))]
        if memory_bytes:
            writes.append(("memory", "memory.limit_in_bytes" if v1 else "memory.max", str(memory_bytes)))
        if quota:
            writes += ([("cpu", "cpu.cfs_period_us", str(_PERIOD_US)), ("cpu", "cpu.cfs_quota_us", str(quota))] if v1
                       else [("cpu", "cpu.max", f"{quota} {_PERIOD_US}")])
        for controller, name, value in writes:
            if controller in wanted:
                (path / name).write_text(value)

    @property
    def procs_files(self) -> list[str]:
        return [str(path / "cgroup.procs") for _, path in self.groups]

    @property
    def can_freeze(self) -> bool:
        return "freezer" in self.controls

    def pids(self) -> set[int]:
        found: set[int] = set()
        for _, path in self.groups:
            try:
                found |= {int(p) for p in (path / "cgroup.procs").read_text().split()}
            except OSError:
                pass
        return found

    def freeze(self, timeout_s: float = _FREEZE_TIMEOUT_S) -> bool:
        """Freeze every process of the candidate; True once the kernel says all are frozen."""
        h, path = self._freezer()
        if h.version == 1:
            (path / "freezer.state").write_text("FROZEN")
            done = lambda: (path / "freezer.state").read_text().strip() == "FROZEN"  # noqa: E731
        else:
            (path / "cgroup.freeze").write_text("1")
            done = lambda: "frozen 1" in (path / "cgroup.events").read_text()  # noqa: E731
        until = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > until:
                return False
            time.sleep(0.0002)
        return True

    def thaw(self) -> None:
        h, path = self._freezer()
        if h.version == 1:
            (path / "freezer.state").write_text("THAWED")
        else:
            (path / "cgroup.freeze").write_text("0")

    def kill(self) -> None:
        """SIGKILL every process of the candidate (thawed after, so frozen ones die too)."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.can_freeze:
            try:
                self.thaw()
            except OSError:
                pass

    def remove(self, timeout_s: float = 10.0) -> set[int]:
        """Kill what is left, wait for the groups to empty and remove them. Returns the pids still there
        at the deadline (empty when the candidate is gone)."""
        until = time.monotonic() + timeout_s
        left = self.pids()
        while left and time.monotonic() < until:
            self.kill()
            time.sleep(0.001)
            left = self.pids()
        if not left:
            for _, path in self.groups:
                _rmdir(path)
        return left

    def _freezer(self) -> tuple[Hierarchy, Path]:
        for h, path in self.groups:
            if "freezer" in h.controllers:
                return h, path
        raise RuntimeError("this candidate has no freezer group")


def _rmdir(path: Path) -> None:
    for _ in range(100):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # busy for a moment after its last process was reaped
            time.sleep(0.002)
