"""What a workload provides to the search, the evaluators and serving: the `Workload` base class.

A workload is one module (under `evo/workloads/`, or anywhere importable, named by its dotted path)
whose `WORKLOAD` is an instance of a `Workload` subclass. The subclass must give presets, a gene
space per device, check cases, fresh input draws, a float64 reference, an engine builder, baselines
and a roofline floor; every other hook has a default declared here. Engines take and return dicts
of named tensors so evaluators and serving stay workload-agnostic.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from evo.core.code import OpenStage
from evo.core.genome import GeneSpace, Genome
from evo.workloads.domain import InputDomain, draw_over_axes
from evo.workloads.requests import TensorSpec

# An engine maps named input tensors to named output tensors: engine(**inputs) -> {output name: tensor}.
Engine = Callable[..., dict]

NO_SOURCES: Mapping[str, str] = MappingProxyType({})  # `build`'s sources for a genome without code genes


def greedy_only(builder: Callable) -> Callable:
    """Marks a generation baseline's builder whose engine decodes greedily only (`Workload.greedy_baselines`)."""
    builder.greedy_only = True
    return builder


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


@dataclass(frozen=True)
class KernelFacts:
    """One compiled kernel an engine launches at a preset: what its compiler reports (None: not compiled)
    and what the workload's first-order model predicts (HBM bytes read + written, time)."""

    name: str
    grid: tuple[int, ...]  # programs launched, per grid axis
    hbm_bytes: float  # modelled
    model_ms: float  # modelled
    registers: int | None = None  # per thread
    spill_bytes: int | None = None  # spill stores per thread
    spill_load_bytes: int | None = None  # spill loads per thread
    shared_bytes: int | None = None  # per block


# `Workload.engine_preload` of a workload whose engines may call our C kernels (generation_core.cpu_kernels): the
# zygote loads them once, before the jail, where each jailed engine process would compile them again
CPU_KERNELS_PRELOAD = "evo.workloads.generation_core.cpu_kernels.build:load_kernels"


