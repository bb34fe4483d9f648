"""Paired re-timing: the record of one A/B comparison and the statistics that decide it. Pure: numpy only.

A paired re-timing calls two engines interleaved, call by call in a shuffled order on fresh inputs
(`evaluators.judge.paired` does the measuring), so both see the same machine at the same moments: a load
spike or a clock change hits a pair, not one engine. Each pair i gives d_i = log(a_i / b_i). The
estimate of the latency ratio A/B is exp of the Hodges-Lehmann estimate of the d_i (the median of
the Walsh averages (d_i + d_j) / 2, i <= j) and its 95% interval is the distribution-free one of
the Wilcoxon signed-rank test (normal approximation of the rank count): valid whatever the noise's
shape, as long as it is symmetric about the true shift, which the shuffled order within each pair
makes so. No random numbers: the same samples give the same interval.

The verdict: A is `faster` only when the whole interval lies below 1 - min_effect, `slower` only when
it lies above 1 + min_effect; anything else is `equal` within noise. A failed call (an engine that
passed its evaluation and then returned a wrong answer, raised or hung) makes the verdict `failed`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from statistics import NormalDist
from typing import Any, Protocol, Sequence

import numpy as np

from evo.core.records import Evaluated

FASTER, SLOWER, EQUAL, FAILED = "faster", "slower", "equal", "failed"
DEFAULT_REASON = "default"  # the final re-timing of the best engine against the run's default genome
NOT_TIMED = "not timed: the run was stopped"  # the message of a re-timing a stop left undone (no verdict on A)
VERDICTS: tuple[str, ...] = (FASTER, SLOWER, EQUAL, FAILED)
MIN_PAIRS = 6  # fewer pairs than this cannot exclude anything at 95% (the interval is every Walsh average)
CONFIDENCE = 0.95


@dataclass(frozen=True)
class PairedTiming:
    """One paired re-timing of engine `a` against engine `b` (genome hashes, or "baseline:NAME").

    `ratio` = latency of A / latency of B (< 1: A is faster), with its interval [`low`, `high`]."""

    a: str
    b: str
    verdict: str
    ratio: float = math.nan
    low: float = math.nan
    high: float = math.nan
    min_effect: float = 0.02
    samples_a_ms: tuple[float, ...] = ()  # the timed calls, in call order; pair i is (samples_a_ms[i], samples_b_ms[i])
    samples_b_ms: tuple[float, ...] = ()
    message: str = ""
    reason: str = ""  # why it ran: "parent" / "incumbent" (intensification), "race" (the final race),
    # "baseline" or "default" (final: a baseline, the run's default genome), "ab" (the CLI)
    generation: int = -1  # the search generation it decided (-1: outside a search)
    wall_s: float = math.nan  # its wall time, builds included
    evaluator: str = ""
    device: str = ""
    telemetry: dict[str, Any] = field(default_factory=dict)  # the machine around the calls (evaluators.machine.telemetry)
    # figures of each timed call beyond its latency, by name, in call order like the samples (a generation
    # engine's replay: output tokens/s, TTFT, TPOT, ...); empty for a call engine
    figures_a: dict[str, tuple[float, ...]] = field(default_factory=dict)
    figures_b: dict[str, tuple[float, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r} not in {VERDICTS}")

    @property
    def pairs(self) -> int:
        return min(len(self.samples_a_ms), len(self.samples_b_ms))

    @property
    def speedup(self) -> tuple[float, float, float]:
        """B's latency / A's (how many times faster A is), with its interval: (estimate, low, high)."""
        return 1.0 / self.ratio, 1.0 / self.high, 1.0 / self.low

    def describe(self) -> str:
        if self.verdict == FAILED:
            return f"{self.a} vs {self.b}: failed ({self.message})"
        word = {FASTER: "faster than", SLOWER: "slower than", EQUAL: "equal within noise to"}[self.verdict]
        return (f"{self.a} is {word} {self.b}: latency ratio {self.ratio:.4f} [95% {self.low:.4f}, {self.high:.4f}]"
                f" over {self.pairs} paired calls (minimum effect {100 * self.min_effect:g}%)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PairedTiming:
        """From `to_dict` output, also after a JSON round trip (NaN written as null, tuples as lists)."""
        names = {f for f in cls.__dataclass_fields__}
        values = {k: v for k, v in data.items() if k in names}
        for key in ("ratio", "low", "high", "wall_s"):
            if values.get(key) is None:
                values[key] = math.nan
        for key in ("samples_a_ms", "samples_b_ms"):
            values[key] = tuple(math.nan if s is None else float(s) for s in values.get(key) or ())
        return cls(**values)


def hodges_lehmann(d: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(estimate, low, high) of the centre of `d`: the median of its Walsh averages and the Wilcoxon
    signed-rank interval at `confidence`. ValueError for fewer than MIN_PAIRS values."""
    x = np.asarray(d, dtype=np.float64)
    n = len(x)
    if n < MIN_PAIRS or not np.all(np.isfinite(x)):
        raise ValueError(f"need at least {MIN_PAIRS} finite paired differences, got {n}"
                         + ("" if np.all(np.isfinite(x)) else " (some not finite)"))
    i, j = np.triu_indices(n)
    walsh = np.sort((x[i] + x[j]) / 2.0)
    m = len(walsh)  # n (n + 1) / 2
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    trim = int(math.floor(m / 2.0 - z * math.sqrt(n * (n + 1) * (2 * n + 1) / 24.0)))
    trim = max(trim, 1)  # the count of Walsh averages below the interval, + 1 (1-based rank of its lower end)
    return float(np.median(walsh)), float(walsh[trim - 1]), float(walsh[m - trim])


