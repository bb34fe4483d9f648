"""One served request's way out: the tokens a client is handed, in order, then one end (DONE or an error).

A `Stream` is filled by the replica's threads (the engine loop, the verifier, the watch) and read by one
client (iterating, or a `sink` called on the filling thread). What the engine made is kept apart from
what was released: under `verify: all` a token waits in `made` until the verifier has checked it against
the reference; otherwise the loop releases each token as it arrives. The first end handed over closes
the stream: nothing after it reaches the client (a verifier's late release, a second error).
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable

from evo.workloads.generation import GenerationRequest

DONE = None  # what a stream yields after its last token


@dataclass(frozen=True)
class Token:
    """One token of a stream, with the time the replica released it to the client (seconds, perf_counter)."""

    token: int
    at_s: float
    finished: bool


class Stream:
    """One request's tokens: iterate (blocking) until the last, or have each item handed to `sink` (a Token,
    an Exception, then DONE) from the replica's threads; `cancel` when the client goes away."""

    def __init__(self, request: GenerationRequest, sink: Callable[[object], None] | None = None,
                 verified: bool = False, canary: bool = False) -> None:
        self.request = request
        self.tokens: queue.Queue[Token | Exception | None] = queue.Queue()
        self._put = sink if sink is not None else self.tokens.put
        self.cancelled = threading.Event()
        self.verified = verified  # `verify: all`: a token is released only once the verifier checked it
        self.canary = canary  # the replica's own request: its tokens go to no client
        self.made: list[int] = []  # what the engine made for it (the loop appends)
        self.engine_done = False  # the engine marked its last token
        self.released = 0  # tokens a verification has taken up (handed to the client once it passed); else handed
        self.progress_s = 0.0  # when the engine last moved it (added, or its last token): the stall guard's clock
        self.last_token_s: float | None = None
        self.queued = False  # a verification of it waits in the verifier's queue
        self.closed = False  # its end (DONE or an error) was handed over
        self.lock = threading.Lock()

    def cancel(self) -> None:
        self.cancelled.set()

    def hand(self, item: Token | Exception | None) -> bool:
        """Hand `item` to the client unless the stream already ended; an end closes it. False when nothing
        was handed (closed)."""
        with self.lock:
            if self.closed:
                return False
            if item is DONE or isinstance(item, Exception):
                self.closed = True
            try:
                self._put(item)
            except Exception:  # noqa: BLE001 - a caller's sink that is gone (its event loop closed)
                pass
            return True

    def __iter__(self):
        while True:
            item = self.tokens.get()
            if item is DONE:
                return
            if isinstance(item, Exception):
                raise item
            yield item
