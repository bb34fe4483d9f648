"""The run's one roofline floor: where its rates came from, its revisions, and how it is shown.

The driver measures the machine's rates once (robustly, see evaluators.judge.calibration), hands them to every
evaluator, and keeps the floor here: the evaluators' `suspect` check and the summary use the same one.
An engine that passed every check but timed below it means the floor was measured low; the floor is
re-measured and a lower one recorded as a revision. A fraction of the floor above 100% is never shown:
an engine still below a re-measured floor is named suspect instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

from evo.workloads.base import Roofline


@dataclass(frozen=True)
class RunFloor:
    """The floor of a run: `roofline` as it stands, `source` of its first rates ("measured", "cache":
    the machine's cached calibration beat this run's probes), and each revision {floor_ms, from_ms, reason}."""

    roofline: Roofline
    source: str = "measured"
    revisions: tuple[dict[str, Any], ...] = ()

    @property
    def floor_ms(self) -> float:
        return self.roofline.floor_ms

    def settled(self, latency_ms: float, remeasure: Callable[[], Roofline], who: str = "the best engine") -> RunFloor:
        """This floor, or, when `latency_ms` (an engine that passed every check) is below it, the floor of
        re-measured rates if that is lower, recorded as a revision. A failed re-measurement keeps it."""
        if not latency_ms < self.floor_ms:
            return self
        try:
            again = remeasure()
        except Exception:  # the evaluators are gone: the summary then names the engine suspect
            return self
        if not again.floor_ms < self.floor_ms:
            return self
        reason = (f"{who} timed {latency_ms:.4g} ms, below the floor {self.floor_ms:.4g} ms:"
                  " the machine's rates were re-measured")
        return replace(self, roofline=again,
                       revisions=self.revisions + ({"floor_ms": again.floor_ms, "from_ms": self.floor_ms,
                                                    "reason": reason},))

    def entry(self, latency_ms: float) -> dict[str, Any]:
        """The summary's `roofline`: the floor, its work and rates, the fraction of it the best engine
        reaches (never above 1: `below_floor` instead), the rates' source and the revisions."""
        r = self.roofline
        fraction = r.floor_ms / latency_ms if math.isfinite(latency_ms) and latency_ms > 0 else math.nan
        below = fraction > 1
        entry: dict[str, Any] = {
            "floor_ms": r.floor_ms, "flops": r.flops, "bytes": r.bytes,
            "flops_per_s": r.rates.flops_per_s, "bytes_per_s": r.rates.bytes_per_s,
            "fraction_of_floor": math.nan if below else fraction, "below_floor": below,
            "source": "revised" if self.revisions else self.source, "revisions": [dict(v) for v in self.revisions]}
        if self.revisions:
            entry["revised_from_ms"] = self.revisions[0]["from_ms"]
        return entry


def floor_text(roof: dict[str, Any] | None) -> str | None:
    """'27.5% of the roofline floor (0.109 ms; revised from 0.300 ms)'; an engine below the floor is named
    suspect, never shown above 100% (also for summaries written before this rule). None: no floor."""
    roof = roof or {}
    floor, fraction = roof.get("floor_ms"), roof.get("fraction_of_floor")
    if floor is None or not math.isfinite(floor):
        return None
    shown = f"{floor:.3f} ms"
    if roof.get("revised_from_ms") is not None:
        shown += f"; revised from {roof['revised_from_ms']:.3f} ms"
    if roof.get("below_floor") or (fraction is not None and fraction > 1):
        return f"below the roofline floor ({shown}): suspect, faster than this machine allows"
    if fraction is None or not math.isfinite(fraction):
        return None
    return f"{100 * fraction:.1f}% of the roofline floor ({shown})"