def decide(low: float, high: float, min_effect: float) -> str:
    """The verdict on A against B from the ratio's interval: beyond 1 -/+ min_effect, or equal."""
    if high <= 1.0 - min_effect:
        return FASTER
    if low >= 1.0 + min_effect:
        return SLOWER
    return EQUAL


def paired_timing(a: str, b: str, samples_a_ms: Sequence[float], samples_b_ms: Sequence[float],
                  min_effect: float, **fields: Any) -> PairedTiming:
    """The record of a paired run: ratio, interval and verdict from the paired samples (one per call)."""
    if len(samples_a_ms) != len(samples_b_ms):
        raise ValueError(f"paired samples differ in length: {len(samples_a_ms)} vs {len(samples_b_ms)}")
    a_ms = np.asarray(samples_a_ms, dtype=np.float64)
    b_ms = np.asarray(samples_b_ms, dtype=np.float64)
    floor = 1e-6  # ms: a call timed at zero (overhead subtracted) must not make a log infinite
    d = np.log(np.maximum(a_ms, floor)) - np.log(np.maximum(b_ms, floor))
    estimate, low, high = hodges_lehmann(d)
    ratio, low, high = math.exp(estimate), math.exp(low), math.exp(high)
    return PairedTiming(a, b, decide(low, high, min_effect), ratio, low, high, min_effect,
                        tuple(float(s) for s in a_ms), tuple(float(s) for s in b_ms), **fields)


def paired_figures(timing: PairedTiming) -> dict[str, list[float]]:
    """Each figure both engines report, paired as the latencies are: name -> [estimate, low, high] of A's
    value / B's (95%, Hodges-Lehmann and Wilcoxon as for the latency ratio)."""
    out = {}
    for name in sorted(set(timing.figures_a) & set(timing.figures_b)):
        a, b = timing.figures_a[name], timing.figures_b[name]
        if len(a) == len(b) >= MIN_PAIRS and all(math.isfinite(x) and x > 0 for x in (*a, *b)):
            one = paired_timing(timing.a, timing.b, a, b, timing.min_effect)
            out[name] = [one.ratio, one.low, one.high]
    return out


def pooled(earlier: PairedTiming, later: PairedTiming) -> PairedTiming:
    """One record of two re-timings of the same A against the same B: the pairs of both, decided again
    (a failed one stays failed). Each pair saw one moment of the machine, so pairs from two sittings pool."""
    if FAILED in (earlier.verdict, later.verdict):
        return later if later.verdict == FAILED else earlier
    pooled_timing = paired_timing(later.a, later.b, earlier.samples_a_ms + later.samples_a_ms,
                                  earlier.samples_b_ms + later.samples_b_ms, later.min_effect)
    wall = sum(w for w in (earlier.wall_s, later.wall_s) if math.isfinite(w))
    return replace(later, verdict=pooled_timing.verdict, ratio=pooled_timing.ratio, low=pooled_timing.low,
                   high=pooled_timing.high, samples_a_ms=pooled_timing.samples_a_ms,
                   samples_b_ms=pooled_timing.samples_b_ms, wall_s=wall)


