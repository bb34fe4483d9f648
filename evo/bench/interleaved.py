"""The statistics of an interleaved server comparison (scripts/loadtest_compare.py): each round loads every server
once, in a rotated order, on the same fresh prompts, so a round's ratio (ours against theirs) sees one machine
at one moment. A ratio is reported as the median of the rounds' ratios with the distribution-free interval
for a median: order statistics x(k) and x(n+1-k), the widest-k pair whose coverage, 1 - 2 P(Binomial(n, 1/2) < k),
is at least the confidence asked. Six rounds are the fewest for 95% (min and max then cover 96.9%); five
cover 93.8%. Pure: the standard library only."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

CONFIDENCE = 0.95
# figure -> (its name in vllm bench serve's metrics, +1 when larger is better, -1 when smaller is)
FIGURES: dict[str, tuple[str, int]] = {"output tok/s": ("output_throughput", +1), "TPOT p50": ("median_tpot_ms", -1),
                                       "TTFT p50": ("median_ttft_ms", -1), "E2EL p50": ("median_e2el_ms", -1)}


def coverage(n: int, k: int) -> float:
    """The chance that [x(k), x(n+1-k)] of n draws holds their distribution's median."""
    return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2.0 ** n


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float, float, float]:
    """(median, low, high, coverage) of `values`; low and high are NaN (coverage 0) when no pair of order statistics
    reaches `confidence` (fewer than six values at 95%)."""
    x = sorted(float(v) for v in values if v is not None and math.isfinite(v))
    n = len(x)
    if not n:
        return math.nan, math.nan, math.nan, 0.0
    middle = statistics.median(x)
    k = max((k for k in range(1, n // 2 + 1) if coverage(n, k) >= confidence), default=0)
    if not k:
        return middle, math.nan, math.nan, 0.0
    return middle, x[k - 1], x[n - k], coverage(n, k)


@dataclass(frozen=True)
class Ratio:
    """How many times better `a` did than `b` on one figure at one concurrency, over paired rounds (> 1: a better)."""

    a: str
    b: str
    concurrency: int
    figure: str
    rounds: tuple[float, ...]  # one ratio per round in which both servers completed the load
    median: float
    low: float
    high: float
    coverage: float

    def cell(self) -> str:
        if not math.isfinite(self.median):
            return "—"
        interval = f" [{self.low:.2f}, {self.high:.2f}]" if math.isfinite(self.low) else " (too few rounds for 95%)"
        return f"{self.median:.2f}x{interval}"


def paired_ratios(a: str, b: str, concurrency: int, rounds: Sequence[Mapping[str, Mapping | None]],
                  confidence: float = CONFIDENCE) -> list[Ratio]:
    """`a` against `b` on each of FIGURES: `rounds` holds, per round, server -> its metrics (None: it failed)."""
    out = []
    for figure, (key, sense) in FIGURES.items():
        ratios = []
        for metrics in rounds:
            mine, theirs = metrics.get(a), metrics.get(b)
            if not mine or not theirs or mine.get("failed") or theirs.get("failed"):
                continue
            x, y = mine.get(key), theirs.get(key)
            if x and y and math.isfinite(x) and math.isfinite(y):
                ratios.append(x / y if sense > 0 else y / x)
        out.append(Ratio(a, b, concurrency, figure, tuple(ratios), *median_interval(ratios, confidence)))
    return out
