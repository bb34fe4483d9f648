"""Kimi Linear (the KDA + MLA hybrid MoE decoder) as a serving engine (the generation contract,
`evo.workloads.generation`): requests in, tokens out, judged as a client on a request trace, every request
scored on its own tokens against the float64 reference (`evaluators.judge.generation`), as `llama_serve`.

Modules: model (the architecture as a `KimiSpec`, config.json and weights in transformers' names), presets
(models and the request traces they are judged on, `hf:<folder>` checkpoints), genes (the engine's decisions),
engine (the batched generator: a state pool of KDA states, convolution windows and MLA caches, the model, a
continuous-batching scheduler), baselines (transformers' KimiLinearForCausalLM batched statically, our engine
one request at a time) and reference (the float64 oracle, judge-only).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from evo.core.genome import GeneSpace, Genome
from evo.workloads.base import CPU_KERNELS_PRELOAD, NO_SOURCES, DeviceInfo, MachineRates, Preset, Roofline
from evo.workloads.generation_workload import GenerationWorkload
from evo.workloads.kimi_linear.model import KDA
from evo.workloads.kimi_linear.presets import PRESET_TABLE, KimiPreset
from evo.workloads.lazy import lazy

_baselines = lazy("evo.workloads.kimi_linear.baselines", judge_only=True)
_engine = lazy("evo.workloads.kimi_linear.engine")
_genes = lazy("evo.workloads.kimi_linear.genes")
_reference = lazy("evo.workloads.kimi_linear.reference", judge_only=True)

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


class KimiLinearWorkload(GenerationWorkload):
    name = "kimi_linear"
    preset_type = KimiPreset
    engine_preload = (CPU_KERNELS_PRELOAD,)  # its engines may call our C kernels (decode step, KDA recurrence)

    def presets(self) -> dict[str, Preset]:
        return PRESET_TABLE

    def gene_space(self, preset: Preset, device: DeviceInfo) -> GeneSpace:
        return _genes.gene_space(self._use(preset), device)

    def reference_logits(self, preset: Preset, prompt, tokens):
        return _reference.continuation_logits(self._use(preset), prompt, tokens)

    def honest_logits(self, preset: Preset, prompt, tokens, dtype: str):
        """The oracle's computation in `dtype`, keeping float32 where this workload's engine does (the guarded
        `continuation_logits`, so no engine may call it)."""
        return _reference.continuation_logits(self._use(preset), prompt, tokens, dtype)

    def reference_alternatives(self, preset: Preset, prompt, tokens):
        return _reference.continuation_alternatives(self._use(preset), prompt, tokens)

    def forbidden_callables(self) -> list[tuple[object, str]]:
        """The float64 oracle and every baseline: their answers would pass the check for free."""
        return [(_reference, "continuation_logits"), (_reference, "continuation_alternatives"), (_reference, "logits"),
                (_reference, "float64_weights"),
                (_baselines, "baselines"), (_baselines, "HFStaticKimi.step"), (_baselines, "OneAtATime.step")]

    def build_generator(self, genome: Genome, preset: Preset, device: DeviceInfo,
                        sources: Mapping[str, str] = NO_SOURCES):
        return _engine.build(genome, self._use(preset), device, sources)

    def baselines(self, preset: Preset) -> dict[str, Callable[[DeviceInfo], Any]]:
        return _baselines.baselines(self._use(preset))

    def roofline(self, preset: Preset, rates: MachineRates) -> Roofline:
        """Per output token, in ms (the objective's unit): a decode step's FLOPs for one token (the parameters a
        token reads: top_k of the experts, the LM head; no attention), and bytes: the weights a step must read
        (at least the parameters one token reads) shared by the R requests in flight, plus each request's own
        KDA states read and written (float32). MLA cache reads are left out: a lower bound for every objective."""
        p = self._use(preset)
        s, R = p.model, max(1, p.trace.concurrency)
        active = s.active_parameters()
        state = sum(1 for kind in s.layer_types if kind == KDA) * s.kda_heads * s.kda_head_dim**2 * 4 * 2
        return Roofline(flops=2 * active, bytes=active * _ITEMSIZE[p.dtype] / R + state, rates=rates)

    def label(self, genome: Genome) -> str:
        v = genome.values()
        parts = [f"x{v.get('max_running')}", f"prefill {v.get('kda_prefill')}", f"mla {v.get('mla_cache')}",
                 f"moe {v.get('moe_dispatch')}", f"state {v.get('state_dtype')}"]
        return f"kimi_linear {genome.hash[:8]} ({', '.join(parts)})"


WORKLOAD = KimiLinearWorkload()

__all__ = ["WORKLOAD", "KimiLinearWorkload"]