def failed_timing(a: str, b: str, message: str, min_effect: float, **fields: Any) -> PairedTiming:
    return PairedTiming(a, b, FAILED, min_effect=min_effect, message=message[:500], **fields)


def not_timed(timing: PairedTiming) -> bool:
    """Whether a stop left this re-timing undone (it says nothing about its engines)."""
    return timing.verdict == FAILED and timing.message.startswith(NOT_TIMED)


@dataclass(frozen=True)
class IntensifySettings:
    """Intensification (the config's `search.intensify`): a candidate that looks faster than its parent or
    than the incumbent is re-timed against it, paired, before it counts. Each field: default, doc, check."""

    enabled: bool = True  # re-time challengers (and bench/compare claims) where the evaluator can re-time paired
    min_effect: float = 0.02  # a win must be at least this much faster, by the whole 95% interval
    budget_share: float = 0.2  # re-timings in all <= this share of search.max_evaluations
    calls: int = 16  # timed calls per engine in one re-timing (pairs); >= 8
    warmup: int = 2  # untimed calls per engine before them
    final_race: int = 3  # at the run's end, this many fastest-looking candidates no re-timing examined race
    # the incumbent before the winner is declared (their re-timings are reserved in the budget); 0: off
    race_rounds: int = 3  # rounds of the final race: a contender equal within noise is timed again, up to this
    race_wall_s: float = 300.0  # no round of the final race starts after this many seconds of it

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.enabled, bool):
            problems.append(f"enabled must be true or false, got {self.enabled!r}")
        if not (isinstance(self.min_effect, (int, float)) and 0 <= self.min_effect < 0.5):
            problems.append(f"min_effect must be a fraction in [0, 0.5) (0.02 = 2%), got {self.min_effect!r}")
        if not (isinstance(self.budget_share, (int, float)) and 0 <= self.budget_share <= 1):
            problems.append(f"budget_share must be in [0, 1] (a share of search.max_evaluations), "
                            f"got {self.budget_share!r}")
        if not (isinstance(self.calls, int) and not isinstance(self.calls, bool) and self.calls >= 8):
            problems.append(f"calls must be an integer >= 8 (paired calls per engine), got {self.calls!r}")
        if not (isinstance(self.warmup, int) and not isinstance(self.warmup, bool) and self.warmup >= 0):
            problems.append(f"warmup must be an integer >= 0, got {self.warmup!r}")
        for name in ("final_race", "race_rounds"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= (name == "race_rounds")):
                problems.append(f"{name} must be an integer >= {int(name == 'race_rounds')}, got {value!r}")
        if not (isinstance(self.race_wall_s, (int, float)) and self.race_wall_s >= 0):  # refuses NaN
            problems.append(f"race_wall_s must be a number of seconds >= 0, got {self.race_wall_s!r}")
        if problems:
            raise ValueError("; ".join(problems))

    def budget(self, max_evaluations: int) -> int:
        """Re-timings a search may run in all."""
        return int(math.floor(self.budget_share * max_evaluations + 1e-9)) if self.enabled else 0

    def reserve(self, max_evaluations: int) -> int:
        """Re-timings kept for the final race: its places, at most half the budget (rounded up)."""
        budget = self.budget(max_evaluations)
        return min(self.final_race, budget - budget // 2)


@dataclass(frozen=True)
class Challenge:
    """A candidate to re-time against the engine it looks faster than: its parent or the incumbent."""

    challenger: Evaluated
    holder: Evaluated
    reason: str  # "parent" | "incumbent"
    generation: int


class Retimer(Protocol):
    """What times challenges for the search (a run's evaluator pool, through the driver; a test's fake)."""

    def retime(self, challenges: list[Challenge], settings: IntensifySettings) -> list[PairedTiming]:
        """One record per challenge, in order: a = the challenger, b = the holder."""
        ...


__all__ = ["Challenge", "Retimer", "CONFIDENCE", "EQUAL", "FAILED", "FASTER", "IntensifySettings", "MIN_PAIRS", "NOT_TIMED", "PairedTiming", "SLOWER",
           "VERDICTS", "decide", "failed_timing", "hodges_lehmann", "not_timed", "paired_timing", "pooled"]
