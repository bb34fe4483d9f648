"""Evaluator settings: every option declared once, with its default, its doc and its check.

Tolerance policy
----------------
An engine passes a correctness case when, for every output, both bounds hold (errors computed in
float64 against the float64 reference, which is fed the very same inputs the engine saw):

* norm-wise: ``||out - ref||_2 / ||ref||_2 <= tol[dtype]``
* element-wise: ``max|out - ref| <= elementwise_factor * tol[dtype] * max|ref|``

``dtype`` is the preset's input/output dtype, never the engine's internal compute dtype: an engine
that computes a float32 preset in bfloat16 is judged by the float32 bound and fails.

* float32 (unit roundoff u = 6e-8): 1e-5 leaves ~100x room for a different summation order over
  long recurrences and chunked reformulations, yet catches any bf16/tf32 shortcut (~1e-3).
* bfloat16 (u = 3.9e-3): 6e-3 covers rounding the outputs to bfloat16 (~1e-3 norm-wise) plus
  bf16 intermediates, and still catches wrong math (errors of order 1).

The element-wise bound catches a few badly wrong elements that a norm over millions would hide.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping


DEFAULT_TOLERANCES: dict[str, float] = {"float32": 1e-5, "bfloat16": 6e-3}

# A generation objective that an engine could game by holding tokens back, and the SLO key it is scored under:
# TPOT alone rewards an engine that holds each request's first token until its last is made (then its TPOT
# is ~0), TTFT alone one that sends a first token at once and then crawls. A timed replay past the bound is
# not ranked (evaluators.judge.generation).
OBJECTIVE_BOUNDS: dict[str, str] = {"tpot_p99_ms": "ttft_ms", "tpot_median_ms": "ttft_ms", "ttft_p99_ms": "tpot_ms"}


PLACEMENTS = ("auto", "gpu", "cpu")  # where evaluators go (PoolSettings.placement; evaluators.pool.placement)


def _option(default: Any, doc: str, check: Callable[[Any], bool], *, factory: bool = False, **kw: Any) -> Any:
    """A dataclass field carrying its doc and its validity check in the metadata."""
    meta = {"doc": doc, "check": check}
    if factory:
        return field(default_factory=default, metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _count(minimum: int) -> Callable[[Any], bool]:
    return lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= minimum


def _tolerances_ok(x: Any) -> bool:
    return isinstance(x, Mapping) and len(x) > 0 and all(isinstance(k, str) and _positive(v) for k, v in x.items())


# the accuracy contract (`evaluators.judge.accuracy`): its modes and the keys of `evaluator.accuracy`
ACCURACY_MODES = ("exact", "budget")
BUDGET_KEYS = ("min_agreement", "max_mean_gap", "max_gap", "tie_window", "tie_alpha", "request_alpha")
_ACCURACY_KEYS = ("mode", "against", "factor", *BUDGET_KEYS)


def accuracy_mode(accuracy: Mapping, dtype: str) -> str:
    """The mode `evaluator.accuracy` declares for a preset of `dtype`: its `mode`, else exact at float32 or float64
    and budget at a lower precision (whose honest engines cannot give float64's tokens)."""
    return accuracy.get("mode") or ("exact" if dtype in ("float32", "float64") else "budget")


def accuracy_problem(accuracy: Mapping) -> str:
    """Why `evaluator.accuracy` is malformed, or "" (the budget the workload resolves is `evaluators.judge.accuracy.resolve`'s)."""
    unknown = sorted(set(accuracy) - set(_ACCURACY_KEYS))
    if unknown:
        return f"unknown keys {unknown}; allowed: {list(_ACCURACY_KEYS)}"
    if accuracy.get("mode", "exact") not in ACCURACY_MODES:
        return f"mode {accuracy.get('mode')!r} is not one of {list(ACCURACY_MODES)}"
    for key in ("factor", "max_mean_gap", "max_gap", "tie_window", "tie_alpha", "request_alpha", "min_agreement"):
        value = accuracy.get(key)
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
            return f"{key} must be a positive number, got {value!r}"
    if not 0 < accuracy.get("min_agreement", 0.5) <= 1:
        return f"min_agreement must be in (0, 1], got {accuracy['min_agreement']!r}"
    if accuracy.get("against") not in (None, "bfloat16", "float16"):
        return f"against {accuracy['against']!r}: calibrate against 'bfloat16' or 'float16'"
    if accuracy.get("mode", "exact") == "exact" and set(accuracy) - {"mode"}:
        return f"mode exact takes no budget: {sorted(set(accuracy) - {'mode'})} apply to mode budget"
    return ""


@dataclass(frozen=True)
class EvaluatorSettings:
    """How an evaluator checks and times engines. See the module docstring for the tolerance policy."""

    tolerances: dict[str, float] = _option(
        lambda: dict(DEFAULT_TOLERANCES),
        "dtype name -> bound on the norm-wise relative error ||out-ref||/||ref|| (preset I/O dtype)",
        _tolerances_ok,
        factory=True,
        hash=False,
    )
    elementwise_factor: float = _option(
        10.0, "max|out-ref| must also be <= factor * tol * max|ref| for every output", _positive
    )
    warmup: int = _option(3, "untimed calls at the timing shape before the timed ones (checked like every call)",
                          _count(0))
    repeats: int = _option(15, "timed calls, each on fresh inputs and checked; the latency is their median, the"
                               " spread their IQR", _count(1))
    build_timeout_s: float = _option(
        120.0, "build plus first (compiling) call longer than this gives status 'timeout'", _positive
    )
    eval_timeout_s: float = _option(
        300.0, "whole evaluation budget; the pool kills an evaluator that exceeds it (hangs)", _positive
    )
    baseline_build_timeout_s: float = _option(
        600.0,
        "a baseline's build plus first (compiling) call longer than this gives it status 'timeout' (shown as"
        " a row of the summary, never silently dropped); a baseline's whole budget is eval_timeout_s plus the"
        " extra build time (this minus build_timeout_s, if more). Baselines such as torch.compile can take"
        " minutes to compile on a loaded CPU; candidates keep build_timeout_s",
        _positive,
    )
    roofline_margin: float = _option(
        1.0, "a median latency below margin x the roofline floor gives status 'suspect' (never ok)", _positive
    )
    settle_s: float = _option(
        0.005,
        "on CUDA, seconds to wait before re-reading a call's outputs; outputs that change after the engine"
        " returned (kernels still writing) make it 'incorrect' (on CPU the engine's process is frozen while"
        " its outputs are read, so nothing can change them)",
        lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 10,
    )
    poison_memory: bool = _option(
        False,
        "in the engine's process, for its whole life (every call alike, timed ones too), torch.empty & co."
        " return NaN-filled memory, so an output left unwritten fails even where the allocator hands back a"
        " block that happens to hold the answer; costs ~10% of a CPU engine's latency (every allocation is"
        " filled), so it is off by default: unwritten outputs are then caught by their wrong values",
        lambda x: isinstance(x, bool),
    )
    subtract_call_overhead: bool = _option(
        False,
        "subtract from each timed call the judge's least cost of a call without an engine (echo calls through"
        " the same arenas, measured before the engine is built); worth it where that cost (~0.1-0.3 ms) is a"
        " noticeable part of an engine's time, e.g. GPU kernels of a few ms; off: latencies are the judge's"
        " wall time per call",
        lambda x: isinstance(x, bool),
    )
    engine_memory_gb: float = _option(
        16.0,
        "address-space limit (RLIMIT_AS, GiB) of each engine's process on a CPU evaluator: an engine that"
        " allocates more fails with an out-of-memory error (runtime_error); CUDA engines are bounded by their"
        " GPU's memory instead (the CUDA driver reserves more address space than any limit would allow)",
        _positive,
    )
    engine_network: bool = _option(
        False,
        "whether engine processes may use the network; false: each starts in a network namespace of its own"
        " with no interfaces (where the OS refuses that, Python's socket connect/bind/send raise instead)",
        lambda x: isinstance(x, bool),
    )
    sandbox: str = _option(
        "strict",
        "how engine processes are confined: 'strict' (an unprivileged user with no capabilities and a seccomp"
        " filter, in PID, mount, IPC and network namespaces of their own, a read-only view of the files with"
        " the reference, baselines and judge hidden, a private /tmp, cgroups bounding cores, memory and"
        " processes; needs root, Linux namespaces and libseccomp), or 'none' (the judge's user and"
        " namespaces: for trusted engines only). Every result records which one judged it",
        lambda x: x in ("strict", "none"),
    )
    trace: dict = _option(
        dict,
        "a generation workload's request trace, over the preset's (evo.core.trace.TraceSpec fields: arrival"
        " burst|poisson|closed, count, concurrency, rate, prompt_len [lo, hi], output_len [lo, hi], seed); {}:"
        " the preset's own. Bounded by the preset's verified prompt and output lengths and requests in flight",
        lambda x: isinstance(x, Mapping),
        factory=True,
        hash=False,
    )
    objective: str = _option(
        "ms_per_output_token",
        "what the search minimises for a generation workload, read off each timed replay: ms_per_output_token"
        " (1000 / output tokens/s), tpot_p99_ms or tpot_median_ms (both need slo.ttft_ms: a replay whose TTFT p99"
        " is over it is not ranked), ttft_p99_ms (needs slo.tpot_ms, alike) or e2el_median_ms",
        lambda x: x in ("ms_per_output_token", "tpot_p99_ms", "tpot_median_ms", "ttft_p99_ms", "e2el_median_ms"),
    )
    slo: dict = _option(
        dict,
        "service-level objectives of a generation workload's requests, in ms ({ttft_ms, tpot_ms, e2e_ms}, each"
        " optional): the replay's goodput is the requests per second that met all of them ({}: no goodput)",
        lambda x: isinstance(x, Mapping) and set(x) <= {"ttft_ms", "tpot_ms", "e2e_ms"}
        and all(_positive(v) for v in x.values()),
        factory=True,
        hash=False,
    )
    accuracy: dict = _option(
        dict,
        "the accuracy contract of a generation workload (docs/evidence.md): {mode: exact|budget} (default exact at"
        " a float32/float64 preset, budget at bfloat16); a budget's bounds {min_agreement, max_mean_gap, max_gap,"
        " tie_window, tie_alpha, request_alpha}, any left out calibrated against an honest execution at {against:"
        " bfloat16} times {factor: 2}",
        lambda x: isinstance(x, Mapping) and not accuracy_problem(x),
        factory=True,
        hash=False,
    )
    replays: int = _option(2, "timed replays of the trace per evaluation of a generation engine (fresh prompts"
                              " each); the result is their median", _count(1))
    min_timing_s: float | None = _option(
        None,
        "if set, keep timing past `repeats` until the timed calls add up to this many seconds",
        lambda x: x is None or _positive(x),
    )

    def __post_init__(self) -> None:
        if isinstance(self.accuracy, Mapping) and accuracy_problem(self.accuracy):
            raise ValueError(f"EvaluatorSettings.accuracy={dict(self.accuracy)!r} is not valid: "
                             f"{accuracy_problem(self.accuracy)}")
        for f in fields(self):
            value = getattr(self, f.name)
            if not f.metadata["check"](value):
                raise ValueError(
                    f"EvaluatorSettings.{f.name}={value!r} is not valid: {f.metadata['doc']}"
                    f" (default {_default(f)!r})"
                )
        bound = OBJECTIVE_BOUNDS.get(self.objective)
        if bound is not None and bound not in self.slo:
            gamed = "holding each request's first token until its last" if bound == "ttft_ms" else \
                "sending a first token at once and then the rest slowly"
            raise ValueError(f"EvaluatorSettings.objective={self.objective!r} needs slo.{bound} (ms): alone it rewards "
                             f"an engine for {gamed}, so it is scored under that bound (a timed replay past it is not "
                             f"ranked). Set evaluator.slo.{bound}, or choose objective ms_per_output_token or "
                             "e2el_median_ms")
        object.__setattr__(self, "tolerances", {k: float(v) for k, v in self.tolerances.items()})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> EvaluatorSettings:
        """Settings from a config mapping; unknown keys are an error that lists the allowed ones.

        `tolerances` given here are merged over the defaults, so a config can change one dtype.
        """
        data = dict(data or {})
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise ValueError(
                f"unknown evaluator settings {unknown}; allowed: {allowed}. "
                f"See EvaluatorSettings.describe() for each option's default and meaning."
            )
        if isinstance(data.get("tolerances"), Mapping):
            data["tolerances"] = {**DEFAULT_TOLERANCES, **data["tolerances"]}
        return cls(**data)

    def tolerance(self, dtype: str) -> float:
        """The norm-wise bound for a preset whose I/O dtype is `dtype`."""
        if dtype not in self.tolerances:
            raise ValueError(
                f"no tolerance for dtype {dtype!r}; configured: {sorted(self.tolerances)}. "
                f"Add it under evaluator settings 'tolerances'."
            )
        return self.tolerances[dtype]

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def budgets(self, baseline: bool = False) -> tuple[tuple[str, float], tuple[str, float]]:
        """((name, seconds) of the build deadline, (name, seconds) of the whole evaluation's) for a
        candidate's engine, or with `baseline` for a baseline's: its own build limit, and eval_timeout_s
        lengthened by what that limit adds to build_timeout_s."""
        if not baseline:
            return ("build_timeout_s", self.build_timeout_s), ("eval_timeout_s", self.eval_timeout_s)
        extra = max(0.0, self.baseline_build_timeout_s - self.build_timeout_s)
        whole = ("eval_timeout_s", self.eval_timeout_s) if not extra else (
            f"eval_timeout_s + {extra:g} s of baseline build time", self.eval_timeout_s + extra)
        return ("baseline_build_timeout_s", self.baseline_build_timeout_s), whole

    @classmethod
    def describe(cls) -> list[dict[str, Any]]:
        """The options table: name, default, doc."""
        return [{"option": f.name, "default": _default(f), "doc": f.metadata["doc"]} for f in fields(cls)]


def _default(f: Any) -> Any:
    from dataclasses import MISSING

    return f.default_factory() if f.default is MISSING else f.default


@dataclass(frozen=True)
class PoolSettings:
    """How many evaluator actors the pool runs and where (the config's `evaluators:` section)."""

    count: int = 0  # evaluator actors; 0 = as many as the cluster holds, growing as nodes join
    threads: int = 1  # CPUs per evaluator (a CPU evaluator owns that many disjoint cores)
    accelerator_type: str | None = None  # GPU runs: the node type to use (Ray's accelerator_type:X resource);
    # default: the type with the most GPUs. A run targets one device type; timings never mix types.
    placement: str = "auto"  # auto: one evaluator per GPU for cuda presets, CPU evaluators otherwise;
    # gpu: one per GPU even for a cpu preset (it holds the GPU, computes on the CPU); cpu: CPU evaluators

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement {self.placement!r} is not one of {list(PLACEMENTS)}")
        if self.count < 0 or self.threads < 1:
            raise ValueError(f"count must be >= 0 and threads >= 1, got count={self.count}, threads={self.threads}")
