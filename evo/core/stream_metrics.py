"""Serving metrics of a replayed request trace, as `vllm bench serve` names and computes them. Pure:
numpy only.

Every time is the judge's own clock (the client's), never the engine's: a request's `sent_s` is when
the judge sent it and `token_s[i]` when its i-th token reached the judge. Per request: TTFT (first
token - sent), E2E latency (last token - sent), TPOT ((E2E - TTFT) / (tokens - 1), requests with more
than one token), ITL (the gaps between its successive tokens). Over the replay: request throughput
(completed requests / duration), output tokens/s, total tokens/s (prompt tokens included) and goodput
(requests per second that met every SLO given). Distributions are reported by mean, median, p90 and
p99, in milliseconds.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestTimeline:
    """What the judge saw of one request: when it sent it and when each token arrived (seconds)."""

    sent_s: float
    token_s: tuple[float, ...]
    prompt_len: int

    def __post_init__(self) -> None:
        if any(b < a for a, b in zip((self.sent_s, *self.token_s), self.token_s)):
            raise ValueError("a request's token times must not go back in time nor precede its sending")

    @property
    def ttft_s(self) -> float:
        return self.token_s[0] - self.sent_s if self.token_s else math.nan

    @property
    def e2e_s(self) -> float:
        return self.token_s[-1] - self.sent_s if self.token_s else math.nan

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (len(self.token_s) - 1) if len(self.token_s) > 1 else math.nan

    @property
    def itl_s(self) -> tuple[float, ...]:
        return tuple(b - a for a, b in zip(self.token_s, self.token_s[1:]))


@dataclass(frozen=True)
class Slo:
    """Service-level objectives for goodput, in milliseconds (None: no bound on it)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met_by(self, request: RequestTimeline) -> bool:
        """Whether `request` produced tokens within every bound (a one-token request has no TPOT to miss)."""
        if not request.token_s:
            return False
        tpot = request.tpot_s if len(request.token_s) > 1 else 0.0
        bounds = ((self.ttft_ms, request.ttft_s), (self.tpot_ms, tpot), (self.e2e_ms, request.e2e_s))
        return all(1e3 * value <= bound for bound, value in bounds if bound is not None)


@dataclass(frozen=True)
class ServingMetrics:
    """A replay's figures under `vllm bench serve`'s names (times in ms: {"mean", "median", "p90", "p99"})."""

    completed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # requests/s
    output_throughput: float  # output tokens/s
    total_token_throughput: float  # (prompt + output) tokens/s
    ttft_ms: dict[str, float] = field(default_factory=dict)
    tpot_ms: dict[str, float] = field(default_factory=dict)
    itl_ms: dict[str, float] = field(default_factory=dict)
    e2el_ms: dict[str, float] = field(default_factory=dict)
    request_goodput: float | None = None  # requests/s that met every SLO (None: no SLO given)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def serving_metrics(requests: Sequence[RequestTimeline], duration_s: float, slo: Slo | None = None) -> ServingMetrics:
    """The figures of a replay whose requests (those that produced at least one token) are `requests`
    and which lasted `duration_s` seconds on the judge's clock."""
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    done = [r for r in requests if r.token_s]
    outputs = sum(len(r.token_s) for r in done)
    inputs = sum(r.prompt_len for r in done)
    return ServingMetrics(
        completed=len(done), duration_s=duration_s, total_input_tokens=inputs, total_output_tokens=outputs,
        request_throughput=len(done) / duration_s, output_throughput=outputs / duration_s,
        total_token_throughput=(inputs + outputs) / duration_s,
        ttft_ms=_stats([r.ttft_s for r in done]), tpot_ms=_stats([r.tpot_s for r in done if len(r.token_s) > 1]),
        itl_ms=_stats([gap for r in done for gap in r.itl_s]), e2el_ms=_stats([r.e2e_s for r in done]),
        request_goodput=None if slo is None else sum(slo.met_by(r) for r in done) / duration_s)


def _stats(seconds: Sequence[float]) -> dict[str, float]:
    if not len(seconds):
        return {"mean": math.nan, **{_name(p): math.nan for p in PERCENTILES}}
    ms = 1e3 * np.asarray(seconds, dtype=np.float64)
    return {"mean": float(ms.mean()), **{_name(p): float(np.percentile(ms, p)) for p in PERCENTILES}}


def _name(percentile: int) -> str:
    return "median" if percentile == 50 else f"p{percentile}"
