"""Kimi Delta Attention (KDA) forward, inference: the first workload of the engine factory.

`WORKLOAD` is a `evo.workloads.base.Workload`. Modules: reference (float64 oracle), inputs
(presets, distributions, check cases), domain (the verified input domain and the cases drawn over
it per evaluation), genes (gene space and Plan), stages (the chunked math),
engine (genome -> engine), open_code (the stages a genome may carry as code), baselines, roofline,
requests (the HTTP request schema and the load generator's requests).
"""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from evo.core.code import OpenStage
from evo.core.genome import GeneSpace, Genome
from evo.workloads.base import (NO_SOURCES, CheckCase, DeviceInfo, Engine, KernelFacts, MachineRates, Preset,
                                 Roofline, Workload)
from evo.workloads.domain import InputDomain
from evo.workloads.kda import domain as _domain
from evo.workloads.kda import genes as _genes
from evo.workloads.kda import open_code as _open_code
from evo.workloads.kda import requests as _requests
from evo.workloads.kda import roofline as _roofline
from evo.workloads.lazy import lazy
from evo.workloads.requests import TensorSpec

# torch loads with these, on first use: an agent, which only holds the gene space, never imports them
_baselines = lazy("evo.workloads.kda.baselines", judge_only=True)
_engine = lazy("evo.workloads.kda.engine")
_inputs = lazy("evo.workloads.kda.inputs")
_reference = lazy("evo.workloads.kda.reference", judge_only=True)


class KdaWorkload(Workload):
    name = "kda"
    input_names = ("q", "k", "v", "g", "beta", "initial_state")
    output_names = ("o", "final_state")
    engine_preload = ("torch._dynamo",)  # its engines may torch.compile
    reference_baseline = "fla_chunk_kda"  # what a user runs today (flash-linear-attention's chunked KDA)

    def presets(self) -> dict[str, Preset]:
        return _inputs.presets()

    def gene_space(self, preset: Preset, device: DeviceInfo) -> GeneSpace:
        return _genes.gene_space(preset, device)

    def check_cases(self, preset: Preset) -> list[list[CheckCase]]:
        return _inputs.check_cases(preset)

    def free_axes(self, preset: Preset) -> dict[str, tuple[int, ...]]:
        return _inputs.free_axes(preset)

    def domain(self, preset: Preset) -> InputDomain:
        return _domain.domain(preset)

    def draw_cases(self, preset: Preset, rng: np.random.Generator) -> list[CheckCase]:
        return _domain.draw_cases(preset, rng)

    def output_shapes(self, case: CheckCase) -> dict[str, tuple[int, ...]]:
        return _domain.output_shapes(case)

    def make_inputs(self, case: CheckCase, dtype: str, device: str, seed: int) -> dict:
        return _inputs.make_inputs(case, dtype, device, seed)

    def output_dtypes(self, preset: Preset) -> dict[str, str]:
        """o comes back in the input dtype; the state is always float32."""
        return {"o": preset.dtype, "final_state": "float32"}

    def reference(self, inputs: dict) -> dict:
        return _reference.reference(inputs)

    def reference_and_scales(self, preset: Preset, inputs: dict) -> tuple[dict, dict]:
        """o's error is measured against the root-sum-square of its terms where o has cancelled below
        it (q_t nearly orthogonal to what the state holds; evo/workloads/kda/reference.py)."""
        return _reference.reference_and_scales(inputs)

    def forbidden_callables(self) -> list[tuple[object, str]]:
        """What an engine must not call (the evaluator guards these while engines build and run):
        the float64 oracle and every baseline, whose answers would pass the check for free."""
        return [(_reference, "reference"), (_reference, "recurrent_kda"), (_reference, "chunked_kda"),
                (_reference, "reference_and_scales"), (_reference, "_oracle"),
                *((_baselines, name) for name in ("chunk_pairwise", "_pairwise_intra", "_chunk_step",
                                                  "_compiled_chunk_pairwise", "_eager_recurrent",
                                                  "_fla_naive_chunk", "recurrent_kda", "baselines"))]

    def open_stages(self, preset: Preset, device: DeviceInfo) -> tuple[OpenStage, ...]:
        """Intra, the recurrence's per-chunk state update and output (torch engine; genes code_*), and
        the Triton engine's kernels where it runs (code_triton)."""
        return _open_code.open_stages(preset, device)

    def build(self, genome: Genome, preset: Preset, device: DeviceInfo,
              sources: Mapping[str, str] = NO_SOURCES) -> Engine:
        """`sources`: code hash -> source for the code genes `genome` sets (see `open_stages`)."""
        return _engine.build(genome, preset, device, sources)

    def baselines(self, preset: Preset) -> dict[str, Callable[[DeviceInfo], Engine]]:
        return _baselines.baselines(preset)

    def roofline(self, preset: Preset, rates: MachineRates) -> Roofline:
        return _roofline.roofline(preset, rates)

    def kernel_facts(self, genome: Genome, preset: Preset, device: DeviceInfo,
                     compile: bool = True) -> tuple[KernelFacts, ...]:
        """Triton genomes: each kernel compiled for sm_90 (no GPU needed) and modelled; others: none."""
        from evo.workloads.kda.triton.facts import kernel_facts  # imports triton only when asked

        return kernel_facts(genome, preset, compile)

    def label(self, genome: Genome) -> str:
        """Engine kind, short hash and the genes that matter most for it, e.g. "triton 1a2b3c4d (C=64, ...)"."""
        v = genome.values()
        kind = v.get("engine", "torch")
        parts = [f"C={v.get('chunk_size')}", str(v.get("compute_dtype"))]
        if kind == "triton":
            fused = [name for gene, name in (("fuse_l2norm_intra", "prepare"), ("fuse_recurrence_output", "output"))
                     if v.get(gene)]
            if v.get("triton_kernels") == "blocked":
                parts += ["blocked", f"block_v={v.get('block_v')}", f"{v.get('workspace_dtype')} workspaces",
                          "fused output" if v.get("fuse_recurrence_output") else "3 kernels"]
            else:
                parts += [f"block_v={v.get('block_v')}", f"fused {'+'.join(fused)}" if fused else "4 kernels",
                          f"state {v.get('state_layout')}"]
        if v.get("cuda_graph"):
            parts.append("CUDA graph")
        return f"{kind} {genome.hash[:8]} ({', '.join(parts)})"

    def request_specs(self, preset: Preset) -> tuple[TensorSpec, ...]:
        return _requests.request_specs(preset)

    def example_request(self, preset: Preset, seed: int, **axes: int) -> dict:
        return _requests.example_request(preset, seed, **axes)


WORKLOAD = KdaWorkload()

__all__ = ["WORKLOAD", "KdaWorkload"]
