"""Compile facts without a GPU: the launches a Triton plan makes at a shape, recorded on meta tensors, each
compiled for sm_90 (Hopper) through Triton's own passes and its bundled ptxas, which reports registers,
spilled bytes and shared memory per kernel. Uses Triton internals (ASTSource, CUDABackend); `available()`
says whether this Triton has them. Compiling needs TRITON_INTERPRET unset when the kernels are decorated.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
from dataclasses import dataclass

import torch

ARCH = 90  # sm_90a: H100 / H200
LAUNCH_OPTIONS = ("num_warps", "num_stages")
TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}


@dataclass(frozen=True)
class Launch:
    """One kernel launch: its name, grid, runtime arguments (meta tensors and scalars) and keywords."""

    name: str
    grid: tuple[int, ...]
    args: tuple
    kw: dict


@dataclass(frozen=True)
class Compiled:
    """What ptxas reports for one kernel compiled for sm_90 (bytes per thread for spills)."""

    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int


class _Recorder:
    """Stands in for a kernels module: a kernel's launch is recorded, every other name is the module's."""

    def __init__(self, module) -> None:
        self._module = module
        self.launches: list[Launch] = []

    def __getattr__(self, name: str):
        value = getattr(self._module, name)
        if not callable(getattr(value, "run", None)):  # not a @triton.jit kernel
            return value
        recorder = self

        class _Kernel:
            def __getitem__(self, grid):
                def launch(*args, **kw):
                    recorder.launches.append(Launch(name, tuple(int(x) for x in grid), args, kw))
                return launch

        return _Kernel()


def record(engine, shape: dict, dtype: torch.dtype, with_initial_state: bool = True) -> list[Launch]:
    """The launches of one call of a `TritonKdaEngine` at `shape` (meta tensors: nothing is allocated or run)."""
    B, T, H, K, V = (shape[a] for a in ("B", "T", "H", "K", "V"))
    real, recorder = engine._k, _Recorder(engine._k)
    engine._k = recorder
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # let the engine take non-CUDA tensors: it only records here
    try:
        qk = torch.empty(B, T, H, K, dtype=dtype, device="meta")
        v = torch.empty(B, T, H, V, dtype=dtype, device="meta")
        h0 = torch.empty(B, H, K, V, device="meta") if with_initial_state else None
        engine(qk, qk, v, qk, qk[..., 0], h0)
    finally:
        engine._k = real
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return recorder.launches


def available() -> bool:
    """This Triton has the internals compiling for sm_90 without a GPU needs."""
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except Exception:
        return False
    return True


def _lower(fn, launch: Launch, to_ptx: bool):
    """`fn` lowered for sm_90 through Triton's passes: (backend, options, metadata, PTX or None)."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", ARCH, 32)
    backend = CUDABackend(target)
    consts = {k: v for k, v in launch.kw.items() if k not in LAUNCH_OPTIONS}
    runtime = iter(launch.args)
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
            continue
        value = next(runtime)
        if isinstance(value, torch.Tensor):
            sig[name] = TYPES[value.dtype]
        else:
            sig[name] = "fp32" if isinstance(value, float) else "i32"
    src = ASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in consts.items()})
    opts = backend.parse_options({k: launch.kw[k] for k in LAUNCH_OPTIONS if k in launch.kw})
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    mod = src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), ctx)
    meta: dict = {}
    mod = backend.make_ttir(mod, meta, opts, ARCH)
    mod = backend.make_ttgir(mod, meta, opts, ARCH)
    llir = backend.make_llir(mod, meta, opts, ARCH)
    return backend, opts, meta, backend.make_ptx(llir, meta, opts, ARCH) if to_ptx else None


def shared_bytes(fn, launch: Launch) -> int:
    """Shared memory one block of `launch` needs on sm_90 (lowered to LLVM IR only: seconds, no ptxas)."""
    return int(_lower(fn, launch, to_ptx=False)[2]["shared"])


def compile_sm90(fn, launch: Launch) -> Compiled:
    """Compiles `fn` (the @triton.jit kernel of `launch`) for sm_90 to a cubin; reads ptxas's report."""
    import triton

    backend, opts, meta, ptx = _lower(fn, launch, to_ptx=True)
    log = io.StringIO()
    knobs = triton.knobs.nvidia
    old = knobs.dump_ptxas_log
    knobs.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(log):
            backend.make_cubin(ptx, meta, opts, ARCH)
    finally:
        knobs.dump_ptxas_log = old
    return _parse(log.getvalue(), int(meta["shared"]))


def _parse(log: str, shared: int) -> Compiled:
    def number(pattern: str) -> int:
        found = re.search(pattern, log)
        return int(found.group(1)) if found else 0

    if not re.search(r"Used (\d+) registers", log):
        raise RuntimeError(f"ptxas reported no register count; its log: {log[-2000:]!r}")
    return Compiled(number(r"Used (\d+) registers"), number(r"(\d+) bytes spill stores"),
                    number(r"(\d+) bytes spill loads"), shared)
