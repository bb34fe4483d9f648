"""What a Serve replica holds its generation engine to on every request, with no reference needed: the
policy (one field per user_config key, its default, its doc and its check), the figures the check measured,
and the deterministic rules.

Token rules (`breach`), checked on each token as the loop receives it, before it is released:
- a token for a request the engine does not hold: never added, finished, or aborted (no token after its end,
  so none past `max_tokens` either);
- a token outside the vocabulary;
- `finished` on a token that is neither the request's `max_tokens`-th nor one of its stop ids;
- a request's last token (its `max_tokens`-th, or a stop id) not marked finished.

Progress (`stall_deadline`): a request the engine holds must get a token (its first after being added, or its
next) within max(`stall_floor_s`, `stall_factor` x the check's E2E p99 x ceil(held / R)) seconds, `held` the
requests the engine holds at that moment and R the most the check ran at once: a request queued behind
ceil(held / R) rounds of full batches may wait that many of the slowest request the check saw, times the
factor. Each breaks the contract the judge holds engines to; the replica takes the engine out of service.

Speed (`SpeedWatch`): the median gap between successive tokens of a request, over the tokens served in the
last `slow_window_s` seconds (at least `MIN_GAPS` of them), against the check's ITL median: above
`slow_factor` times it for a whole `slow_window_s`, the engine is reported slow (and, with `slow_action:
remove`, taken out of service). An engine that turns slow is so named within 2 x `slow_window_s` of it.
"""
from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, fields
from typing import Any, Mapping

VERIFY_MODES = ("sampled", "all")
SLOW_ACTIONS = ("report", "remove")
MIN_GAPS = 8  # token gaps a window needs before its median says anything
MAX_GAPS = 1 << 16  # the window's memory bound (a busy engine's gaps beyond it are the oldest: dropped)


@dataclass(frozen=True)
class ServePolicy:
    """How a replica checks its generation engine while it serves (the user_config keys of these names)."""

    # "sampled": guards, canaries, rescore_fraction re-scored after the answer; "all": every token verified before
    # it is released
    verify: str = "sampled"
    verify_chunk: int = 8  # verify: all: tokens checked (and released) together; the last chunk at the request's end
    # one canary (the replica's own request, drawn like users', always verified) per this many user requests on
    # average; 0: none
    canary_every: int = 8
    # an engine slower than slow_factor x its judged ITL for slow_window_s: "report" (/v1/engine, logs) or "remove"
    slow_action: str = "report"
    slow_factor: float = 4.0  # how many times its judged ITL median an engine may take per token
    slow_window_s: float = 10.0  # the served tokens' window the ITL median is taken over, and how long it must stay slow
    stall_factor: float = 4.0  # a request without a token for stall_factor x the check's E2E p99 x ceil(held/R) ...
    stall_floor_s: float = 10.0  # ... and at least this long is a stall

    def __post_init__(self) -> None:
        for key, allowed in (("verify", VERIFY_MODES), ("slow_action", SLOW_ACTIONS)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"user_config {key!r} must be one of {list(allowed)}, got {getattr(self, key)!r}")
        for key, low, high in (("verify_chunk", 1, 4096), ("canary_every", 0, 1 << 20)):
            value = getattr(self, key)
            if type(value) is not int or not low <= value <= high:
                raise ValueError(f"user_config {key!r} must be an integer in [{low}, {high}], got {value!r}")
        for key, what, ok in (("slow_factor", "a number in (1, 1e6]", lambda v: 1 < v <= 1e6),
                              ("stall_factor", "a number in [1, 1e6]", lambda v: 1 <= v <= 1e6),
                              ("slow_window_s", "seconds in (0, 3600]", lambda v: 0 < v <= 3600),
                              ("stall_floor_s", "seconds in (0, 3600]", lambda v: 0 < v <= 3600)):
            value = getattr(self, key)
            if type(value) not in (int, float) or not ok(value):
                raise ValueError(f"user_config {key!r} must be {what}, got {value!r}")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ServePolicy:
        """The policy of a user_config's keys (absent ones at their defaults); ValueError naming a bad one."""
        return cls(**{f.name: config[f.name] for f in fields(cls) if config.get(f.name) is not None})


POLICY_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(ServePolicy)}


