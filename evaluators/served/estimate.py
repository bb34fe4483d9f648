"""A replica's running estimate of its engine's accuracy: the accuracy contract (`evaluators.judge.accuracy`)
applied to what the replica checks while it serves.

The served engine is judged under the mode its run declared (the Serve-side judge's `evaluator.accuracy`):
- `exact`: every checked token is held to the rule on its own (a near tie within the workload's tolerance);
  the estimate is only reported;
- `budget`: no token is held to the rule on its own; every check the replica makes (each verified prefix under
  `verify: all`, each re-scored request, each canary) marks its tokens on one running tally, and the budget
  judges the tally after each check. Its tests already speak with confidence (intervals, binomial tails), so a
  running estimate is judged as it stands; the largest-gap bound holds on every token.
The tally keeps the marks of the `window` requests checked most recently (a request checked again, a growing
prefix, replaces its earlier marks and counts as recent): an engine that turns worse after a while is judged on
what it does now, and the replica's memory stays bounded.
"""
from __future__ import annotations

import threading
from typing import Any

from evaluators.judge.accuracy import Tally
from evo.core.records import null_for_nan

WINDOW = 4096  # requests whose marks the running estimate keeps


class RunningEstimate:
    """The running tally of one served engine (see the module); thread-safe: the verifier, the replica's
    re-scoring thread and /v1/engine use it at once. `judge` is the Serve-side `GenerationJudge`."""

    def __init__(self, judge, window: int = WINDOW) -> None:
        if window < 1:
            raise ValueError(f"the running estimate's window must be at least 1 request, got {window!r}")
        self.judge, self.window = judge, window
        self._tally: Tally = judge.tally()
        self._lock = threading.Lock()
        self.checks = 0
        self.breach = ""  # why the estimate broke the budget, once it did

    def add(self, checked: Tally) -> str:
        """Fold one check's marks (`checked`: a tally of the requests it marked) into the estimate: why the
        estimate now breaks the budget (naming it and how many requests it holds), or "" (always in exact mode)."""
        with self._lock:
            requests = self._tally.requests
            for name, marks in checked.requests.items():
                requests.pop(name, None)  # re-marked: its newest prefix, now the most recent
                self._tally.add(name, marks)
            while len(requests) > self.window:
                del requests[next(iter(requests))]  # the oldest first
            self.checks += 1
            why = self.judge.breach(self._tally)
            if why:
                why = f"its running estimate over the {len(requests)} requests checked last breaks {why}"
                self.breach = self.breach or why
            return why

    def info(self) -> dict[str, Any]:
        """What /v1/engine reports: the contract (mode, budget), the running figures (`Figures.to_dict`; null where
        nothing is measured yet or a figure is infinite, `max_gap_at` then naming the step), how many requests
        they hold, and the breach if there was one."""
        with self._lock:
            figures = self._tally.figures().to_dict()
            held = len(self._tally.requests)
        return null_for_nan({**self.judge.accuracy.to_dict(), "figures": figures, "requests_in_estimate": held,
                        "window": self.window, "checks": self.checks, "breach": self.breach or None})

