"""What a workload provides to the search and the evaluators.

A workload is one module under `evo/workloads/` exposing an object that satisfies `Workload`:
presets, a gene space per device, a float64 reference, fresh input draws, an engine builder,
baselines and a roofline floor. Engines take and return dicts of named tensors so evaluators stay
workload-agnostic.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

from evo.core.genome import GeneSpace, Genome

# An engine maps named input tensors to named output tensors: engine(**inputs) -> {"o": ..., ...}.
Engine = Callable[..., dict]


@dataclass(frozen=True)
class Preset:
    """A named problem size and dtype, e.g. the CPU preset B=1 T=1024 H=4 K=V=64 float32."""

    name: str
    shape: Mapping[str, int]  # e.g. {"B": 1, "T": 1024, "H": 4, "K": 64, "V": 64}
    dtype: str  # input/output dtype: "float32" or "bfloat16"
    device: str  # "cpu" or "cuda"


@dataclass(frozen=True)
class DeviceInfo:
    """The device an engine is built for: kind, a readable name, threads available on CPU."""

    kind: str  # "cpu" or "cuda"
    name: str
    threads: int = 1  # CPU threads this evaluator owns (its disjoint core set)


@dataclass(frozen=True)
class CheckCase:
    """One correctness case: a shape and a distribution to draw inputs from."""

    name: str
    shape: Mapping[str, int]
    distribution: str
    with_initial_state: bool = False


@dataclass(frozen=True)
class MachineRates:
    """Measured (or configured) ceilings of the device for the roofline floor.

    `flops_per_s` is the fastest matmul rate an engine may use for the preset's arithmetic (for a
    bfloat16 preset the best of bf16, tf32 and fp32 tensor-core rates; for float32 the fp32 rate, since
    a tf32 or bf16 shortcut fails the float32 tolerance); `matmul_flops` keeps every measured rate by
    arithmetic ("float32", "tf32", "bfloat16")."""

    flops_per_s: float
    bytes_per_s: float
    matmul_flops: Mapping[str, float] = field(default_factory=dict, hash=False)

    def merged_max(self, other: MachineRates) -> MachineRates:
        """The higher of each rate of two measurements."""
        names = set(self.matmul_flops) | set(other.matmul_flops)
        return MachineRates(max(self.flops_per_s, other.flops_per_s), max(self.bytes_per_s, other.bytes_per_s),
                            {n: max(self.matmul_flops.get(n, 0.0), other.matmul_flops.get(n, 0.0)) for n in names})


@dataclass(frozen=True)
class Roofline:
    """The preset's floor: no engine can beat max(flops/rate, bytes/bandwidth)."""

    flops: float
    bytes: float
    rates: MachineRates
    floor_ms: float = field(init=False)

    def __post_init__(self) -> None:
        floor_s = max(self.flops / self.rates.flops_per_s, self.bytes / self.rates.bytes_per_s)
        object.__setattr__(self, "floor_ms", floor_s * 1e3)


class Workload(Protocol):
    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]

    def presets(self) -> dict[str, Preset]: ...

    def gene_space(self, preset: Preset, device: DeviceInfo) -> GeneSpace: ...

    def check_cases(self, preset: Preset) -> list[list[CheckCase]]:
        """Cascade stages: cheap cases first; a candidate stops at the first failing stage. The cases
        must cover every value of every free axis (see `free_axes`)."""

    # Optional: `free_axes(preset) -> {axis: (values verified, ...)}`: the shape axes callers may vary
    # (batch, sequence length, heads, ...) and every value the cascade verifies an engine at. Serving
    # refuses a batch larger than the largest verified "B". Without it, only the preset's shape is free.

    def make_inputs(self, case: CheckCase, dtype: str, device: str, seed: int) -> dict: ...

    def reference(self, inputs: dict) -> dict:
        """Float64 outputs of the plainest possible implementation: the oracle."""

    def build(self, genome: Genome, preset: Preset, device: DeviceInfo) -> Engine: ...

    # Optional: genomes that carry code (`evo.core.code`). `open_stages(preset, device) -> (OpenStage, ...)`
    # names the stages whose implementation a code gene may replace (the gene space declares one
    # `CodeGene` per open stage); such a workload's builder is then `build(genome, preset, device,
    # sources=None)`, where `sources` maps code hash -> source for the code genes the genome sets. The
    # evaluator passes `sources` only when they are non-empty, so workloads without open stages keep
    # the three-argument `build`.

    def baselines(self, preset: Preset) -> dict[str, Callable[[DeviceInfo], Engine]]:
        """Name -> builder of each baseline engine that is available here."""

    def roofline(self, preset: Preset, rates: MachineRates) -> Roofline: ...
