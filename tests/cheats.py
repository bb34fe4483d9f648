"""Cheating engines, kept as fixtures: each must be rejected by the evaluator ('incorrect', never 'ok').

`CheatWorkload(base)` is the base workload (KDA or the fake one) with one more gene, `cheat`: "none"
builds the honest engine, any other value wraps the honest engine in that cheat. It is registered
like any workload, so the cheats go through the evaluator's full path (build, first call, check,
timing) with every guard the evaluator applies to every engine.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from evaluators.check import expected_dtypes
from evo.genome import Gene, GeneSpace, Genome
from evo.workloads.base import CheckCase, DeviceInfo, Engine, MachineRates, Preset, Roofline

# cheat -> (class in the issue, what it does)
CHEATS: dict[str, tuple[str, str]] = {
    "zeros": ("a", "returns zeros"),
    "constant": ("a", "returns a constant"),
    "inplace": ("b", "computes the right answer, then scales an input in place"),
    "memoise": ("c", "returns its first result for every later call"),
    "memoise_by_shape": ("c", "returns the first result it computed for each input shape"),
    "bf16": ("d", "computes a float32 preset from bfloat16-rounded inputs and outputs"),
    "fixed_seed": ("e", "returns an answer precomputed at build time for the preset shape (seed 0)"),
    "preset_shape_only": ("e", "right at the preset's T, last time step zeroed at any other T"),
    "half_written": ("f", "torch.empty output, only the first half of T written"),
    "half_written_stale": ("f", "as half_written, after freeing a block that held the full answer"),
    "deferred": ("g", "returns empty outputs that a background thread fills 2 ms later"),
    "calls_reference": ("h", "returns the workload's float64 reference, cast"),
    "calls_reference_swallowed": ("h", "calls the reference, catches the guard's error, then computes honestly"),
    "calls_baseline": ("h", "returns a baseline's answer (KDA: chunk_pairwise)"),
}
NONE = "none"


class CheatWorkload:
    """The base workload plus the `cheat` gene. Everything but `build` and the gene space delegates."""

    def __init__(self, base, name: str) -> None:
        self.base = base
        self.name = name
        self.input_names = base.input_names
        self.output_names = base.output_names

    def presets(self) -> dict[str, Preset]:
        return self.base.presets()

    def gene_space(self, preset: Preset, device: DeviceInfo) -> GeneSpace:
        honest = self.base.gene_space(preset, device)
        cheat = Gene("cheat", "fusion", (NONE, *CHEATS), NONE, "which cheat wraps the honest engine")
        return GeneSpace(self.name, (*honest.genes, cheat), honest.constraints)

    def check_cases(self, preset: Preset) -> list[list[CheckCase]]:
        return self.base.check_cases(preset)

    def make_inputs(self, case: CheckCase, dtype: str, device: str, seed: int) -> dict:
        return self.base.make_inputs(case, dtype, device, seed)

    def output_dtypes(self, preset: Preset) -> dict[str, str]:
        return expected_dtypes(self.base, preset)

    def reference(self, inputs: dict) -> dict:
        return self.base.reference(inputs)

    def forbidden_callables(self) -> list[tuple[object, str]]:
        declared = getattr(self.base, "forbidden_callables", None)
        return [(self.base, "reference"), *(declared() if callable(declared) else [])]

    def baselines(self, preset: Preset) -> dict:
        return self.base.baselines(preset)

    def roofline(self, preset: Preset, rates: MachineRates) -> Roofline:
        return self.base.roofline(preset, rates)

    def build(self, genome: Genome, preset: Preset, device: DeviceInfo) -> Engine:
        values = genome.values()
        cheat = values.pop("cheat")
        honest = self.base.build(self.base.gene_space(preset, device).make(values), preset, device)
        return honest if cheat == NONE else _WRAPPERS[cheat](honest, self, preset)


def _cast(outputs: dict, dtypes: dict[str, str]) -> dict:
    return {k: outputs[k].to(getattr(torch, d)).contiguous() for k, d in dtypes.items()}


def _tensors(inputs: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}


def _zeros(honest, w, preset):
    return lambda **x: {k: torch.zeros_like(v) for k, v in honest(**x).items()}


def _constant(honest, w, preset):
    return lambda **x: {k: torch.full_like(v, 0.5) for k, v in honest(**x).items()}


def _inplace(honest, w, preset):
    def engine(**x):
        out = honest(**x)
        first = next(iter(_tensors(x).values()))
        first.mul_(2.0)  # after computing: the outputs are right, the caller's input is not
        return out
    return engine


def _memoise(honest, w, preset):
    cache: list[dict] = []

    def engine(**x):
        if not cache:
            cache.append({k: v.clone() for k, v in honest(**x).items()})
        return {k: v.clone() for k, v in cache[0].items()}
    return engine


def _memoise_by_shape(honest, w, preset):
    cache: dict[tuple, dict] = {}

    def engine(**x):
        key = tuple((k, tuple(v.shape)) for k, v in _tensors(x).items())
        if key not in cache:
            cache[key] = {k: v.clone() for k, v in honest(**x).items()}
        return {k: v.clone() for k, v in cache[key].items()}
    return engine


def _bf16(honest, w, preset):
    dtypes = expected_dtypes(w.base, preset)

    def engine(**x):
        low = {k: v.to(torch.bfloat16).to(v.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
               for k, v in x.items()}
        return _cast({k: v.to(torch.bfloat16) for k, v in honest(**low).items()}, dtypes)
    return engine


def _fixed_seed(honest, w, preset):
    case = CheckCase("build", dict(preset.shape), w.check_cases(preset)[0][0].distribution)
    precomputed = {k: v.clone() for k, v in honest(**w.make_inputs(case, preset.dtype, preset.device, 0)).items()}

    def engine(**x):
        out = honest(**x)
        same = all(out[k].shape == v.shape for k, v in precomputed.items())
        return {k: v.clone() for k, v in precomputed.items()} if same else out
    return engine


def _preset_shape_only(honest, w, preset):
    def engine(**x):
        out = honest(**x)
        if out["o"].shape[1] != preset.shape["T"]:
            out["o"] = out["o"].clone()
            out["o"][:, -1] = 0  # o: [B, T, ...]
        return out
    return engine


def _half_written(honest, w, preset):
    def engine(**x):
        out = honest(**x)
        T = out["o"].shape[1]
        o = torch.empty_like(out["o"])
        o[:, : T // 2] = out["o"][:, : T // 2]
        return {**out, "o": o}
    return engine


def _half_written_stale(honest, w, preset):
    def engine(**x):
        out = honest(**x)
        full = out.pop("o")
        T, shape, dtype = full.shape[1], full.shape, full.dtype
        first_half = full[:, : T // 2].clone()
        del full  # the block that held the whole answer goes back to the allocator...
        o = torch.empty(shape, dtype=dtype, device=first_half.device)  # ...and likely comes straight back
        o[:, : T // 2] = first_half
        return {**out, "o": o}
    return engine


def _deferred(honest, w, preset):
    def engine(**x):
        out = honest(**x)
        late = {k: torch.empty_like(v) for k, v in out.items()}

        def finish() -> None:
            time.sleep(0.002)
            for k, v in out.items():
                late[k].copy_(v)
        threading.Thread(target=finish, daemon=True).start()
        return late
    return engine


def _calls_reference(honest, w, preset):
    dtypes = expected_dtypes(w.base, preset)
    return lambda **x: _cast(w.base.reference(x), dtypes)


def _calls_reference_swallowed(honest, w, preset):
    def engine(**x):
        try:
            w.base.reference(x)
        except Exception:
            pass
        return honest(**x)
    return engine


def _calls_baseline(honest, w, preset):
    dtypes = expected_dtypes(w.base, preset)

    def engine(**x):
        if w.base.name != "kda":
            return _cast(w.base.reference(x), dtypes)
        from evo.workloads.kda import baselines

        return _cast(baselines.chunk_pairwise(**x), dtypes)
    return engine


_WRAPPERS: dict[str, Callable] = {
    "zeros": _zeros, "constant": _constant, "inplace": _inplace, "memoise": _memoise,
    "memoise_by_shape": _memoise_by_shape, "bf16": _bf16, "fixed_seed": _fixed_seed,
    "preset_shape_only": _preset_shape_only, "half_written": _half_written,
    "half_written_stale": _half_written_stale, "deferred": _deferred, "calls_reference": _calls_reference,
    "calls_reference_swallowed": _calls_reference_swallowed, "calls_baseline": _calls_baseline,
}
assert set(_WRAPPERS) == set(CHEATS)


def _kda() -> CheatWorkload:
    from evo.workloads.kda import WORKLOAD as kda

    return CheatWorkload(kda, "kda_cheats")


WORKLOAD = _kda()


def genome_json(workload: CheatWorkload, preset: str, cheat: str, device: DeviceInfo) -> str:
    """The base workload's default genome with `cheat` set."""
    space = workload.gene_space(workload.presets()[preset], device)
    return space.make({**space.default().values(), "cheat": cheat}).to_json()
