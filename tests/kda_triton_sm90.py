"""Lowers the kernels a Triton genome launches at the h200 preset for sm_90 (Hopper) without a GPU, through
Triton's own frontend and NVIDIA backend passes (to LLVM IR: no ptxas, seconds per kernel), and writes
each launch's shared memory as JSON: `python -m tests.kda_triton_sm90 OUT.json`. Catches what the
interpreter cannot: code that does not compile for the GPU, and tiles that need more shared memory than a
block may have. Registers and spills (ptxas) are `python -m evo kernels`' job (tests/test_kernel_facts.py).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import sys

import torch

from evo.workloads import get_workload
from evo.workloads.base import DeviceInfo

os.environ.pop("TRITON_INTERPRET", None)  # the compiled path, as on the GPU

from evo.workloads.kda.triton import compiled, kernels  # noqa: E402
from evo.workloads.kda.triton.engine import TritonKdaEngine, plan_from_genome  # noqa: E402

W = get_workload("kda")
H200 = W.presets()["h200"]
CLASSIC = {"triton_kernels": "classic", "num_stages": 1, "num_warps": 4, "block_v": 64}
GENOMES = {
    "classic": CLASSIC,
    "classic_fused_c64": {**CLASSIC, "fuse_recurrence_output": True, "fuse_l2norm_intra": True},
    "classic_c128_bv128": {**CLASSIC, "chunk_size": 128, "fuse_recurrence_output": True, "block_v": 128},
    "classic_c32_bv128_3stages": {**CLASSIC, "chunk_size": 32, "fuse_recurrence_output": True, "block_v": 128,
                                  "num_stages": 3},
    "blocked_c32_bv64_3stages_fp32": {"chunk_size": 32, "block_v": 64, "num_stages": 3, "workspace_dtype": "float32",
                                      "fuse_recurrence_output": True},
}


def launches(genes: dict) -> list[compiled.Launch]:
    """The launches of one call at the h200 shape (meta tensors: nothing is allocated)."""
    genome = W.gene_space(H200, DeviceInfo("cuda", "sm90", 1)).make({"engine": "triton", **genes})
    return compiled.record(TritonKdaEngine(plan_from_genome(genome)), dict(H200.shape), torch.bfloat16)


def _shared(item: tuple[str, compiled.Launch]) -> tuple[str, int]:
    label, launch = item
    return f"{label}:{launch.name}", compiled.shared_bytes(getattr(kernels, launch.name), launch)


def main(path: str) -> None:
    items = [(label, launch) for label, genes in GENOMES.items() for launch in launches(genes)]
    # each lowering is seconds of one core's work: one process per core (forked: the launches stay in memory)
    with multiprocessing.get_context("fork").Pool(min(len(os.sched_getaffinity(0)), len(items))) as pool:
        out = dict(pool.map(_shared, items, chunksize=1))
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
