"""Multi-fidelity evaluation of a generation workload's candidates (the config's `search.screen`). Pure.

Successive halving in two rungs, then a race:
- rung 0, the **screen**: every candidate the search proposes passes the judge's whole check replay (never
  shortened) and is timed on `replays` replays of a shorter trace (`count` requests instead of the run's). Its
  single timing ranks it in the population and steers the agents; it is recorded with `fidelity = "screen"`.
- rung 1, **paired at full fidelity**: a candidate whose screen timing beats the incumbent's, or its parent's,
  is re-timed paired against it on whole replays of the run's trace (`search.intensify`), fastest-looking
  first, at most `promote` of the generation; those left that look faster than the incumbent race it at the
  run's end (`Search.final_race`), in the time the run reserved for that (`evo.core.reserve`).
Only full-fidelity paired figures are claims; the baselines are timed at full fidelity (they are what the
claims are made against).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCREEN, FULL = "screen", "full"


@dataclass(frozen=True)
class ScreenSettings:
    """`search.screen`: how candidates are screened (count 0: off, every evaluation at full fidelity)."""

    count: int = 0  # requests in a screening replay's trace (at most the run's trace's count); 0: no screening
    replays: int = 1  # timed replays of that shorter trace per screening evaluation; their median is the timing
    promote: float = 1.0  # at most this share of a generation's correct candidates (rounded up) is re-timed paired
    # within it, fastest-looking first; the others that look faster than the incumbent wait for the final race

    def __post_init__(self) -> None:
        if not (isinstance(self.promote, (int, float)) and not isinstance(self.promote, bool) and 0 < self.promote <= 1):
            raise ValueError(f"screen.promote must be a share in (0, 1], got {self.promote!r}")
        for name, low in (("count", 0), ("replays", 1)):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
                raise ValueError(f"screen.{name} must be an integer >= {low}, got {value!r}"
                                 + (" (0: no screening)" if name == "count" else ""))

    @property
    def enabled(self) -> bool:
        return self.count > 0

    def to_evaluator(self) -> dict[str, Any] | None:
        """What an evaluator is handed with a screening evaluation (None: full fidelity)."""
        return {"count": self.count, "replays": self.replays} if self.enabled else None