@dataclass(frozen=True)
class Judged:
    """The check's figures the guards scale by: its slowest request and its typical token gap (seconds), the
    most requests it ran at once, and where they come from."""

    e2e_p99_s: float
    itl_median_s: float
    concurrency: int
    source: str

    @classmethod
    def of(cls, metrics: Any, concurrency: int, source: str) -> Judged:
        """From a `ServingMetrics` (times in ms)."""
        return cls(metrics.e2el_ms["p99"] / 1e3, metrics.itl_ms["median"] / 1e3, max(1, concurrency), source)

    def to_dict(self) -> dict[str, Any]:
        return {"e2el_p99_ms": 1e3 * self.e2e_p99_s, "itl_median_ms": 1e3 * self.itl_median_s,
                "concurrency": self.concurrency, "source": self.source}


def stall_deadline(policy: ServePolicy, judged: Judged, held: int) -> float:
    """Seconds a held request may go without a token (see the module)."""
    rounds = max(1, math.ceil(held / judged.concurrency))
    scaled = policy.stall_factor * judged.e2e_p99_s * rounds if math.isfinite(judged.e2e_p99_s) else 0.0
    return max(policy.stall_floor_s, scaled)


def breach(request, made: int, token: int, finished: bool, vocab: int) -> str:
    """The token rule a request's `made`-th token (1-based) breaks, or "" (see the module; the caller has
    already matched the token to a request the engine holds)."""
    name = f"request {request.id}"
    if not 0 <= token < vocab:
        return f"{name}: token {token} outside the vocabulary [0, {vocab - 1}]"
    last = made >= request.max_tokens or token in request.stop_ids
    if finished and not last:
        return (f"{name}: marked finished after {made} of its {request.max_tokens} tokens without a stop id "
                f"(an end it did not reach)")
    if last and not finished:
        why = "a stop id" if token in request.stop_ids else f"its max_tokens {request.max_tokens}"
        return f"{name}: its last token ({why}) not marked finished"
    return ""


class SpeedWatch:
    """The served token gaps of the last window and the slow report (see the module). The loop records, the
    watch thread judges; both under the replica's lock."""

    def __init__(self) -> None:
        self._gaps: collections.deque[tuple[float, float]] = collections.deque(maxlen=MAX_GAPS)
        self._slow_since: float | None = None
        self.report: dict[str, Any] | None = None  # the latest slow episode (kept after it ends, with `until`)
        self.episodes = 0

    @property
    def slow_now(self) -> bool:
        """In a slow episode that has not ended."""
        return self.report is not None and "until" not in self.report

    def record(self, now: float, gap_s: float) -> None:
        self._gaps.append((now, gap_s))

    def median_ms(self, now: float, window_s: float) -> float | None:
        while self._gaps and self._gaps[0][0] < now - window_s:
            self._gaps.popleft()
        if len(self._gaps) < MIN_GAPS:
            return None
        gaps = sorted(g for _, g in self._gaps)
        return 1e3 * gaps[len(gaps) // 2]

    def judge(self, policy: ServePolicy, judged: Judged, now: float | None = None) -> str:
        """Call on every tick: a message once the engine has been slow for a whole window (the episode
        reported once), else ""."""
        now = time.perf_counter() if now is None else now
        median = self.median_ms(now, policy.slow_window_s)
        bound = 1e3 * judged.itl_median_s * policy.slow_factor
        if median is None or not math.isfinite(bound) or median <= bound:
            if self.slow_now:
                self.report = {**self.report, "until": time.time()}
            self._slow_since = None
            return ""
        if self._slow_since is None:
            self._slow_since = now
        if now - self._slow_since < policy.slow_window_s or self.slow_now:
            return ""
        self.episodes += 1
        message = (f"serving {median / (1e3 * judged.itl_median_s):.1f}x slower than judged: median ITL "
                   f"{median:.2f} ms over the last {policy.slow_window_s:g} s against the check's "
                   f"{1e3 * judged.itl_median_s:.2f} ms (slow_factor {policy.slow_factor:g})")
        self.report = {"since": time.time() - (now - self._slow_since), "median_itl_ms": median,
                       "judged_itl_ms": 1e3 * judged.itl_median_s, "slow_factor": policy.slow_factor,
                       "message": message}
        return message
