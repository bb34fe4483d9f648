"""The replica's trusted runner: a thread that checks served tokens against the float64 reference, off the
engine loop's thread (the engine keeps stepping every other request meanwhile).

Two kinds of work, most urgent first:
1. **`verify: all`** streams: a request's tokens wait (`Stream.made`) until this thread has checked them
   teacher-forced against the reference (`check(request, tokens)`: every token so far obeys the judge's
   rule), then go to the client together. A check is due once `verify_chunk` tokens wait, or at the
   request's end; a stream with nothing released yet goes first (its client waits for a first token). A
   check covers every token made by the time it starts, so a busy verifier checks longer prefixes less
   often instead of falling further behind. A failed check hands `on_problem` the reason: the replica
   fails the engine (every stream, this one included, gets the error; nothing of the failed chunk is
   released).
2. **Canaries** (`evaluators.served.canaries`): each whole request checked once it ended, as the judge scores one.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Callable

from evaluators.served.stream import DONE, Stream, Token
from evo.workloads.generation import GenerationRequest

logger = logging.getLogger(__name__)

FIRST, NEXT, CANARY = 0, 1, 2  # priorities: a stream's first release, its later ones, canaries

Check = Callable[[GenerationRequest, list], str]


class Verifier:
    """See the module. `check_prefix(request, tokens)` and `check_whole(request, tokens)` return "" or the
    problem; `retire(stream)` is told when a stream has had its end handed over."""

    def __init__(self, check_prefix: Check, check_whole: Check, on_problem: Callable[[str], None],
                 retire: Callable[[Stream], None], name: str = "verifier") -> None:
        self._check_prefix, self._check_whole = check_prefix, check_whole
        self._on_problem, self._retire = on_problem, retire
        self.chunk = 8
        self.stats = {"checks": 0, "tokens_released": 0, "busy_s": 0.0, "canaries": 0, "canaries_passed": 0,
                      "canaries_failed": 0}
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the loop's side
    def offer(self, stream: Stream) -> None:
        """A verified stream got tokens (its `made` and `engine_done` updated under its lock): queue a check if
        one is due and none waits."""
        with stream.lock:
            waiting = len(stream.made) - stream.released
            if stream.queued or stream.closed or not (waiting >= self.chunk or (stream.engine_done and waiting)):
                return
            stream.queued = True
        self._queue.put((FIRST if stream.released == 0 else NEXT, next(self._order), stream))

    def offer_canary(self, stream: Stream) -> None:
        """A canary ended: check it whole."""
        self._queue.put((CANARY, next(self._order), stream))

    def idle(self) -> bool:
        return self._queue.unfinished_tasks == 0

    def close(self) -> None:
        self._stop.set()
        self._queue.put((-1, -1, None))

    # ------------------------------------------------------------------ its thread
    def _run(self) -> None:
        while not self._stop.is_set():
            kind, _, stream = self._queue.get()
            try:
                if stream is None:
                    continue
                start = time.perf_counter()
                if kind == CANARY:
                    self._canary(stream)
                else:
                    self._release(stream)
                self.stats["busy_s"] += time.perf_counter() - start
            except Exception as exc:  # noqa: BLE001 - nothing unverified may go out: the engine stops serving
                logger.exception("verifying a served request failed")
                self._on_problem(f"the replica's verifier failed on request {stream.request.id}: "
                                 f"{type(exc).__name__}: {exc}")
            finally:
                self._queue.task_done()

    def _release(self, stream: Stream) -> None:
        with stream.lock:  # this check covers every token made so far: the loop counts what waits from here on
            stream.queued = False
            start, upto, done, closed = stream.released, len(stream.made), stream.engine_done, stream.closed
            stream.released = upto
        if closed:
            return
        if stream.cancelled.is_set():  # its client went away: nothing more to check for it
            stream.hand(DONE)
            self._retire(stream)
            return
        if upto > start:
            tokens = stream.made[:upto]
            problem = self._check_prefix(stream.request, tokens)
            self.stats["checks"] += 1
            if problem:
                self._on_problem(f"verify: all: {problem}")
                return
            now = time.perf_counter()
            for i in range(start, upto):
                stream.hand(Token(tokens[i], now, done and i == upto - 1))
            self.stats["tokens_released"] += upto - start
        if done:
            stream.hand(DONE)
            self._retire(stream)
        else:
            self.offer(stream)  # what arrived while this check ran

    def _canary(self, stream: Stream) -> None:
        self.stats["canaries"] += 1
        problem = self._check_whole(stream.request, list(stream.made))
        if problem:
            self.stats["canaries_failed"] += 1
            self._on_problem(f"a canary request (the replica's own, drawn like its users'): {problem}")
        else:
            self.stats["canaries_passed"] += 1
        self._retire(stream)