class Workload:
    """The base class of every workload: each hook declared once, with its default.

    A subclass must set `name`, `input_names` and `output_names` and override the eight hooks that
    raise `NotImplementedError` here (`presets`, `gene_space`, `check_cases`, `make_inputs`,
    `reference`, `build`, `baselines`, `roofline`). The others have defaults that fit a workload
    with one fixed shape, no open stages and no serving schema; override them to opt in.

    Hooks are plain methods called by name: the evaluators (check, guard, timing), the search driver,
    serving (schema, verified domain, batching limit) and the load generator (example requests) read only these.
    """

    name: str = ""  # how runs, lessons and registered models name it, e.g. "sum"
    input_names: tuple[str, ...] = ()  # the engine's keyword arguments
    output_names: tuple[str, ...] = ()  # the keys of the dict an engine returns
    reference_baseline: str | None = None  # the baseline benchmark speedups are against (what a user
    # runs today); None, or absent from a run: the fastest baseline
    contract: str = "call"  # "call": engine(**inputs) -> outputs, one batch per call (`Engine`); "generation":
    # a long-lived engine, requests in and tokens out (`evo.workloads.generation`), judged as a client
    # (`evaluators.judge.generation`) through the generation hooks below
    engine_preload: tuple[str, ...] = ()  # modules its engines' processes start with imported (the zygote loads
    # them once): "torch._dynamo" where engines may torch.compile (~2 s of CPU each process would pay otherwise);
    # "module:function" also calls that function there, before the jail (CPU_KERNELS_PRELOAD: our C kernels)

    # ------------------------------------------------------------------ required hooks
    def presets(self) -> dict[str, Preset]:
        """Name -> preset (problem size, dtype, device) a run can be configured with."""
        raise self._missing("presets")

    def gene_space(self, preset: Preset, device: DeviceInfo) -> GeneSpace:
        """The genes (and code genes, one per open stage) of engines for `preset` on `device`."""
        raise self._missing("gene_space")

    def check_cases(self, preset: Preset) -> list[list[CheckCase]]:
        """Cascade stages: cheap cases first; a candidate stops at the first failing stage. The cases
        must cover every value of every free axis (see `free_axes`)."""
        raise self._missing("check_cases")

    def make_inputs(self, case: CheckCase, dtype: str, device: str, seed: int) -> dict:
        """Fresh inputs for `case`: {input name: tensor on `device`, or None for an absent optional}."""
        raise self._missing("make_inputs")

    def reference(self, inputs: dict) -> dict:
        """Float64 outputs of the plainest possible implementation: the oracle."""
        raise self._missing("reference")

    def build(self, genome: Genome, preset: Preset, device: DeviceInfo,
              sources: Mapping[str, str] = NO_SOURCES) -> Engine:
        """The engine `genome` describes, for `preset` on `device`. `sources` maps code hash -> source
        for the code genes the genome sets (see `open_stages`); empty for a genome without code."""
        raise self._missing("build")

    def baselines(self, preset: Preset) -> dict[str, Callable[[DeviceInfo], Engine]]:
        """Name -> builder of each baseline engine that is available here."""
        raise self._missing("baselines")

    def build_generator(self, genome: Genome, preset: Preset, device: DeviceInfo,
                        sources: Mapping[str, str] = NO_SOURCES) -> Any:
        """The generation engine `genome` describes (the generation contract, `evo.workloads.generation`:
        requests in, tokens out), for a workload whose engines generate. Default: none."""
        raise NotImplementedError(f"workload {self.name!r} has no generation engine (the generation contract)")

    def roofline(self, preset: Preset, rates: MachineRates) -> Roofline:
        """The preset's floor on `rates`: its FLOPs and bytes moved (a generation workload: per output token
        of its trace, in the units of the run's objective)."""
        raise self._missing("roofline")

    # ------------------------------------------------------------------ the generation contract's hooks
    # A generation workload's preset has shape axes R (requests in flight), P (longest prompt), N (most new
    # tokens of a request) and V (vocabulary): the judge's check replay covers their edges.
    def with_trace(self, preset: Preset, overrides: Mapping[str, Any]) -> Preset:
        """`preset` judged on its trace with `overrides` (the config's `evaluator.trace`); ValueError naming
        a field or bound that is wrong."""
        raise NotImplementedError(f"workload {self.name!r} has no request trace (the generation contract)")

    def trace(self, preset: Preset):
        """The `evo.core.trace.TraceSpec` engines for `preset` are timed on."""
        raise NotImplementedError(f"workload {self.name!r} has no request trace (the generation contract)")

    def reference_logits(self, preset: Preset, prompt, tokens) -> np.ndarray:
        """Float64 logits [len(tokens), V]: row i predicts tokens[i] from the prompt and tokens[:i] (the
        reference teacher-forced over an engine's own tokens, which it was never handed)."""
        raise NotImplementedError(f"workload {self.name!r} has no generation reference")

    def honest_logits(self, preset: Preset, prompt, tokens, dtype: str) -> np.ndarray:
        """The reference's own computation executed with weights and activations in `dtype` (e.g. "bfloat16"), as
        float64 numbers [len(tokens), V] (rows as `reference_logits`'s): an honest execution at that precision,
        which calibrates the accuracy contract's budget. Default: none (no calibration: a budget must be given)."""
        raise NotImplementedError(f"workload {self.name!r} has no honest execution at {dtype!r} "
                                  f"(Workload.honest_logits): give the accuracy contract's budget explicitly")

    def reference_alternatives(self, preset: Preset, prompt, tokens) -> Iterable[np.ndarray]:
        """The reference's other readings of the same tokens, each as `reference_logits`'s: where the model makes
        a discrete choice (an MoE router's top-k) between near-tied options, an honest engine's rounding may take
        either, and the judge accepts tokens that any reading explains. Asked only when the first reading
        fails. Default: none (a model without discrete choices)."""
        return ()

    def real_text(self, preset: Preset) -> list[int] | None:
        """A fixed real text in the preset's tokenizer (`evo.workloads.real_text`: the Zen of Python), on which the
        judge measures next-token quality for the engine and the reference; None for a model without one (a
        synthetic preset). Default: None."""
        return None

    def greedy_baselines(self, preset: Preset) -> frozenset[str]:
        """The baselines that decode greedily only (they cannot draw `evo.workloads.sampling`'s seeded samples):
        the judge sends them its sampled requests as greedy ones, of the same shapes. Candidates always get every
        case. Default: the baselines whose builder is marked with `greedy_only`."""
        return frozenset(name for name, builder in self.baselines(preset).items()
                         if getattr(builder, "greedy_only", False))

    def tie_tolerance(self, preset: Preset) -> float:
        """How far below the reference's top logit another token may be and still count as a near tie."""
        return {"float32": 1e-3, "bfloat16": 0.15}.get(preset.dtype, 0.15)

    # ------------------------------------------------------------------ optional hooks
    def reference_for(self, preset: Preset, inputs: dict) -> dict:
        """The oracle as the judges call it: float64 outputs for `inputs` drawn for `preset`. Default:
        `reference(inputs)`; a workload whose oracle depends on the preset (a model's weights) overrides
        this one."""
        return self.reference(inputs)

    def reference_and_scales(self, preset: Preset, inputs: dict) -> tuple[dict, dict]:
        """The oracle's outputs and, per output that can cancel far below the terms it is summed from,
        the size of those terms (elementwise, float64: their root-sum-square, which is about the output
        where the terms' signs are random): where an output's norm is below its terms', the judge
        measures the error against the terms', as a finite-precision sum's rounding follows them (a
        condition-aware bound, evaluators/judge/check.py). Default: `reference_for`'s outputs and no
        scales (each output's error measured against itself)."""
        return self.reference_for(preset, inputs), {}

    def free_axes(self, preset: Preset) -> dict[str, tuple[int, ...]]:
        """The shape axes callers may vary (batch, sequence length, ...), each with every value the
        fixed cascade verifies an engine at (`domain` spans them, and draws the values between).
        Default: only the preset's own shape."""
        return {axis: (int(value),) for axis, value in preset.shape.items()}

    def domain(self, preset: Preset) -> InputDomain:
        """Every input engines for `preset` are verified for (`evo.workloads.domain`): each free axis as
        a range, each input's value range. The evaluator draws cases over all of it (`draw_cases`);
        Serve refuses what lies outside, naming the bound. Default: the ranges the free axes span
        (smallest to largest listed value), no value bounds."""
        return InputDomain.from_free_axes(self.free_axes(preset))

    def verified_batch(self, preset: Preset) -> int:
        """The largest batch (B) engines for `preset` are verified at: the most requests' rows Serve may
        merge into one engine call (its `max_batch_size` default and bound). Default: the top of the
        domain's B axis, else the preset's B, else 1."""
        batch = self.domain(preset).axes.get("B")
        return batch.hi if batch is not None else int(preset.shape.get("B", 1))

    def draw_cases(self, preset: Preset, rng: np.random.Generator) -> list[CheckCase]:
        """Random cases over the whole domain, drawn afresh for each evaluation from the judge's `rng`
        and checked besides the fixed `check_cases`; each must lie in `domain(preset)`. Default: per
        axis with a range one case uniform over it, and one with every axis drawn, in the timing
        case's distribution."""
        like = self.timing_case(preset)
        return [CheckCase(name, shape, like.distribution, like.with_initial_state)
                for name, shape in draw_over_axes(self.domain(preset), preset.shape, rng)]

    def output_shapes(self, case: CheckCase) -> dict[str, tuple[int, ...]] | None:
        """Output name -> shape of an engine's outputs for inputs drawn for `case`. Default None: the
        evaluator reads them off the reference of one draw (one more reference for every drawn case
        of a new shape; declare them to save that)."""
        return None

    def open_stages(self, preset: Preset, device: DeviceInfo) -> tuple[OpenStage, ...]:
        """The stages whose implementation a code gene may replace (`evo.core.code`); the gene space
        declares one `CodeGene` per open stage. Default: none (genomes carry no code)."""
        return ()

    def engine_files(self, preset: Preset) -> tuple[str, ...]:
        """Files or folders an engine for `preset` reads in its process (e.g. a checkpoint's weights): bound
        read-only into the engine's view of the files (`evaluators.sandbox.view`), which holds nothing else of the
        machine's data. Default: none."""
        return ()

    def output_dtypes(self, preset: Preset) -> dict[str, str]:
        """Output name -> the dtype an engine must return it in. Default: the preset's dtype for all."""
        return {name: preset.dtype for name in self.output_names}

    def forbidden_callables(self) -> list[tuple[object, str]]:
        """(owner, attribute) pairs an engine must not call while it builds and runs, beyond this
        workload's `reference` (always guarded): oracles and baselines that would pass the check for
        free. An owner may be a `lazy` module (guarded where loaded; an engine's process never loads a
        `judge_only` one) and the attribute a dotted path (`"Class.method"`). Default: nothing more."""
        return []

    def timing_case(self, preset: Preset) -> CheckCase:
        """The case engines are timed on. Default: a check case at the preset shape, else the first
        check case's distribution at the preset shape."""
        cases = [case for stage in self.check_cases(preset) for case in stage]
        if not cases:
            raise ValueError(f"workload {self.name!r} has no check cases for preset {preset.name!r}")
        for case in cases:
            if dict(case.shape) == dict(preset.shape):
                return case
        return CheckCase(name=f"preset:{preset.name}", shape=dict(preset.shape), distribution=cases[0].distribution)

    def request_specs(self, preset: Preset) -> tuple[TensorSpec, ...]:
        """The HTTP request schema of an engine built for `preset`: one `TensorSpec` per input, whose
        first dim is the batch axis. Serving needs it; a workload without it cannot be served."""
        raise NotImplementedError(f"workload {self.name!r} ({type(self).__module__}.{type(self).__qualname__}) "
                                  f"declares no request schema: override request_specs(preset) to serve it")

    def example_request(self, preset: Preset, seed: int, **axes: int) -> dict:
        """Inputs of one request as a client would send them (CPU tensors; absent optionals left out),
        at the preset's shape with any free `axes` changed, e.g. `example_request(p, 3, T=128)`.
        Default: the timing case's distribution. The load generator sends these."""
        allowed = self.free_axes(preset)
        unknown = sorted(set(axes) - set(allowed))
        if unknown:
            raise ValueError(f"axes {unknown} are not free axes of {self.name}/{preset.name}; free: {sorted(allowed)}")
        like = self.timing_case(preset)
        case = CheckCase("example", {**preset.shape, **axes}, like.distribution, like.with_initial_state)
        return {k: v for k, v in self.make_inputs(case, preset.dtype, "cpu", seed).items() if v is not None}

    def kernel_facts(self, genome: Genome, preset: Preset, device: DeviceInfo,
                     compile: bool = True) -> tuple[KernelFacts, ...] | None:
        """The kernels `genome`'s engine launches at `preset` for `device`, compiled without running them
        (`compile`: registers, spills, shared memory) and modelled (bytes, time); `python -m evo kernels`
        prints them and the search's pre-screen (`search.prescreen_factor`) reads the modelled time.
        Default None: this workload has no compiled kernels. An empty tuple: this genome's engine has none."""
        return None

    def label(self, genome: Genome) -> str:
        """A readable name of `genome` for benchmark tables: the genes that matter most, and a short
        hash. Default: the short hash."""
        return genome.hash[:8]

    def _missing(self, hook: str) -> NotImplementedError:
        return NotImplementedError(f"workload {self.name!r} ({type(self).__module__}.{type(self).__qualname__}) "
                                   f"must override Workload.{hook}")
