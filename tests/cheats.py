"""Cheating engines, kept as fixtures: each must be rejected by the evaluator, or gain nothing from it.

`CheatWorkload(base)` is the base workload (KDA, llama or the fake one) with one more gene, `cheat`: "none"
builds the honest engine, any other value wraps the honest engine in that cheat. It is registered
like any workload, so the cheats go through the evaluator's full path (build, first call, check,
timing) with every guard the evaluator applies to every engine.

CHEATS lists the cheats that must come back 'incorrect'. DOMAIN_CHEATS (KDA) and LLAMA_DOMAIN_CHEATS
(llama, `tests/llama_cheats.py`) are right everywhere but on a band of the input domain no fixed check
case reaches: the cases drawn over the domain, stratified so that every band is drawn in every
evaluation, must make them 'incorrect' every time (tests/test_domain.py; `WHERE_WRONG` says where each
is wrong, so a test can show each evaluation's draws reach it). PROBES lists engines that try to tell checks
from timed calls (or to fool the judge's clock) and cheat only when they think they can: the judge
gives them nothing to tell apart, so they must never come back 'ok' at a latency their cheat bought.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Mapping

import numpy as np
import torch

from evaluators.judge.check import expected_dtypes
from evo.core.genome import Gene, GeneSpace, Genome
from evo.workloads.domain import InputDomain
from evo.workloads.base import NO_SOURCES, CheckCase, DeviceInfo, Engine, MachineRates, Preset, Roofline, Workload
from tests.delegating_workload import DelegatingWorkload

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
    # issue 9: timing never verified
    "correct_then_zeros": ("timing", "right for its first 3 calls, then zeros (padded to stay above the floor)"),
    "correct_then_previous": ("timing", "right for its first 3 calls, then its previous output"),
    "cache_by_pointer": ("timing", "caches outputs by the inputs' data pointers and shapes"),
    "cache_by_slice": ("timing", "caches outputs by a coarse hash of a slice of the first input"),
    "lazy_output": ("timing", "returns a tensor subclass that computes its values when first read"),
    # issue 9: the engine shares a process with its judge
    "patch_comparison": ("process", "patches the judge's comparison and the workload's reference class "
                                    "attribute at build, then returns zeros"),
    "patch_timer": ("process", "patches time.perf_counter and the evaluator's floor at build, returns zeros"),
    # issue 9: the guard against calling the reference has gaps
    "alias_reference": ("guard", "calls the reference through a name bound before any guard went up"),
    "lazy_reference": ("guard", "returns an output that calls the reference when it is read"),
    # issue 9: batch size and head count never varied
    "batch1_only": ("axes", "right for B=1 only: every batch element gets element 0's answer"),
    "heads_upto_preset": ("axes", "right only up to the preset's head count (KDA H, fake D)"),
}

# issue 23: the cascade checked a few points of each free axis and value range; users send the rest.
# Each is right everywhere but on a part of the domain no fixed check case reaches (KDA only).
DOMAIN_CHEATS: dict[str, str] = {
    "batch_3_to_7": "wrong only for B in 3..7 (the fixed cases check B = 1, 2 and 8)",
    "batch_over_2_long": "wrong only for B > 2 at T > 77",
    "ragged_64": "wrong only for T > 64 with T % 64 in 1..12 (a short last chunk of 64)",
    "beta_zero": "wrong only on tokens whose beta is exactly 0",
    "beyond_4t": "wrong only for T beyond 4x the preset's T",
    "correlated_keys": "wrong only when consecutive keys point almost the same way",
    "decay_floor": "wrong only when g sits at the domain's floor (log decay -5) on over 1% of its entries",
    # issue 28: the domain's bands
    "no_norm_eps": "normalises q and k as x / |x| (F.normalize), without the norm's epsilon: off by ~3e-2 "
                   "at norms ~1e-3",
    "ragged_128_60_62": "wrong only for T % 128 in 60..62 (a narrow band of the largest chunk's residues)",
}
LLAMA_DOMAIN_CHEATS: dict[str, str] = {
    "last_vocab_id": "wrong only when the vocabulary's last id (V-1) is in the prompt or the continuation",
}

# Engines that cheat only when they believe a call is timed, not checked (or that the judge's clock is theirs).
PROBES: dict[str, str] = {
    "probe_flags": "cheats whenever torch's deterministic/poisoning flags differ from those at its first call",
    "probe_stack": "cheats whenever its call stack differs from the one at its first call",
    "probe_gap": "cheats when called again within 1 ms of its previous return (back-to-back timing loop)",
    "probe_clock": "slows time.perf_counter 100x in its process at build and computes honestly",
}
NONE = "none"


class CheatWorkload(DelegatingWorkload):
    """The base workload plus the `cheat` gene. Everything but `build` and the gene space delegates."""

    def gene_space(self, preset: Preset, device: DeviceInfo) -> GeneSpace:
        honest = self.base.gene_space(preset, device)
        cheat = Gene("cheat", "fusion", _gene_values(), NONE, "which cheat wraps the honest engine")
        return GeneSpace(self.name, (*honest.genes, cheat), honest.constraints, ignored=honest.ignored,
                         pipeline=honest.pipeline)

    def build(self, genome: Genome, preset: Preset, device: DeviceInfo,
              sources: Mapping[str, str] = NO_SOURCES) -> Engine:
        values = genome.values()
        cheat = values.pop("cheat")
        honest = self.base.build(self.base.gene_space(preset, device).make(values), preset, device, sources)
        return honest if cheat == NONE else _WRAPPERS[cheat](honest, self, preset)


def _gene_values() -> tuple[str, ...]:
    return (NONE, *CHEATS, *PROBES, *DOMAIN_CHEATS, *LLAMA_DOMAIN_CHEATS)


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


# ---- issue 9 -----------------------------------------------------------------------------------------
from evo.workloads.kda.reference import reference as _oracle_bound_early  # noqa: E402 - before any guard
from tests.fake_workload import FakeWorkload as _Fake  # noqa: E402

_fake_reference_bound_early = _Fake.reference  # the plain function, bound before any guard went up


def _pad(seconds: float = 0.0005) -> None:
    time.sleep(seconds)  # keeps a cheat's latency above the roofline floor


def _correct_then(after: Callable[[dict, dict], dict]):
    def wrap(honest, w, preset):
        state = {"calls": 0, "last": None}

        def engine(**x):
            state["calls"] += 1
            if state["calls"] <= 3 or state["last"] is None:
                out = honest(**x)
            else:
                _pad()
                out = after(x, state["last"])
            state["last"] = {k: v.clone() for k, v in out.items()}
            return out
        return engine
    return wrap


def _cache_by(key_of: Callable[[dict], object]):
    def wrap(honest, w, preset):
        cache: dict = {}

        def engine(**x):
            key = key_of(x)
            if key not in cache:
                cache[key] = {k: v.clone() for k, v in honest(**x).items()}
            return {k: v.clone() for k, v in cache[key].items()}
        return engine
    return wrap


def _pointer_key(x: dict) -> tuple:
    return tuple((k, v.data_ptr(), tuple(v.shape)) for k, v in _tensors(x).items())


def _slice_key(x: dict) -> tuple:
    first = next(iter(_tensors(x).values()))
    return tuple(first.shape), round(float(first.flatten()[0]))  # ~5 buckets for N(0, 1) inputs


class _Lazy(torch.Tensor):
    """A tensor subclass whose values are computed on first use (what a caller reads, not what was timed)."""

    compute: Callable[[], torch.Tensor] | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for a in args:
            if isinstance(a, _Lazy) and a.compute is not None:
                fill, a.compute = a.compute, None
                with torch._C.DisableTorchFunctionSubclass():
                    a.copy_(fill())
        return super().__torch_function__(func, types, args, kwargs or {})


def _lazy(source: str):
    """Outputs are `_Lazy` tensors whose values come, on first use, from the honest engine ("honest") or
    from the workload's reference ("reference"); the first call of each input shape is computed honestly
    to learn the output shapes."""
    def wrap(honest, w, preset):
        dtypes = expected_dtypes(w.base, preset)
        shapes: dict[tuple, dict] = {}

        def engine(**x):
            key = tuple((k, tuple(v.shape)) for k, v in _tensors(x).items())
            if key not in shapes:
                out = honest(**x)
                shapes[key] = {k: (v.shape, v.dtype) for k, v in out.items()}
                return out
            inputs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in x.items()}
            later = (lambda: honest(**inputs)) if source == "honest" else (lambda: _cast(w.base.reference(inputs), dtypes))
            memo: dict = {}
            out = {}
            for k, (shape, dtype) in shapes[key].items():
                lazy = torch.Tensor._make_subclass(_Lazy, torch.zeros(shape, dtype=dtype))
                lazy.compute = (lambda k=k: memo.setdefault("v", later())[k])
                out[k] = lazy
            return out
        return engine
    return wrap


def _patch_comparison(honest, w, preset):
    import evaluators.judge.check as check

    check.compare_outputs = lambda *a, **k: ("", 0.0)
    type(w.base).reference = lambda self, inputs: {k: torch.zeros(1) for k in self.output_names}
    return lambda **x: {k: torch.zeros_like(v) for k, v in honest(**x).items()}


def _patch_timer(honest, w, preset):
    real = time.perf_counter
    time.perf_counter = lambda: real() / 100.0
    try:  # the strict sandbox hides the judge's modules: nothing to patch there
        import evaluators.judge.evaluator as evaluator
        evaluator.Evaluator._below_floor = lambda self, latency_ms: False
    except ImportError:
        pass
    return lambda **x: {k: torch.zeros_like(v) for k, v in honest(**x).items()}


def _alias_reference(honest, w, preset):
    dtypes = expected_dtypes(w.base, preset)
    oracle = _oracle_bound_early if w.base.name == "kda" else _fake_reference_bound_early
    return lambda **x: _cast(oracle(w.base, x) if oracle is _fake_reference_bound_early else oracle(x), dtypes)


def _batch1_only(honest, w, preset):
    def engine(**x):
        B = next(iter(_tensors(x).values())).shape[0]
        first = honest(**{k: v[:1] if isinstance(v, torch.Tensor) else v for k, v in x.items()})
        return {k: v.expand(B, *v.shape[1:]).contiguous() for k, v in first.items()}
    return engine


def _heads_upto_preset(honest, w, preset):
    limit = preset.shape["H"] if "H" in preset.shape else preset.shape["D"]

    def engine(**x):
        out = honest(**x)
        if next(iter(_tensors(x).values())).shape[2] > limit:
            out = {k: v.clone() for k, v in out.items()}
            main = next(iter(out))
            out[main].select(2, -1).zero_()  # the head (channel) past the preset's count
        return out
    return engine


def _probe(detects: Callable[[dict], bool]):
    """Honest while the probe says 'checked'; zeros (padded) when it says 'timed'."""
    def wrap(honest, w, preset):
        state: dict = {}

        def engine(**x):
            if detects(state):
                _pad()
                out = {k: torch.zeros_like(v) for k, v in honest(**x).items()}
            else:
                out = honest(**x)
            state["returned"] = time.perf_counter()
            return out
        return engine
    return wrap


def _flags_differ(state: dict) -> bool:
    flags = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory)
    return state.setdefault("flags", flags) != flags


def _stack_differs(state: dict) -> bool:
    import inspect

    stack = tuple(f.function for f in inspect.stack()[2:])
    return state.setdefault("stack", stack) != stack


def _back_to_back(state: dict) -> bool:
    return "returned" in state and time.perf_counter() - state["returned"] < 0.001


def _probe_clock(honest, w, preset):
    real = time.perf_counter
    time.perf_counter = lambda: real() / 100.0
    return honest


# ---- issue 23 -----------------------------------------------------------------------------------------
def _wrong_when(condition: Callable[[dict, Preset], bool]):
    """Honest, but o off by 1% whenever `condition(inputs, preset)` holds."""
    def wrap(honest, w, preset):
        def engine(**x):
            out = honest(**x)
            return {**out, "o": out["o"] * 1.01} if condition(x, preset) else out
        return engine
    return wrap


def _beta_zero(honest, w, preset):
    def engine(**x):
        out = honest(**x)
        zero = (x["beta"] == 0)[..., None]  # [B, T, H, 1]
        return {**out, "o": torch.where(zero, out["o"] * 1.01, out["o"])} if zero.any() else out
    return engine


def _consecutive_cosine(k: torch.Tensor) -> float:
    k = torch.nn.functional.normalize(k.float(), dim=-1)  # [B, T, H, K]
    return float((k[:, 1:] * k[:, :-1]).sum(-1).mean()) if k.shape[1] > 1 else 0.0


def _no_norm_eps(honest, w, preset):
    """q and k scaled to unit norm by x / max(|x|, 1e-12) before the honest engine, whose own norm (with
    its epsilon) then changes them by ~5e-7: the engine computes l2norm without the epsilon."""
    def engine(**x):
        unit = {n: torch.nn.functional.normalize(x[n].float(), dim=-1).to(x[n].dtype) for n in ("q", "k")}
        return honest(**{**x, **unit})
    return engine


def _near_zero_norm(x: dict, p: Preset) -> bool:
    """Some q or k vector with a norm where the epsilon matters: below 1e-2 (and not exactly zero)."""
    norms = torch.cat([x["q"].float().norm(dim=-1).flatten(), x["k"].float().norm(dim=-1).flatten()])
    return bool(((norms > 0) & (norms < 1e-2)).any())


def _last_vocab_id(x: dict, p: Preset) -> bool:
    return any(bool((x[n] == p.shape["V"] - 1).any()) for n in ("prompt", "continuation"))


def _wrong_logits_when(condition: Callable[[dict, Preset], bool]):
    """Honest, but logits off by 1% whenever `condition(inputs, preset)` holds (the llama engine)."""
    def wrap(honest, w, preset):
        def engine(**x):
            out = honest(**x)
            return {**out, "logits": out["logits"] * 1.01} if condition(x, preset) else out
        return engine
    return wrap


# where each domain cheat is wrong: (inputs, preset) -> bool (no_norm_eps: where its error passes the tolerance)
WHERE_WRONG: dict[str, Callable[[dict, Preset], bool]] = {
    "batch_3_to_7": lambda x, p: 3 <= x["q"].shape[0] <= 7,
    "batch_over_2_long": lambda x, p: x["q"].shape[0] > 2 and x["q"].shape[1] > 77,
    "ragged_64": lambda x, p: x["q"].shape[1] > 64 and 1 <= x["q"].shape[1] % 64 <= 12,
    "beta_zero": lambda x, p: bool((x["beta"] == 0).any()),
    "beyond_4t": lambda x, p: x["q"].shape[1] > 4 * p.shape["T"],
    "correlated_keys": lambda x, p: _consecutive_cosine(x["k"]) > 0.9,
    "decay_floor": lambda x, p: float((x["g"] <= -5.0).float().mean()) > 0.01,
    "no_norm_eps": _near_zero_norm,
    "ragged_128_60_62": lambda x, p: x["q"].shape[1] % 128 in (60, 61, 62),
    "last_vocab_id": _last_vocab_id,
}

_DOMAIN_WRAPPERS: dict[str, Callable] = {
    **{name: _wrong_when(WHERE_WRONG[name]) for name in DOMAIN_CHEATS if name not in ("beta_zero", "no_norm_eps")},
    "beta_zero": _beta_zero,
    "no_norm_eps": _no_norm_eps,
    "last_vocab_id": _wrong_logits_when(_last_vocab_id),
}

_WRAPPERS: dict[str, Callable] = {
    "zeros": _zeros, "constant": _constant, "inplace": _inplace, "memoise": _memoise,
    "memoise_by_shape": _memoise_by_shape, "bf16": _bf16, "fixed_seed": _fixed_seed,
    "preset_shape_only": _preset_shape_only, "half_written": _half_written,
    "half_written_stale": _half_written_stale, "deferred": _deferred, "calls_reference": _calls_reference,
    "calls_reference_swallowed": _calls_reference_swallowed, "calls_baseline": _calls_baseline,
    "correct_then_zeros": _correct_then(lambda x, last: {k: torch.zeros_like(v) for k, v in last.items()}),
    "correct_then_previous": _correct_then(lambda x, last: {k: v.clone() for k, v in last.items()}),
    "cache_by_pointer": _cache_by(_pointer_key), "cache_by_slice": _cache_by(_slice_key),
    "lazy_output": _lazy("honest"), "lazy_reference": _lazy("reference"),
    "patch_comparison": _patch_comparison, "patch_timer": _patch_timer, "alias_reference": _alias_reference,
    "batch1_only": _batch1_only, "heads_upto_preset": _heads_upto_preset,
    "probe_flags": _probe(_flags_differ), "probe_stack": _probe(_stack_differs), "probe_gap": _probe(_back_to_back),
    "probe_clock": _probe_clock,
}
_WRAPPERS.update(_DOMAIN_WRAPPERS)
assert set(_WRAPPERS) == set(CHEATS) | set(PROBES) | set(DOMAIN_CHEATS) | set(LLAMA_DOMAIN_CHEATS)
assert set(WHERE_WRONG) == set(DOMAIN_CHEATS) | set(LLAMA_DOMAIN_CHEATS)


def _kda() -> CheatWorkload:
    from evo.workloads.kda import WORKLOAD as kda

    return CheatWorkload(kda, "kda_cheats")


WORKLOAD = _kda()


def genome_json(workload: CheatWorkload, preset: str, cheat: str, device: DeviceInfo) -> str:
    """The base workload's default genome with `cheat` set."""
    space = workload.gene_space(workload.presets()[preset], device)
    return space.make({**space.default().values(), "cheat": cheat}).to_json()
