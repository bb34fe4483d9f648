"""The run's end, reserved: the time the final race and the final paired re-timing will need, from measured
costs, so that a search with a wall budget (`search.max_wall_s`) stops starting generations while they still
fit, and says how much more time it would have needed where they do not. Pure.

A paired re-timing's cost is the median wall time of those this run measured; before any, the driver's
estimate (from the evaluations' replay times, `evo.driver.retime.retime_estimate_s`). Re-timings run
`parallel` at a time (the pool's evaluators), so racing k contenders costs ceil(k / parallel) of them a round.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from evo.core.retiming import PairedTiming


@dataclass(frozen=True)
class EndReserve:
    """What the end of a run costs, in seconds (see the module)."""

    parallel: int = 1  # re-timings that run at once
    guess_retime_s: Callable[[], float] = lambda: math.nan  # one re-timing's cost before any was measured
    final_s: Callable[[], float] = lambda: 0.0  # the final paired re-timing against the baselines

    def retime_s(self, measured: Sequence[PairedTiming]) -> float:
        """One paired re-timing's expected wall time (nan: nothing to go by yet)."""
        walls = [t.wall_s for t in measured if math.isfinite(t.wall_s) and t.wall_s > 0]
        return statistics.median(walls) if walls else self.guess_retime_s()

    def race_s(self, contenders: int, measured: Sequence[PairedTiming]) -> float:
        """One round of the final race with `contenders` (0 when there are none; nan: no cost known)."""
        if contenders <= 0:
            return 0.0
        return math.ceil(contenders / max(1, self.parallel)) * self.retime_s(measured)

    def fitting(self, contenders: int, seconds: float, measured: Sequence[PairedTiming]) -> int:
        """How many of `contenders` one round can race in `seconds` (all of them while no cost is known)."""
        one = self.retime_s(measured)
        if not math.isfinite(one):
            return contenders
        rounds = int(max(0.0, seconds) // one) if one > 0 else contenders
        return min(contenders, rounds * max(1, self.parallel))
