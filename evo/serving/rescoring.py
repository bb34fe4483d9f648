"""Live re-scoring: a sample of the engine calls a replica served, checked against the float64 reference
on a thread of its own, off the request path.

The engine was verified before it served, but an engine can be right while it is watched and wrong
later (after N calls, on some inputs). `Rescorer.offer` takes each engine call's inputs and the outputs
the replica copied at the answer, keeps a `fraction` of them (a bounded queue: a sample that does not
fit is skipped and counted, never waited for), and the thread compares them with the reference. A
mismatch calls `on_failure(engine, message)` once per engine: the replica takes that engine out of
service.
"""
from __future__ import annotations

import logging
import queue
import random
import threading
from typing import Any, Callable

logger = logging.getLogger("ray.serve")


class Rescorer:
    def __init__(self, on_failure: Callable[[Any, str], None], capacity: int = 64) -> None:
        self.fraction = 0.0
        self.stats = {"sampled": 0, "passed": 0, "failed": 0, "skipped": 0, "last_failure": None}
        self._on_failure = on_failure
        self._queue: queue.Queue = queue.Queue(maxsize=capacity)
        self._random = random.Random()  # which calls are sampled: not the engine's to predict
        self._failed: set[int] = set()  # ids of the engines already reported
        threading.Thread(target=self._run, name="rescorer", daemon=True).start()

    def offer(self, loaded: Any, calls: list[tuple[dict, dict]]) -> None:
        """Sample `calls` (each an engine call's (inputs, outputs)) of the engine `loaded.engine`."""
        for inputs, outputs in calls:
            if self._random.random() >= self.fraction:
                continue
            try:
                self._queue.put_nowait((loaded, inputs, outputs))
                self.stats["sampled"] += 1
            except queue.Full:
                self.stats["skipped"] += 1

    def wait_idle(self) -> None:
        """Return once every sample offered so far is scored (tests, shutdown)."""
        self._queue.join()

    def _run(self) -> None:
        while True:
            loaded, inputs, outputs = self._queue.get()
            try:
                self._score(loaded, inputs, outputs)
            except Exception:  # noqa: BLE001 - a broken sample must not stop the thread
                logger.exception("re-scoring a served call failed")
            finally:
                self._queue.task_done()

    def _score(self, loaded: Any, inputs: dict, outputs: dict) -> None:
        problem, rel = loaded.engine.rescore(inputs, outputs)
        if not problem:
            self.stats["passed"] += 1
            return
        self.stats["failed"] += 1
        message = f"engine {loaded.record.genome.hash} answered a served call wrongly: {problem}"
        self.stats["last_failure"] = message
        if id(loaded) not in self._failed:
            self._failed.add(id(loaded))
            logger.error("live re-scoring: %s; taking it out of service", message)
            self._on_failure(loaded, message)
