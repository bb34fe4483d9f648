"""Build a KDA engine from a genome: stage functions composed into fused groups, each group run
by its backend (the BACKENDS registry is the seam where "triton" or "cupy" slot in). Each stage's
implementation comes from an `impl` mapping: the hand-written `stages.HAND_WRITTEN`, with the entries
of open stages whose code the genome carries replaced (`open_code.implementations`)."""
from __future__ import annotations

import functools
from typing import Callable, Mapping

import torch
import torch.nn.functional as F

from evo.core.genome import Genome
from evo.workloads.base import DeviceInfo, Preset
from evo.workloads.kda import open_code
from evo.workloads.kda import stages
from evo.workloads.kda.genes import Plan, gene_space
from evo.workloads.kda.stages import Impl

GroupFn = Callable[[dict], dict]


def _eager(fn: GroupFn) -> GroupFn:
    return fn


def _compile(fn: GroupFn) -> GroupFn:
    # default mode; dynamic shapes from the start: one graph serves every sequence length
    return torch.compile(fn, dynamic=True)


BACKENDS: dict[str, Callable[[GroupFn], GroupFn]] = {"eager": _eager, "compile": _compile}


def _steps(group: tuple[str, ...], plan: Plan, impl: Impl) -> list[Callable[[dict], dict]]:
    """The step functions of one fused group that contains no recurrence."""
    return [functools.partial(impl[stage], plan=plan) for stage in group]


def _chain(steps: list[Callable[[dict], dict]]) -> GroupFn:
    def run(ctx: dict) -> dict:
        ctx = dict(ctx)
        for step in steps:
            ctx.update(step(ctx))
        return ctx

    return run


def _group_fn(group: tuple[str, ...], backend: str, plan: Plan, impl: Impl) -> GroupFn:
    """One fused group on its backend. Intra or output fused with the recurrence run inside its
    chunk loop, and the backend then applies to the loop's step; gate and l2norm fused with them
    run before the loop as one function on the same backend."""
    wrap = BACKENDS[backend]
    if "recurrence" not in group:
        return wrap(_chain(_steps(group, plan, impl)))
    before = tuple(s for s in group if s in ("gate", "l2norm"))
    in_loop = {"intra_in_loop": "intra" in group, "output_in_loop": "output" in group}
    step = wrap(functools.partial(stages.loop_step, plan=plan, impl=impl, **in_loop))
    loop = functools.partial(stages.recurrence, plan=plan, step=step, **in_loop)
    return _chain(([wrap(_chain(_steps(before, plan, impl)))] if before else []) + [loop])


def _to_chunks(x: torch.Tensor, C: int, pad: int, head_major: bool) -> torch.Tensor:
    """[B, T, H, *D] -> float32 [B, H, N, C, *D], zero-padded to N*C tokens."""
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    x = x.float()
    if head_major:
        x = x.transpose(1, 2).contiguous()  # [B, H, T, *D], copied once
        return x.unflatten(2, (-1, C))
    return x.unflatten(1, (-1, C)).movedim(3, 1)  # strided view of [B, N, C, H, *D]


class KdaEngine:
    """engine(q, k, v, g, beta, initial_state=None) -> {"o": [B,T,H,V] input dtype, "final_state": [B,H,K,V] float32}."""

    def __init__(self, plan: Plan, genome: Genome | None = None, impl: Impl = stages.HAND_WRITTEN) -> None:
        self.plan = plan
        self.genome = genome
        self.num_threads: int | None = plan.threads
        self.groups = plan.groups()
        self._fns = [_group_fn(group, backend, plan, impl) for group, backend in self.groups]
        self._buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, q, k, v, g, beta, initial_state=None) -> dict:
        plan = self.plan
        B, T, H, K = q.shape
        V = v.shape[-1]
        C = plan.chunk_size
        pad = -T % C
        head_major = plan.layout == "head_major"
        ctx = {name: _to_chunks(x, C, pad, head_major) for name, x in (("q", q), ("k", k), ("v", v), ("g", g))}
        ctx["beta"] = _to_chunks(beta, C, pad, head_major)  # [B, H, N, C]
        S0 = initial_state.float() if initial_state is not None else q.new_zeros(B, H, K, V, dtype=torch.float32)
        ctx["S0"] = S0.transpose(-1, -2) if plan.state_layout == "vk" else S0
        for fn in self._fns:
            ctx = fn(ctx)
        o = ctx["O"].flatten(2, 3).transpose(1, 2)[:, :T]  # [B, T, H, V] view
        S = ctx["S_final"].transpose(-1, -2) if plan.state_layout == "vk" else ctx["S_final"]
        if plan.preallocate_outputs:
            o_buf, s_buf = self._buffer(B, T, H, K, V, q)
            return {"o": o_buf.copy_(o), "final_state": s_buf.copy_(S)}
        return {"o": o.to(q.dtype).contiguous(), "final_state": S.contiguous()}

    def _buffer(self, B: int, T: int, H: int, K: int, V: int, like: torch.Tensor):
        key = (B, T, H, K, V, like.dtype, like.device)
        if key not in self._buffers:
            self._buffers[key] = (
                torch.empty(B, T, H, V, dtype=like.dtype, device=like.device),
                torch.empty(B, H, K, V, dtype=torch.float32, device=like.device),
            )
        return self._buffers[key]


def build(genome: Genome, preset: Preset, device: DeviceInfo, sources: Mapping[str, str] | None = None):
    """Validate `genome` (GenomeError propagates) and compose its engine: the torch stage engine, or
    the Triton engine (gene engine='triton'); either one CUDA-graph captured when cuda_graph=True.
    `sources` maps code hash -> source for the code genes the genome sets (CodeError when one is
    missing, mismatched or not allowed); their entry points replace the hand-written stages."""
    gene_space(preset, device).validate(genome)
    values = genome.values()
    if values.get("engine", "torch") == "triton":
        from evo.workloads.kda.triton.engine import build_triton  # imports triton only for Triton genomes

        engine = build_triton(genome, open_code.triton_kernels(values, sources or {}))
    else:
        impl = {**stages.HAND_WRITTEN, **open_code.implementations(values, sources or {})}
        engine = KdaEngine(Plan.from_genome(genome), genome, impl)
    if values.get("cuda_graph") is True:
        from evo.workloads.kda.triton.cuda_graph import CudaGraphEngine

        return CudaGraphEngine(engine, keep_outputs=bool(values["preallocate_outputs"]))
    return engine
