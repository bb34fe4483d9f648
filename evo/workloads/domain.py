"""The input domain a workload declares: every shape and value its engines are verified for.

A `Workload.domain(preset)` is an `InputDomain`: each free shape axis as an integer range (with a
modulus whose multiples are where chunked engines change behaviour) and each input's value range
(e.g. a log decay bounded below, a gate in [0, 1]). The evaluator verifies engines over it: the
fixed check cases, plus cases drawn at random over the whole domain on every evaluation
(`Workload.draw_cases`). Serve refuses every request outside it, naming the bound.

A workload whose engines can go wrong on a narrow part of the domain declares that part as a band and
draws stratified: every band is reached in every evaluation by construction, not by chance (e.g. KDA
sweeps every residue of T modulo its largest chunk, `AxisRange.residue_sweep`; see its `domain.py`).

The default domain is the one a workload's `free_axes` span (each axis from its smallest to its
largest listed value), with no value bounds; `draw_cases` then defaults to `draw_over_axes` here.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping

import numpy as np

from evo.workloads.requests import TensorSpec


@dataclass(frozen=True)
class AxisRange:
    """One free shape axis: every integer in [lo, hi] is verified. `modulus` (0: none) is where the
    axis is chunked, e.g. the largest chunk size: draws sweep every residue modulo it (a ragged last
    chunk of every length, for every chunk size that divides it; `residue_sweep`, `with_residue`)."""

    lo: int
    hi: int
    modulus: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.lo <= self.hi:  # 0: an axis that may be empty (e.g. no tokens to decode)
            raise ValueError(f"an axis range needs 0 <= lo <= hi, got [{self.lo}, {self.hi}]")
        if self.modulus < 0:
            raise ValueError(f"modulus must be >= 0 (0: none), got {self.modulus}")

    def __contains__(self, value: object) -> bool:
        return isinstance(value, (int, np.integer)) and self.lo <= int(value) <= self.hi

    def uniform(self, rng: np.random.Generator, lo: int | None = None, hi: int | None = None) -> int:
        """A value uniform in [lo, hi] clipped to this range (default: the whole range)."""
        a, b = max(self.lo, self.lo if lo is None else lo), min(self.hi, self.hi if hi is None else hi)
        if a > b:
            raise ValueError(f"no value of [{self.lo}, {self.hi}] lies in [{lo}, {hi}]")
        return int(rng.integers(a, b + 1))

    def residue_sweep(self, rng: np.random.Generator) -> list[int]:
        """Every residue modulo `modulus` once (0, 1, ..., modulus - 1; [0] without a modulus), in random
        order: draws that take one value per residue (`with_residue`) reach the ragged last chunk of every
        length, of every chunk size that divides the modulus, by construction rather than by chance."""
        return [int(r) for r in rng.permutation(self.modulus or 1)]

    def with_residue(self, rng: np.random.Generator, residue: int, lo: int | None = None,
                     hi: int | None = None) -> int:
        """A value uniform among those of [lo, hi] (clipped to this range) equal to `residue` modulo
        `modulus` (any value without a modulus)."""
        m = self.modulus or 1
        a, b = max(self.lo, self.lo if lo is None else lo), min(self.hi, self.hi if hi is None else hi)
        first = a + (residue - a) % m
        if first > b:
            raise ValueError(f"no value of [{a}, {b}] is {residue} modulo {m}; widen the interval to at least {m} values")
        return first + m * int(rng.integers(0, (b - first) // m + 1))


@dataclass(frozen=True)
class ValueRange:
    """The values one input may hold, inclusive; None: unbounded on that side."""

    lo: float | None = None
    hi: float | None = None


@dataclass(frozen=True)
class InputDomain:
    """Every input an engine is verified for: free axes as ranges, inputs' values as ranges.

    Axes not named here are fixed at the preset's value (the engine is built for them)."""

    axes: Mapping[str, AxisRange]
    values: Mapping[str, ValueRange] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", MappingProxyType(dict(self.axes)))
        object.__setattr__(self, "values", MappingProxyType(dict(self.values)))

    @classmethod
    def from_free_axes(cls, free_axes: Mapping[str, tuple[int, ...]]) -> InputDomain:
        """The default: each free axis from its smallest to its largest listed value."""
        return cls({axis: AxisRange(int(min(v)), int(max(v))) for axis, v in free_axes.items() if v})

    def outside(self, shape: Mapping[str, int], fixed: Mapping[str, int] = MappingProxyType({})) -> str | None:
        """Why `shape` lies outside the domain (an axis beyond its range, or a fixed axis not at its
        value in `fixed`), or None when it lies inside."""
        for axis, value in shape.items():
            if axis in self.axes:
                bound = self.axes[axis]
                if value not in bound:
                    return f"{axis}={value} is outside the verified range [{bound.lo}, {bound.hi}]"
            elif axis in fixed and value != fixed[axis]:
                return f"{axis}={value} but {axis} is fixed at {fixed[axis]}"
        return None

    def axis_bounds(self) -> dict[str, tuple[int, int]]:
        """{axis: (lo, hi)}: what Serve checks each request's free dims against."""
        return {axis: (r.lo, r.hi) for axis, r in self.axes.items()}

    def bound_specs(self, specs: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
        """`specs` with each input's value bounds narrowed to this domain's (the tighter of both)."""
        def tighter(a: float | None, b: float | None, pick) -> float | None:
            return b if a is None else a if b is None else pick(a, b)

        out = []
        for spec in specs:
            allowed = self.values.get(spec.name, ValueRange())
            lo, hi = spec.bounds
            out.append(replace(spec, bounds=(tighter(lo, allowed.lo, max), tighter(hi, allowed.hi, min))))
        return tuple(out)


def draw_over_axes(domain: InputDomain, shape: Mapping[str, int],
                   rng: np.random.Generator) -> list[tuple[str, dict[str, int]]]:
    """(name, shape) of the default random cases of one evaluation: for each axis with a range, one
    with that axis uniform over it (the others at the preset's `shape`, clipped into the domain), and
    one with every axis drawn at once; none for a domain without ranges (a workload of fixed shape)."""
    varying = [axis for axis, r in domain.axes.items() if r.lo < r.hi]
    if not varying:
        return []
    base = {a: min(max(v, domain.axes[a].lo), domain.axes[a].hi) if a in domain.axes else v for a, v in shape.items()}
    shapes = [(f"draw_{axis}", {**base, axis: domain.axes[axis].uniform(rng)}) for axis in varying]
    return shapes + [("draw_joint", {**base, **{axis: domain.axes[axis].uniform(rng) for axis in varying}})]
