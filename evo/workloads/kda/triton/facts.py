"""The kernel facts of a Triton genome (`Workload.kernel_facts`): its launches at the preset's shape,
each modelled (`model`) and, on request, compiled for sm_90 (`compiled`)."""
from __future__ import annotations

import torch

from evo.core.genome import Genome
from evo.workloads.base import KernelFacts, Preset
from evo.workloads.kda.triton import compiled, model
from evo.workloads.kda.triton.engine import TritonKdaEngine, interpreting, plan_from_genome


def kernel_facts(genome: Genome, preset: Preset, compile: bool = True) -> tuple[KernelFacts, ...]:
    """One record per launch of the hand-written kernels (a genome's code_triton is not read here);
    () for a genome of another engine. Compiling takes ~5-80 s per kernel on one core."""
    if genome.values().get("engine") != "triton":
        return ()
    if compile and interpreting():
        raise RuntimeError("compiling for sm_90 needs the GPU code path: unset TRITON_INTERPRET (it is read when the"
                           " kernels are decorated, so before this process imports them)")
    plan = plan_from_genome(genome)
    engine = TritonKdaEngine(plan)
    dtype = getattr(torch, preset.dtype)
    shape = dict(preset.shape)
    out = []
    for launch in compiled.record(engine, shape, dtype):
        m = model.model_launch(launch.name, launch.grid, launch.kw, plan, shape, dtype.itemsize)
        facts = KernelFacts(launch.name, launch.grid, m.hbm_bytes, m.seconds * 1e3)
        if compile:
            c = compiled.compile_sm90(getattr(engine._k, launch.name), launch)
            facts = KernelFacts(launch.name, launch.grid, m.hbm_bytes, m.seconds * 1e3, c.registers, c.spill_stores,
                                c.spill_loads, c.shared_bytes)
        out.append(facts)
    return tuple(out)
