"""What every workload of the generation contract (`evo.workloads.generation`) has in common: its engines
take requests, not input tensors, so the call hooks refuse; the judge draws prompts from the preset's request
trace (`evo.core.trace`), whose bounds are the verified domain; a config's `trace:` replaces it within them;
the engine reads the preset's checkpoint folder, if any, in its own process.

A subclass names its preset class (`preset_type`: a preset with `trace`, `with_trace` and `model.checkpoint`,
as `evo.workloads.llama_serve.presets.ServePreset`) and adds its model's own hooks: presets, genes, the
float64 oracle of an engine's own tokens, baselines, roofline, build_generator.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

from evo.core.genome import Genome
from evo.core.trace import TraceSpec
from evo.workloads.base import NO_SOURCES, CheckCase, DeviceInfo, Preset, Workload


class GenerationWorkload(Workload):
    contract = "generation"
    input_names = ("prompt",)
    output_names = ("tokens",)
    reference_baseline = None  # the fastest baseline of the run
    preset_type: type = Preset

    @classmethod
    def _use(cls, preset: Preset) -> Any:
        if not isinstance(preset, cls.preset_type):
            raise TypeError(f"a {cls.name} preset is a {cls.preset_type.__name__} ({cls.preset_type.__module__}), "
                            f"got {preset!r}")
        return preset

    def check_cases(self, preset: Preset) -> list[list[CheckCase]]:
        return []  # the judge's check replay covers the domain's edges (evaluators.judge.generation)

    def timing_case(self, preset: Preset) -> CheckCase:
        return CheckCase(f"trace:{preset.name}", dict(preset.shape), "uniform")

    def make_inputs(self, case: CheckCase, dtype: str, device: str, seed: int) -> dict:
        raise TypeError(f"{self.name} engines take requests, not input tensors: the judge draws their prompts")

    def reference(self, inputs: dict) -> dict:
        raise TypeError(f"the {self.name} oracle scores an engine's own tokens: call reference_logits(preset, prompt, "
                        f"tokens)")

    def with_trace(self, preset: Preset, overrides: Mapping[str, Any]) -> Preset:
        base = self._use(preset)
        allowed = sorted(f.name for f in dataclasses.fields(TraceSpec))
        unknown = sorted(set(overrides) - set(allowed))
        if unknown:
            raise ValueError(f"unknown trace key(s) {unknown}; allowed: {allowed}")
        lists_as_tuples = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
        return base.with_trace(dataclasses.replace(base.trace, **lists_as_tuples))

    def trace(self, preset: Preset) -> TraceSpec:
        return self._use(preset).trace

    def engine_files(self, preset: Preset) -> tuple[str, ...]:
        """The preset's checkpoint folder: engines read its weights in their own process."""
        checkpoint = self._use(preset).model.checkpoint
        return (str(checkpoint),) if checkpoint else ()

    def real_text(self, preset: Preset) -> list[int] | None:
        """The Zen of Python in the checkpoint's tokenizer (None: a synthetic model, or a checkpoint without one)."""
        checkpoint = self._use(preset).model.checkpoint
        return _real_text_ids(str(checkpoint)) if checkpoint else None

    def exchange_steps(self, genome: Genome) -> int:
        """Scheduling steps the engine runs per exchange with the judge or Serve (`steps_per_exchange`, 1 when the
        genome has no such gene). The judge reads it from the genome it verified, never from the engine."""
        return int(genome.values().get("steps_per_exchange", 1))

    def build(self, genome: Genome, preset: Preset, device: DeviceInfo, sources: Mapping[str, str] = NO_SOURCES):
        raise TypeError(f"{self.name} engines generate: build them with build_generator (the generation contract)")


@functools.lru_cache(maxsize=4)
def _real_text_ids(folder: str) -> list[int] | None:
    from evo.workloads import real_text

    return real_text.token_ids(folder)
