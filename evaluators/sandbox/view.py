"""What an engine's process may see of the machine's files: an allow-list, declared here once.

The jail (`evaluators.sandbox.jail`) starts the engine's mount namespace from an empty tmpfs root and binds in,
read-only, exactly the paths of a `View`; nothing else of the machine exists there. A view holds:
- the system's programs and libraries (`/usr` and its merged-usr links, the dynamic linker's cache,
  `/etc/alternatives` for the C compiler torch.compile calls), and a passwd/group naming only root and
  nobody;
- the Python the engine runs on: its interpreter, standard library and headers, and of its
  site-packages only the distributions an engine imports (torch, triton, numpy and everything they
  require; for baselines also transformers and fla), the files of the modules the zygote has loaded, and
  the `.pth` files and import hooks the site machinery reads;
- of the project, the engine-side packages (`evo/__init__.py`, `evo/core`, `evo/workloads`) less the
  hidden files (the reference's and the baselines' modules, which an engine process never has loaded);
- the files the workload says its engines read (`Workload.engine_files`: a checkpoint's weights);
- a few device nodes (null, zero, random; on CUDA the NVIDIA ones), `/sys` only for the CPU topology
  (and on CUDA the PCI devices), a fresh `/proc` of its own PID namespace, private `/tmp`, `/var/tmp`
  and `/dev/shm`;
- for baselines only (trusted: the project's own code), one writable folder: the machine's compile cache
  for baselines (`baseline_cache`), so a `torch.compile` baseline is compiled once per machine and reused.
  No candidate's view holds it, so no candidate can write what a baseline later loads.
Everything else — the project's tests, docs, scripts, configs, run directories, MLflow stores, `.git`,
the judge's package, other checkouts, home folders, other processes — is absent.
"""
from __future__ import annotations

import functools
import importlib.metadata as metadata
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

PROJECT = Path(__file__).resolve().parents[2]
ENGINE_PACKAGES = ("evo/__init__.py", "evo/core", "evo/workloads")  # the project's engine side
ROOT_DISTRIBUTIONS = ("torch", "triton", "numpy",  # what engine code may import (evo.core.code)
                      "safetensors")  # how engines read a checkpoint's weights (Workload.engine_files)
