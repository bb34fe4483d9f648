"""Compiling a kernel's C source once per machine (per user) and loading it with ctypes.

The library lands in `$EVO_KERNEL_CACHE`, else `~/.cache/evo/kernels`, else the temporary folder (an engine's
sandbox has only a private /tmp): its name carries a hash of the sources (a kernel may include another's), the flags
and the compiler, so an edited kernel is rebuilt and two processes building at once each write their own file and
rename it into place.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
FLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared", "-std=c11")
I64, PTR, INT, FLOAT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float  # a kernel's C argument types


class KernelUnavailable(RuntimeError):
    """This machine cannot build or run the kernel (no C compiler, not x86-64 with AVX2 and FMA)."""


def _cache_folder() -> Path:
    for folder in (os.environ.get("EVO_KERNEL_CACHE"), Path.home() / ".cache" / "evo" / "kernels",
                   Path(tempfile.gettempdir()) / "evo-kernels"):
        if folder is None:
            continue
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                return Path(folder)
        except OSError:
            continue
    raise KernelUnavailable("no writable folder for compiled kernels (set EVO_KERNEL_CACHE)")


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise KernelUnavailable("no C compiler found (cc, gcc or clang; or set CC): our CPU kernels are compiled on "
                            "first use")


@functools.cache
def _build_key() -> tuple[str, str]:
    """(the compiler, the hash every library's name carries): of all the sources (a kernel may include another's),
    the flags and the compiler's version, the same for every kernel, so worked out once a process."""
    source = b"".join(path.read_bytes() for path in sorted(HERE.glob("*.c")))
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    return cc, hashlib.sha256(source + repr(FLAGS).encode() + version.encode()).hexdigest()[:16]


@functools.cache
def kernel_library(name: str) -> ctypes.CDLL:
    """`<name>.c` of this folder compiled (once per source, flags and compiler) and loaded. KernelUnavailable
    says why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise KernelUnavailable(f"our CPU kernels are x86-64 (AVX2, FMA); this machine is {platform.machine()}")
    cc, key = _build_key()
    library = _cache_folder() / f"{name}-{key}.so"
    if not library.exists():
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        built = subprocess.run([cc, *FLAGS, "-o", str(partial), str(HERE / f"{name}.c")], capture_output=True,
                               text=True)
        if built.returncode != 0:
            partial.unlink(missing_ok=True)
            raise KernelUnavailable(f"compiling {name}.c with {cc} failed: {built.stderr.strip()[-800:]}")
        os.replace(partial, library)
    lib = ctypes.CDLL(str(library))
    if hasattr(lib, "evo_cpu_has_avx2_fma") and not lib.evo_cpu_has_avx2_fma():
        raise KernelUnavailable("our CPU kernels need AVX2 and FMA, which this CPU lacks")
    return lib


def load_kernels() -> None:
    """Every kernel of this folder compiled (into the per-user cache, once) and loaded in this process, those this
    machine cannot build left out. For the sandbox's zygote (`Workload.engine_preload`): engine processes fork from
    it with the libraries loaded, where a jailed one would compile each kernel again (seconds a build): its private
    /tmp starts empty and the per-user cache is outside its view."""
    for source in sorted(HERE.glob("*.c")):
        try:
            kernel_library(source.stem)
        except KernelUnavailable:
            pass


def kernel_function(name: str, symbol: str, restype, argtypes: tuple) -> ctypes._CFuncPtr:
    """The C function `symbol` of `<name>.c` (`kernel_library`), its result and argument types declared (a caller
    keeps it: looked up per call, the declaration would cost more than the kernel's small calls)."""
    fn = getattr(kernel_library(name), symbol)
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


def require_cpu(device: torch.device | str, kernel: str) -> None:
    """KernelUnavailable unless `device` is the CPU, where our kernels run."""
    if torch.device(device).type != "cpu":
        raise KernelUnavailable(f"the {kernel} kernel runs on the CPU, not {device}")
