"""Fault injection for crash tests: `EVO_CRASH_AT=point:n[,point:n]` SIGKILLs this process the n-th
time `crash_point(point)` is reached. Points: "propose" (after a generation is asked, before any of
it is evaluated), "evaluate" (after a result is told), "evidence" (after a generation's Parquet file
is written, before its checkpoint). Unset in normal runs, where it costs one dict lookup."""
from __future__ import annotations

import collections
import os
import signal

_reached: collections.Counter[str] = collections.Counter()


def crash_point(name: str) -> None:
    spec = os.environ.get("EVO_CRASH_AT")
    if not spec:
        return
    _reached[name] += 1
    for item in spec.split(","):
        point, _, count = item.partition(":")
        if point == name and _reached[name] == int(count or 1):
            os.kill(os.getpid(), signal.SIGKILL)
