"""A Llama-architecture decoder, whole: prefill and decode with the engine's own KV cache.

`WORKLOAD` is a `evo.workloads.base.Workload`. One engine call is one generation (`engine.py`):
prompt [B, P] and continuation [B, N] int64 in, logits [B, N+1, V] float32 out. Modules: model
(presets, checkpoint folders, weights), reference (float64 oracle), inputs (token draws, cascade,
domain, request schema), genes (gene space and Plan), engine, open_code (attention, mlp, norm as
code), baselines (transformers and our own eager one), roofline.

Presets name their model (`model.LlamaPreset`); a checkpoint folder is the preset
`hf:<folder>[,B=..,P=..,N=..,dtype=..,device=..]`. The oracle depends on the preset's model, so the
judges call `reference_for(preset, inputs)`; `reference(inputs)` alone cannot know the weights.
"""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from evo.core.code import OpenStage
from evo.core.genome import GeneSpace, Genome
from evo.workloads.base import (CPU_KERNELS_PRELOAD, NO_SOURCES, CheckCase, DeviceInfo, Engine, MachineRates, Preset,
                                Roofline, Workload)
from evo.workloads.domain import InputDomain
from evo.workloads.lazy import lazy
from evo.workloads.llama import genes as _genes
from evo.workloads.llama import inputs as _inputs
from evo.workloads.llama import open_code as _open_code
from evo.workloads.llama import roofline as _roofline
from evo.workloads.llama.model import PRESETS, LlamaPreset, PresetTable
from evo.workloads.requests import TensorSpec

# torch loads with these, on first use: an agent, which only holds the gene space, never imports them
_baselines = lazy("evo.workloads.llama.baselines", judge_only=True)
_engine = lazy("evo.workloads.llama.engine")
_reference = lazy("evo.workloads.llama.reference", judge_only=True)

_TABLE = PresetTable(PRESETS)


class LlamaWorkload(Workload):
    name = "llama"
    input_names = ("prompt", "continuation")
    output_names = ("logits",)
    engine_preload = ("torch._dynamo", CPU_KERNELS_PRELOAD)  # its engines may torch.compile or call our C kernels
    reference_baseline = "hf_sdpa"  # transformers' default attention: what a user runs today

    @staticmethod
    def _use(preset: Preset) -> LlamaPreset:
        if not isinstance(preset, LlamaPreset):
            raise TypeError(f"a llama preset is a LlamaPreset (see evo.workloads.llama.model), got {preset!r}")
        return preset

    def presets(self) -> dict[str, Preset]:
        return _TABLE

    def gene_space(self, preset: Preset, device: DeviceInfo) -> GeneSpace:
        return _genes.gene_space(preset, device)

    def check_cases(self, preset: Preset) -> list[list[CheckCase]]:
        return _inputs.check_cases(self._use(preset))

    def timing_case(self, preset: Preset) -> CheckCase:
        return CheckCase(f"preset:{preset.name}", dict(self._use(preset).shape), "uniform")

    def free_axes(self, preset: Preset) -> dict[str, tuple[int, ...]]:
        return _inputs.free_axes(preset)

    def domain(self, preset: Preset) -> InputDomain:
        return _inputs.domain(self._use(preset))

    def draw_cases(self, preset: Preset, rng: np.random.Generator) -> list[CheckCase]:
        return _inputs.draw_cases(self._use(preset), rng)

    def output_shapes(self, case: CheckCase) -> dict[str, tuple[int, ...]]:
        return _inputs.output_shapes(case)

    def output_dtypes(self, preset: Preset) -> dict[str, str]:
        """Logits are float32 at every preset dtype."""
        self._use(preset)
        return {"logits": "float32"}

    def make_inputs(self, case: CheckCase, dtype: str, device: str, seed: int) -> dict:
        return _inputs.make_inputs(case, dtype, device, seed)

    def reference(self, inputs: dict) -> dict:
        raise TypeError("the llama oracle depends on the preset's model (its weights): call "
                        "reference_for(preset, inputs)")

    def reference_for(self, preset: Preset, inputs: dict) -> dict:
        """Float64 logits of `preset`'s model (the plainest loop, `reference.generate`)."""
        model = self._use(preset).model
        return {"logits": _reference.generate(model, inputs["prompt"], inputs["continuation"])}

    def engine_files(self, preset: Preset) -> tuple[str, ...]:
        """A checkpoint preset's folder: engines read its weights in their own process."""
        checkpoint = self._use(preset).model.checkpoint
        return (str(checkpoint),) if checkpoint else ()

    def forbidden_callables(self) -> list[tuple[object, str]]:
        """The float64 oracle and every baseline: their answers would pass the check for free."""
        return [(_reference, "generate"), (_reference, "float64_weights"), (_baselines, "baselines"),
                (_baselines, "_Transformers.__call__"), (_baselines, "_EagerOurs.__call__"),
                (_baselines, "_EagerOurs._forward")]

    def open_stages(self, preset: Preset, device: DeviceInfo) -> tuple[OpenStage, ...]:
        return _open_code.open_stages(preset, device)

    def build(self, genome: Genome, preset: Preset, device: DeviceInfo,
              sources: Mapping[str, str] = NO_SOURCES) -> Engine:
        return _engine.build(genome, preset, device, _inputs.max_positions(preset), sources)

    def build_generator(self, genome: Genome, preset: Preset, device: DeviceInfo,
                        sources: Mapping[str, str] = NO_SOURCES):
        from evo.workloads.llama.generator import LlamaGenerator

        positions = _inputs.max_positions(preset)
        return LlamaGenerator(_engine.build(genome, preset, device, positions, sources), positions)

    def baselines(self, preset: Preset) -> dict[str, Callable[[DeviceInfo], Engine]]:
        return _baselines.baselines(preset)

    def roofline(self, preset: Preset, rates: MachineRates) -> Roofline:
        return _roofline.roofline(preset, rates)

    def label(self, genome: Genome) -> str:
        v = genome.values()
        parts = [str(v.get("attention")), f"decode {v.get('decode_step')}", f"kv {v.get('kv_alloc')} {v.get('kv_layout')}",
                 str(v.get("weight_dtype"))]
        return f"llama {genome.hash[:8]} ({', '.join(parts)})"

    def request_specs(self, preset: Preset) -> tuple[TensorSpec, ...]:
        return _inputs.request_specs(preset)

    def example_request(self, preset: Preset, seed: int, **axes: int) -> dict:
        return _inputs.example_request(preset, seed, **axes)


WORKLOAD = LlamaWorkload()

__all__ = ["WORKLOAD", "LlamaWorkload"]