BASELINE_DISTRIBUTIONS = ("transformers", "fla-core", "einops")  # what baselines (trusted) may import besides
SYSTEM = ("/usr", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives", "/etc/localtime")
MERGED_USR_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
CPU_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
CPU_SYS = ("/sys/devices/system/cpu", "/sys/devices/system/node")
CUDA_SYS = ("/sys/bus/pci/devices", "/sys/module/nvidia")
DEV_LINKS = (("/dev/fd", "/proc/self/fd"), ("/dev/stdin", "/proc/self/fd/0"), ("/dev/stdout", "/proc/self/fd/1"),
             ("/dev/stderr", "/proc/self/fd/2"))
PRIVATE = ("/tmp", "/var/tmp", "/dev/shm")
BASELINE_CACHE = "/var/cache/evo-baselines"  # where a baseline's process sees the machine's compile cache
BASELINE_CACHE_ENV = "EVO_BASELINE_CACHE"  # the host folder of that cache (default ~/.cache/evo/baseline-compile)
NOBODY = 65534
USERS = {"/etc/passwd": "root:x:0:0:root:/:/usr/sbin/nologin\nnobody:x:65534:65534:nobody:/tmp:/usr/sbin/nologin\n",
         "/etc/group": "root:x:0:\nnogroup:x:65534:\n"}


@dataclass(frozen=True)
class View:
    """The engine's whole file view. `read_only`: paths bound read-only at the same place (files or
    folders, resolved); `hidden`: paths inside those covered by an unreadable empty file or folder;
    `links`: (path, target) symlinks made in the new root; `files`: (path, text) written there;
    `private`: writable tmpfs folders; `writable`: (host folder, path inside) bound read-write (a
    baseline's compile cache); `/proc` is mounted fresh."""

    read_only: tuple[str, ...]
    hidden: tuple[str, ...] = ()
    links: tuple[tuple[str, str], ...] = ()
    files: tuple[tuple[str, str], ...] = ()
    private: tuple[str, ...] = PRIVATE
    writable: tuple[tuple[str, str], ...] = ()

    def allows(self, path: str) -> bool:
        """Whether `path` (absolute, as seen inside) is in the view: under a bound or private path, a
        made link or file, /proc, or a folder on the way to one of those."""
        path = os.path.normpath(path)
        if any(under(path, h) and path != h for h in self.hidden):
            return False
        roots = (*self.read_only, *self.private, *(p for p, _ in self.links), *(p for p, _ in self.files),
                 *(inside for _, inside in self.writable), "/proc")
        return any(under(path, r) or under(r, path) for r in roots)


def declared_view(hidden: Iterable[str], modules: Iterable[str], cuda: bool = False, trusted: bool = False,
                  readable: Iterable[str] = (), cache: str = "") -> View:
    """The view of an engine process whose interpreter has `modules` loaded (their files stay visible),
    with `hidden` covered; `cuda` adds the NVIDIA devices and PCI folders; `trusted` (a baseline) adds the
    libraries baselines build on (`BASELINE_DISTRIBUTIONS`, where installed); `readable` adds the files a
    workload's engines read (`Workload.engine_files`, e.g. a checkpoint folder); `cache` (a baseline only:
    `baseline_cache()`, made by the judge) is bound read-write at BASELINE_CACHE."""
    return _view(tuple(sorted(hidden)), frozenset(m.partition(".")[0] for m in modules), cuda, trusted,
                 tuple(sorted(readable)), cache if trusted else "")


@functools.lru_cache(maxsize=16)
def _view(hidden: tuple[str, ...], top_modules: frozenset[str], cuda: bool, trusted: bool,
          readable: tuple[str, ...], cache: str) -> View:
    extra = BASELINE_DISTRIBUTIONS if trusted else ()
    paths = [*SYSTEM, *CPU_DEVICES, *CPU_SYS, *_python(), *_site_entries(top_modules, extra), *readable,
             *(str(PROJECT / p) for p in ENGINE_PACKAGES)]
    if cuda:
        paths += [*_nvidia_devices(), *CUDA_SYS]
    real = sorted({os.path.realpath(p) for p in paths if os.path.exists(p)})
    kept = tuple(p for p in real if not any(p != q and under(p, q) for q in real))  # one bind per subtree
    links = [(p, os.readlink(p)) for p in (*MERGED_USR_LINKS, *SYSTEM) if os.path.islink(p)]
    links += [(p, t) for p, t in DEV_LINKS]
    links += _venv_links()
    covered = tuple(h for h in hidden if any(under(h, r) for r in kept))
    writable = ((cache, BASELINE_CACHE),) if cache else ()
    return View(kept, covered + _unused_site(), tuple(links), tuple(USERS.items()), writable=writable)


def baseline_cache() -> str:
    """The machine's compile cache for baselines (Inductor's and Triton's), made on first need by the
    judge and owned by the user engines run as; `$EVO_BASELINE_CACHE` or ~/.cache/evo/baseline-compile."""
    folder = os.path.realpath(os.environ.get(BASELINE_CACHE_ENV) or Path.home() / ".cache" / "evo" / "baseline-compile")
    os.makedirs(folder, 0o700, exist_ok=True)
    if os.getuid() == 0 and os.stat(folder).st_uid != NOBODY:
        os.chown(folder, NOBODY, NOBODY)
    return folder


def _python() -> list[str]:
    """The interpreter, its standard library (without its own site-packages unless on sys.path), its
    headers and shared library; for a venv, its config and bin folder (compile workers start Python)."""
    base, version = Path(sys.base_prefix), f"python{sys.version_info.major}.{sys.version_info.minor}"
    paths = [str(base / "bin"), str(base / "lib" / version), str(base / "include" / version),
             *(str(p) for p in (base / "lib").glob("libpython*"))]
    if sys.prefix != sys.base_prefix:
        paths += [str(Path(sys.prefix) / "pyvenv.cfg"), str(Path(sys.prefix) / "bin")]
    return paths


def _venv_links() -> list[tuple[str, str]]:
    lib64 = Path(sys.prefix) / "lib64"
    return [(str(lib64), os.readlink(lib64))] if sys.prefix != sys.base_prefix and lib64.is_symlink() else []


def _unused_site() -> tuple[str, ...]:
    """The base interpreter's site-packages when a venv does not use it (it lies inside the stdlib folder)."""
    base = os.path.realpath(Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
                            / "site-packages")
    on_path = {os.path.realpath(p) for p in sys.path if p}
    return () if base in on_path or not os.path.isdir(base) else (base,)


def _site_entries(top_modules: frozenset[str], extra: tuple[str, ...]) -> list[str]:
    """Of the site-packages folders on sys.path: the top-level files and folders of the distributions
    engines need (the roots, `extra`, and what they require, transitively), those of the modules already
    loaded (the zygote's, so nothing it holds is missing on disk), and the `.pth` files and
    editable-install hooks the site machinery reads."""
    folders = [p for p in dict.fromkeys(sys.path) if p and os.path.basename(p) in ("site-packages", "dist-packages")
               and os.path.isdir(p)]
    paths = list(_distribution_entries(extra))
    for name in top_modules:  # its own package folder or file only (it may live inside another package,
        # e.g. a library vendored in ray/thirdparty_files when the judge had imported ray)
        where = os.path.realpath(getattr(sys.modules.get(name), "__file__", None) or "")
        if any(where.startswith(os.path.realpath(folder) + "/") for folder in folders):
            paths.append(os.path.dirname(where) if os.path.basename(where).startswith("__init__.") else where)
    for folder in folders:
        paths += [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".pth") or n.startswith("__editable__")]
    return paths


@functools.lru_cache(maxsize=4)
def _distribution_entries(extra: tuple[str, ...]) -> tuple[str, ...]:
    """The top-level site-packages entries of the roots, `extra` and their requirements (from RECORD)."""
    entries = []
    for dist in _closure({*ROOT_DISTRIBUTIONS, *extra}):
        base = str(dist.locate_file(""))
        record = dist.read_text("RECORD") or ""
        tops = {line.split(",", 1)[0].split("/", 1)[0] for line in record.splitlines()}
        entries += [os.path.join(base, top) for top in sorted(tops) if top and top != ".."]
    return tuple(entries)


def _closure(names: set[str]) -> list[metadata.Distribution]:
    """The installed distributions named and everything they require (extras left out), transitively."""
    found: dict[str, metadata.Distribution] = {}
    todo = [_canonical(n) for n in names]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        found[name] = dist
        for requirement in dist.requires or ():
            if "extra ==" in requirement.replace('"', " ").replace("'", " ") or "extra==" in requirement:
                continue
            match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
            if match:
                todo.append(_canonical(match.group(0)))
    return list(found.values())


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _nvidia_devices() -> list[str]:
    return sorted(str(p) for p in Path("/dev").glob("nvidia*"))


def under(path: str, root: str) -> bool:
    """Whether `path` is `root` or lies inside it."""
    return path == root or path.startswith(root.rstrip("/") + "/")
