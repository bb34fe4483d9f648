"""Compiles the kernels a Triton genome launches at the h200 preset for sm_90 (Hopper) without a GPU,
through Triton's own frontend and NVIDIA backend passes, and writes each launch's shared memory as
JSON: `python -m tests.kda_triton_sm90 OUT.json`. Catches what the interpreter cannot: code that
does not compile for the GPU, and tiles that need more shared memory than a block may have.
Triton internals (ASTSource, CUDABackend) are used; the caller skips if they are missing.
"""
from __future__ import annotations

import json
import os
import sys

import torch

from evo.workloads import get_workload
from evo.workloads.base import DeviceInfo

os.environ.pop("TRITON_INTERPRET", None)  # the compiled path, as on the GPU

from evo.workloads.kda.triton import kernels  # noqa: E402
from evo.workloads.kda.triton.engine import TritonKdaEngine, plan_from_genome  # noqa: E402

W = get_workload("kda")
H200 = W.presets()["h200"]
LAUNCH_OPTIONS = ("num_warps", "num_stages")
TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16"}


class _Recorder:
    """Stands in for the kernels module: records every launch instead of running it."""

    def __init__(self) -> None:
        self.launches: list[tuple[str, tuple, dict]] = []
        self.SUB = kernels.SUB

    def __getattr__(self, name: str):
        recorder = self

        class _Kernel:
            def __getitem__(self, grid):
                return lambda *args, **kw: recorder.launches.append((name, args, kw))

        return _Kernel()


def _shared(fn, args: tuple, kw: dict) -> int:
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    consts = {k: v for k, v in kw.items() if k not in LAUNCH_OPTIONS}
    runtime = iter(args)
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
            continue
        value = next(runtime)
        sig[name] = TYPES[value.dtype] if isinstance(value, torch.Tensor) else ("fp32" if isinstance(value, float) else "i32")
    src = ASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in consts.items()})
    opts = backend.parse_options({k: kw[k] for k in LAUNCH_OPTIONS})
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    mod = src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), ctx)
    meta: dict = {}
    mod = backend.make_ttir(mod, meta, opts, 90)
    mod = backend.make_ttgir(mod, meta, opts, 90)
    backend.make_llir(mod, meta, opts, 90)
    return int(meta["shared"])


def launches(genes: dict) -> list[tuple[str, tuple, dict]]:
    """The launches of one call at the h200 shape (meta tensors: nothing is allocated)."""
    genome = W.gene_space(H200, DeviceInfo("cuda", "sm90", 1)).make({"engine": "triton", **genes})
    engine = TritonKdaEngine(plan_from_genome(genome))
    engine._k = _Recorder()
    s = H200.shape
    x = torch.empty(s["B"], s["T"], s["H"], s["K"], dtype=torch.bfloat16, device="meta")
    os.environ["TRITON_INTERPRET"] = "1"  # let the engine accept non-CUDA tensors: it only records here
    try:
        engine(x, x, x, x, x[..., 0], torch.empty(s["B"], s["H"], s["K"], s["V"], device="meta"))
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
    return engine._k.launches


GENOMES = {
    "default": {},
    "fused_c64": {"fuse_recurrence_output": True, "fuse_l2norm_intra": True},
    "c128_bv128": {"chunk_size": 128, "fuse_recurrence_output": True, "block_v": 128},  # largest with 1 stage
    "c32_bv128_3stages": {"chunk_size": 32, "fuse_recurrence_output": True, "block_v": 128, "num_stages": 3},
}


def main(path: str) -> None:
    out = {}
    for label, genes in GENOMES.items():
        for name, args, kw in launches(genes):
            out[f"{label}:{name}"] = _shared(getattr(kernels, name), args, kw)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
