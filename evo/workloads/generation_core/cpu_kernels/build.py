"""Compiling a kernel's C source once per machine (per user) and loading it with ctypes.

The library lands in `$EVO_KERNEL_CACHE`, else `~/.cache/evo/kernels`, else the temporary folder (an engine's
sandbox has only a private /tmp): its name carries a hash of the source, the flags and the compiler, so an edited
kernel is rebuilt and two processes building at once each write their own file and rename it into place.
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

HERE = Path(__file__).resolve().parent
FLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared", "-std=c11")


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
def kernel_library(name: str) -> ctypes.CDLL:
    """`<name>.c` of this folder compiled (once per source, flags and compiler) and loaded. KernelUnavailable
    says why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise KernelUnavailable(f"our CPU kernels are x86-64 (AVX2, FMA); this machine is {platform.machine()}")
    source = (HERE / f"{name}.c").read_bytes()
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(source + repr(FLAGS).encode() + version.encode()).hexdigest()[:16]
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
