"""Request ids a generation engine cannot tell apart by who sent them.

The judge's replays and a Serve replica's users (and its canaries) draw ids the same way: one counter per
engine process, starting at a secret random offset and counting up by one. An engine sees consecutive
ids from an unpredictable start whoever sends them, so no id pattern (small ids, negative ids, ids that
restart at 0 every replay) marks a request as the judge's.
"""
from __future__ import annotations

import itertools
import secrets
import threading

FIRST_MAX = 1 << 40  # the first id lies in [1, FIRST_MAX): well inside int64 after any lifetime of requests


class RequestIds:
    """Thread-safe: `next()` is the next id of this engine's one sequence."""

    def __init__(self) -> None:
        self._count = itertools.count(1 + secrets.randbelow(FIRST_MAX - 1))
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            return next(self._count)
