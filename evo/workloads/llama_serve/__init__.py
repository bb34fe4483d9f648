"""A Llama decoder as a serving engine (the generation contract, `evo.workloads.generation`): requests
in, tokens out. The engine owns its scheduler and its KV memory; the judge replays a request trace
against it as a client and scores every request's own tokens (`evaluators.judge.generation`).

Modules: presets (the model and its trace), genes (the engine's decisions), engine (the batched
generator the genes describe), baselines (what a user would run instead: transformers' static and
continuous batching, our plainest engine one request at a time), reference (the float64 oracle of an
engine's own tokens). The model, its weights and the engine's layers are the `llama` workload's; that
workload keeps the teacher-forced call contract (one batch per call).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from evo.core.genome import GeneSpace, Genome
from evo.workloads.base import CPU_KERNELS_PRELOAD, NO_SOURCES, DeviceInfo, MachineRates, Preset, Roofline
from evo.workloads.generation_workload import GenerationWorkload
from evo.workloads.lazy import lazy
from evo.workloads.llama import open_code as _open_code
from evo.workloads.llama_serve.presets import PRESET_TABLE, ServePreset

_baselines = lazy("evo.workloads.llama_serve.baselines", judge_only=True)
_engine = lazy("evo.workloads.llama_serve.engine")
_genes = lazy("evo.workloads.llama_serve.genes")
_reference = lazy("evo.workloads.llama_serve.reference", judge_only=True)
_llama_reference = lazy("evo.workloads.llama.reference", judge_only=True)



class LlamaServeWorkload(GenerationWorkload):
    name = "llama_serve"
    preset_type = ServePreset
    engine_preload = ("torch._dynamo", CPU_KERNELS_PRELOAD)  # its engines may torch.compile or call our C kernels

    def presets(self) -> dict[str, Preset]:
        return PRESET_TABLE

    def gene_space(self, preset: Preset, device: DeviceInfo) -> GeneSpace:
        return _genes.gene_space(self._use(preset), device)

    def reference_logits(self, preset: Preset, prompt, tokens):
        return _reference.continuation_logits(self._use(preset).model, prompt, tokens)

    def honest_logits(self, preset: Preset, prompt, tokens, dtype: str):
        """The oracle's computation in `dtype` (the guarded `continuation_logits`, so no engine may call it)."""
        return _reference.continuation_logits(self._use(preset).model, prompt, tokens, dtype)

    def forbidden_callables(self) -> list[tuple[object, str]]:
        """The float64 oracles and every baseline: their answers would pass the check for free."""
        return [(_reference, "continuation_logits"), (_llama_reference, "generate"),
                (_llama_reference, "float64_weights"), (_baselines, "baselines"), (_baselines, "HFStatic.step"),
                (_baselines, "HFContinuous.step"), (_baselines, "OneAtATime.step")]

    def open_stages(self, preset: Preset, device: DeviceInfo):
        return _open_code.open_stages(preset, device)

    def build_generator(self, genome: Genome, preset: Preset, device: DeviceInfo,
                        sources: Mapping[str, str] = NO_SOURCES):
        return _engine.build(genome, self._use(preset), device, sources)

    def baselines(self, preset: Preset) -> dict[str, Callable[[DeviceInfo], Any]]:
        return _baselines.baselines(self._use(preset))

    def roofline(self, preset: Preset, rates: MachineRates) -> Roofline:
        """Per output token, in ms (the objective's unit): a decode step's FLOPs for one token, and the
        weights read once per step shared by the R requests in flight, at one byte each (int8, the narrowest any
        engine of the space may hold: `weight_quant`, a lossy gene). A lower bound for every objective."""
        p = self._use(preset)
        m, R = p.model, max(1, p.trace.concurrency)
        weights = m.parameters(with_embedding=False)
        return Roofline(flops=2 * weights, bytes=weights * 1 / R, rates=rates)

    def label(self, genome: Genome) -> str:
        v = genome.values()
        parts = [f"{v.get('batching')} x{v.get('max_running')}", f"prefill {v.get('prefill')}",
                 f"kv {v.get('kv_pool')}", f"step {v.get('decode_step')}"]
        if v.get("speculation", "off") != "off":
            parts.append(f"spec {v.get('speculation')} x{v.get('spec_tokens')}")
        weights = f"weights {v.get('weight_dtype')}"
        parts.append(weights + " int8" if v.get("weight_quant") == "int8" else weights)  # lossy engines stand out
        if v.get("linear_kernel", "torch") != "torch":
            parts.append(f"kernel {v.get('linear_kernel')}")
        return f"llama_serve {genome.hash[:8]} ({', '.join(parts)})"


WORKLOAD = LlamaServeWorkload()

__all__ = ["WORKLOAD", "LlamaServeWorkload"]
