"""Correctness policy: an engine against the workload's float64 reference, on fresh inputs.

`compare_outputs` is the policy every call of every engine is judged by (the evaluator applies it to
each call an isolated engine makes, see evaluators/judge/evaluator.py; Serve's replica verifies through the same
evaluator, `evaluators.served.engine`). `check_engine` runs the cascade on a trusted engine in this process (the
policy's own tests); untrusted engines never run in the caller's process.

For each case of each cascade stage (cheap stages first, stop at the first failing one) the check
draws fresh inputs, snapshots them, runs the engine and verifies, in order:

1. the inputs are unchanged after the call (engines must not write into their inputs);
2. the outputs read right after the call equal the outputs re-read after `settle_s` (no work deferred
   past return, e.g. a background thread still writing);
3. every declared output is present, a tensor, with the reference's shape and the expected dtype;
4. every output is finite (NaN/inf never pass) and not all zeros (unless the reference is);
5. norm-wise relative error <= tol and max abs error <= factor * tol * max|ref| (see settings.py). Where
   the workload gives the size of the terms an output is summed from (`Workload.reference_and_scales`:
   their root-sum-square) and the output's norm has cancelled below theirs, the terms' norm and largest
   element stand in for the reference's: a condition-aware bound, as a float32 sum's rounding follows
   its terms, not their cancelled result (for random-signed terms the two sizes are about equal).

Seeds come from a `SeedStream` (a per-evaluator counter mixed with a base seed and a secret salt), so
no seed repeats within one evaluator and an engine can never be tuned to, or predict, its inputs; each
stage ends with a second call of its first case on a fresh input set, so a cached answer cannot pass.
"""
from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from evo.workloads.base import CheckCase, Engine, Preset, Workload
from evaluators.judge.timing import sync


class SeedStream:
    """Fresh input seeds for one evaluator: derived from (base seed, name, salt, counter), never repeated.
    The evaluator passes a secret random `salt`, so nothing outside its process (an engine reading the
    run's config, say) can predict the inputs; with the default salt 0 the stream is reproducible."""

    def __init__(self, seed: int, name: str = "", salt: int = 0) -> None:
        self._entropy = [int(seed) & 0xFFFFFFFF, zlib.crc32(name.encode()), int(salt) & ((1 << 64) - 1)]
        self._counter = 0
        self._used: set[int] = set()

    def next(self) -> int:
        while True:
            seq = np.random.SeedSequence(self._entropy, spawn_key=(self._counter,))
            self._counter += 1
            # 63 bits: accepted by torch.manual_seed and numpy alike.
            hi, lo = (int(w) for w in seq.generate_state(2, np.uint32))
            seed = ((hi << 32) | lo) & ((1 << 63) - 1)
            if seed not in self._used:
                self._used.add(seed)
                return seed

    @property
    def drawn(self) -> int:
        return len(self._used)


@dataclass(frozen=True)
class CheckReport:
    """Outcome of the correctness cascade. `max_rel_error` is the worst norm-wise error seen."""

    passed: bool
    max_rel_error: float
    message: str
    cases_run: int = 0


class EngineCallError(RuntimeError):
    """The engine raised while running a check case; the original exception is `__cause__`."""

    def __init__(self, case: str, exc: BaseException) -> None:
        super().__init__(f"engine raised {type(exc).__name__} on check case {case!r}: {exc}")
        self.case = case


def expected_dtypes(workload: Workload, preset: Preset) -> dict[str, str]:
    """Output name -> dtype the engine must return: the workload's `output_dtypes(preset)` (by default
    the preset's I/O dtype for every output)."""
    return {**{name: preset.dtype for name in workload.output_names}, **workload.output_dtypes(preset)}


def check_engine(
    engine: Engine,
    workload: Workload,
    preset: Preset,
    stages: Sequence[Sequence[CheckCase]],
    seeds: SeedStream,
    *,
    device: str,
    tolerance: float,
    elementwise_factor: float,
    settle_s: float = 0.0,
) -> CheckReport:
    """Run the cascade; stop at the first failing stage. Raises EngineCallError if the engine raises."""
    dtypes = expected_dtypes(workload, preset)
    worst, run = math.nan, 0  # nan until a case has been compared
    for stage_index, stage in enumerate(stages):
        previous: Mapping[str, object] | None = None  # outputs of the previous call, as first read
        for case in _with_repeat(stage):
            where = f"stage {stage_index} case {case.name!r}"
            inputs = workload.make_inputs(case, preset.dtype, device, seeds.next())
            snapshot = _clone(inputs)
            try:
                outputs = engine(**inputs)
                sync(device)
            except Exception as exc:
                raise EngineCallError(case.name, exc) from exc
            run += 1
            first = _clone_outputs(outputs)  # what a caller reads right after the call returned
            changed = _changed_inputs(inputs, snapshot)
            if changed:
                return CheckReport(False, worst, f"{where}: engine modified its inputs in place: {changed}", run)
            reference, scales = workload.reference_and_scales(preset, snapshot)
            time.sleep(settle_s)
            sync(device)
            late = _changed_outputs(outputs, first)
            if late:
                return CheckReport(False, worst, f"{where}: outputs {late} changed after the engine returned"
                                   f" (work deferred past return, e.g. a background thread still writing)", run)
            problem, rel = compare_outputs(first, reference, dtypes, tolerance, elementwise_factor, scales)
            worst = worse(worst, rel)
            if problem:
                if previous is not None and not _changed_outputs(first, previous):
                    problem = ("returned exactly the outputs of the previous call on different inputs"
                               f" (cached or stale result): {problem}")
                return CheckReport(False, worst, f"{where}: {problem}", run)
            previous = first
    return CheckReport(True, worst, f"passed {run} cases in {len(stages)} stages (tol {tolerance:.1e})", run)


