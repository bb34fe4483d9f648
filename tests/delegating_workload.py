"""A test workload wrapping another (`tests.cheats`, `tests.adversaries`): its own name, the base's hooks.

Kept apart from `tests.cheats` so that a wrapper need not import that module, which binds the KDA
reference at import time (a guard test) and would put the reference into every engine process."""
from __future__ import annotations

import numpy as np

from evaluators.judge.check import expected_dtypes
from evo.workloads.base import CheckCase, MachineRates, Preset, Roofline, Workload
from evo.workloads.domain import InputDomain


class DelegatingWorkload(Workload):
    """A workload that is `base` under another name: every hook but `build` and `gene_space` delegates."""

    def __init__(self, base, name: str) -> None:
        self.base = base
        self.name = name
        self.input_names = base.input_names
        self.output_names = base.output_names

    def presets(self) -> dict[str, Preset]:
        return self.base.presets()

    def check_cases(self, preset: Preset) -> list[list[CheckCase]]:
        return self.base.check_cases(preset)

    def make_inputs(self, case: CheckCase, dtype: str, device: str, seed: int) -> dict:
        return self.base.make_inputs(case, dtype, device, seed)

    def free_axes(self, preset: Preset) -> dict[str, tuple[int, ...]]:
        return self.base.free_axes(preset)

    def domain(self, preset: Preset) -> InputDomain:
        return self.base.domain(preset)

    def draw_cases(self, preset: Preset, rng: np.random.Generator) -> list[CheckCase]:
        return self.base.draw_cases(preset, rng)

    def output_shapes(self, case: CheckCase) -> dict[str, tuple[int, ...]] | None:
        return self.base.output_shapes(case)

    def output_dtypes(self, preset: Preset) -> dict[str, str]:
        return expected_dtypes(self.base, preset)

    def reference(self, inputs: dict) -> dict:
        return self.base.reference(inputs)

    def reference_for(self, preset: Preset, inputs: dict) -> dict:  # llama: the oracle needs the preset's weights
        return self.base.reference_for(preset, inputs)

    def reference_and_scales(self, preset: Preset, inputs: dict) -> tuple[dict, dict]:
        return self.base.reference_and_scales(preset, inputs)

    def timing_case(self, preset: Preset) -> CheckCase:
        return self.base.timing_case(preset)

    def forbidden_callables(self) -> list[tuple[object, str]]:
        return [(self.base, "reference"), *self.base.forbidden_callables()]

    def baselines(self, preset: Preset) -> dict:
        return self.base.baselines(preset)

    def roofline(self, preset: Preset, rates: MachineRates) -> Roofline:
        return self.base.roofline(preset, rates)

    def request_specs(self, preset: Preset) -> tuple:
        return self.base.request_specs(preset)

    def example_request(self, preset: Preset, seed: int, **axes: int) -> dict:
        return self.base.example_request(preset, seed, **axes)

    def engine_files(self, preset: Preset) -> tuple[str, ...]:
        return self.base.engine_files(preset)