def _with_repeat(stage: Sequence[CheckCase]) -> list[CheckCase]:
    """The stage's cases plus its first case again (a fresh input set): two calls of one shape, so a
    cached answer cannot pass."""
    cases = list(stage)
    return cases + [replace(cases[0], name=f"{cases[0].name}#2")] if cases else cases


def compare_outputs(
    outputs: object,
    reference: Mapping[str, torch.Tensor],
    dtypes: Mapping[str, str],
    tolerance: float,
    elementwise_factor: float,
    scales: Mapping[str, torch.Tensor] | None = None,
) -> tuple[str, float]:
    """(problem or "", worst norm-wise relative error) of engine outputs against the reference. An output
    named in `scales` (the size of its terms) is measured against them where its norm is below theirs."""
    if not isinstance(outputs, Mapping):
        return f"engine must return a dict of outputs {sorted(dtypes)}, got {type(outputs).__name__}", math.nan
    worst = math.nan  # nan until an output has been measured
    for name, want_dtype in dtypes.items():
        if name not in outputs:
            return f"output {name!r} missing; got outputs {sorted(outputs)}", worst
        out, ref = outputs[name], reference[name]
        if not isinstance(out, torch.Tensor):
            return f"output {name!r} is a {type(out).__name__}, expected a torch.Tensor", worst
        if tuple(out.shape) != tuple(ref.shape):
            return f"output {name!r} has shape {tuple(out.shape)}, expected {tuple(ref.shape)}", worst
        if str(out.dtype).removeprefix("torch.") != want_dtype:
            return f"output {name!r} has dtype {out.dtype}, expected {want_dtype}", worst
        out64 = out.detach().to(torch.float64)
        ref64 = ref.detach().to(device=out64.device, dtype=torch.float64)
        if not torch.isfinite(ref64).all():
            raise ValueError(f"reference output {name!r} is not finite: the workload's reference or inputs are wrong")
        if not torch.isfinite(out64).all():
            bad = int((~torch.isfinite(out64)).sum())
            return f"output {name!r} has {bad} non-finite values (NaN/inf) of {out64.numel()}", math.inf
        ref_norm = float(torch.linalg.vector_norm(ref64))
        if ref_norm > 0 and not out64.any():
            return f"output {name!r} is all zeros (reference norm {ref_norm:.3e})", 1.0
        err = out64 - ref64
        norm, largest, of = _magnitude(ref64, ref_norm, (scales or {}).get(name))
        rel = float(torch.linalg.vector_norm(err)) / max(norm, torch.finfo(torch.float64).tiny)
        worst = worse(worst, rel)
        if rel > tolerance:
            return f"output {name!r} norm-wise relative error{of} {rel:.3e} > tolerance {tolerance:.1e}", worst
        max_err = float(err.abs().max()) if err.numel() else 0.0
        bound = elementwise_factor * tolerance * largest
        if max_err > bound:
            return (
                f"output {name!r} max abs error {max_err:.3e} > {elementwise_factor:g} x tol {tolerance:.1e}"
                f" x max|ref|{of} = {bound:.3e} (norm-wise {rel:.3e} passed)"
            ), worst
    return "", worst


def _magnitude(ref64: torch.Tensor, norm: float, terms: torch.Tensor | None) -> tuple[float, float, str]:
    """The norm and the largest element an output's error is measured against, and how a message names
    them: the reference's (its norm given), or the terms' where the workload gives them and the output
    cancelled below."""
    largest = float(ref64.abs().max()) if ref64.numel() else 0.0
    if terms is None:
        return norm, largest, ""
    terms64 = terms.detach().to(device=ref64.device, dtype=torch.float64)
    if tuple(terms64.shape) != tuple(ref64.shape) or not torch.isfinite(terms64).all():
        raise ValueError("the workload's size of an output's terms must be finite and shaped as the output")
    terms_norm = float(torch.linalg.vector_norm(terms64))
    if terms_norm <= norm:
        return norm, largest, ""
    return terms_norm, max(largest, float(terms64.abs().max())), " (against the size of its terms)"


def worse(a: float, b: float) -> float:
    """The larger error, ignoring nan (nan means 'not measured')."""
    if math.isnan(a):
        return b
    return a if math.isnan(b) else max(a, b)


def _clone(inputs: Mapping[str, object]) -> dict[str, object]:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _clone_outputs(outputs: object) -> object:
    if not isinstance(outputs, Mapping):
        return outputs
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in outputs.items()}


def _changed_outputs(outputs: object, first: object) -> list[str]:
    """Names of tensor outputs whose values differ from `first` (a clone taken earlier)."""
    if not isinstance(outputs, Mapping) or not isinstance(first, Mapping):
        return []
    return [k for k in _tensor_keys(first) if not _same(outputs.get(k), first[k])]


def _changed_inputs(inputs: Mapping[str, object], snapshot: Mapping[str, object]) -> list[str]:
    return [k for k in _tensor_keys(snapshot) if not _same(inputs[k], snapshot[k])]


def _tensor_keys(values: Mapping[str, object]) -> Iterable[str]:
    return (k for k, v in values.items() if isinstance(v, torch.Tensor))


def _same(a: object, b: torch.Tensor) -> bool:
    if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a, b) or torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))
