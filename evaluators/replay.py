"""The judge as a client of a generation engine: replay a request trace, stamp every token on the
judge's clock, then score each request's own tokens.

`replay` sends each request when the trace says (its arrival time; in a closed loop when one of the
`concurrency` clients is free), calls the engine's `step` while anything is in flight, and stamps each
token when `step` hands it back: an engine that computes everything and then bursts its tokens gets
the TTFT a client would have seen. The engine's own clock counts for nothing. Tokens that break the
contract (for a request never sent, after a request's last token: past `max_tokens` or its stop id,
a last token not marked finished, a request still unfinished at the deadline) are recorded as
violations, each naming the request and step.

`score` then checks each request's tokens against a float64 reference run over the request's prompt
and its own tokens (teacher-forced over what the engine produced, which is legitimate: the engine was
never given them): at every step the engine's token must be the reference's argmax, or a near-tie with
it (its reference logit within `tolerance` of the top one); a request ends at `max_tokens` or at its
first stop id, never before. Batch mates cannot change a request's tokens beyond that rule.

Here the engine is any object with the `GenerationEngine` methods: in the judge, `ConfinedGenerator`,
a client of the engine's sandboxed process (`evaluators.sandbox.EngineProcess` built with the
generation contract), whose answers are checked before they count; in tests, an engine object itself.
"""
from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from evo.core.stream_metrics import RequestTimeline
from evo.core.trace import TraceRequest
from evo.workloads import sampling
from evo.workloads.generation import GenerationEngine, GenerationRequest, TokenEvent


class GenerationError(RuntimeError):
    """The engine raised, or answered something other than the contract's answer."""


class ForbiddenCallError(GenerationError):
    """The engine called a function it must not (the reference, a baseline) while it ran."""


class ConfinedGenerator:
    """A generation engine in its own confined process, seen through its channel: `add` and `step` each
    one exchange (the candidate frozen in between); a step's events must be [id, token, finished] triples."""

    MAX_EVENTS = 1 << 14  # a step's tokens: more than this is not an answer

    def __init__(self, process, timeout_s: float = 60.0) -> None:
        self.process, self.deadline = process, time.perf_counter() + timeout_s

    def _left(self) -> float:
        """Seconds to the deadline, for one exchange (every exchange is bounded by what is left)."""
        return max(0.001, self.deadline - time.perf_counter())

    def add(self, request: GenerationRequest) -> None:
        reply = self.process.add(asdict(request), self._left())
        _forbidden(reply)
        if reply.get("op") != "added":
            raise GenerationError(f"adding request {request.id}: {_why(reply)}")

    def abort(self, request_id: int) -> None:
        reply = self.process.abort(request_id, self._left())
        _forbidden(reply)
        if reply.get("op") != "aborted":
            raise GenerationError(f"aborting request {request_id}: {_why(reply)}")

    def step(self) -> list[TokenEvent]:
        reply = self.process.step(self._left())
        _forbidden(reply)
        if reply.get("op") != "stepped":
            raise GenerationError(f"a step: {_why(reply)}")
        events = reply.get("events")
        if not (isinstance(events, list) and len(events) <= self.MAX_EVENTS and all(
                isinstance(e, list) and len(e) == 3 and type(e[0]) is int and type(e[1]) is int
                and type(e[2]) is bool for e in events)):
            raise GenerationError("a step answered something other than [request id, token, finished] triples")
        return [TokenEvent(*e) for e in events]


def _forbidden(reply: dict) -> None:
    if reply.get("forbidden_calls") or reply.get("forbidden"):
        calls = ", ".join(sorted(set(reply.get("forbidden_calls") or ()))) or str(reply.get("message", ""))[:200]
        raise ForbiddenCallError(f"the engine called {calls}: engines must compute their tokens, not call the "
                                 "workload's reference or a baseline")


def _why(reply: dict) -> str:
    if reply.get("op") == "raised":
        return f"{reply.get('type', 'error')}: {str(reply.get('message', ''))[:300]}"
    return f"unexpected answer {str(reply.get('op'))[:40]!r}"


@dataclass
class _Flight:
    request: GenerationRequest
    sent_s: float
    token_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finished: bool = False


@dataclass(frozen=True)
class Replay:
    """What the judge saw: per request (trace order) its tokens and timeline, the contract's violations
    and the replay's duration on the judge's clock."""

    requests: tuple[GenerationRequest, ...]
    tokens: tuple[tuple[int, ...], ...]
    timelines: tuple[RequestTimeline, ...]
    violations: tuple[str, ...]
    duration_s: float
    late: tuple[str, ...] = ()  # requests unfinished or unsent at the replay's deadline (a timeout, not a breach)


def replay(engine: GenerationEngine, trace: Sequence[TraceRequest], prompts: Sequence[Sequence[int]],
           concurrency: int = 0, stop_ids: tuple[int, ...] = (), deadline_s: float = 60.0,
           clock: Callable[[], float] = time.perf_counter) -> Replay:
    """Replay `trace` (with each request's prompt token ids) against `engine`; `concurrency`: clients of a
    closed loop (requests without an arrival time), or the cap on requests in flight (0: none)."""
    pending = deque(sorted(zip(trace, prompts), key=lambda tp: (tp[0].arrival_s or 0.0, tp[0].index)))
    flights: dict[int, _Flight] = {}
    violations: list[str] = []
    start, steps, late = clock(), 0, ()
    free_slots = [0.0] * concurrency  # a min-heap: when each free slot of the cap (a closed loop's client) freed
    while pending or any(not f.finished for f in flights.values()):
        now = clock() - start
        if now > deadline_s:
            late = tuple(f"request {i}: not finished within the replay's {deadline_s:g} s"
                         for i, f in sorted(flights.items()) if not f.finished)
            late += tuple(f"request {t.index}: never sent, the replay ran out of time" for t, _ in pending)
            break
        in_flight = sum(not f.finished for f in flights.values())
        while pending and (pending[0][0].arrival_s or 0.0) <= now and (not concurrency or in_flight < concurrency):
            item, prompt = pending.popleft()
            request = GenerationRequest(item.index, tuple(int(t) for t in prompt), item.max_tokens, stop_ids)
            # a client sends at its arrival time, or when the slot it takes freed, even while the engine is
            # mid-step: the time the judge spent waiting for that step counts against the engine
            freed = heapq.heappop(free_slots) if concurrency else 0.0
            flights[item.index] = _Flight(request, max(item.arrival_s or 0.0, freed))
            engine.add(request)
            in_flight += 1
        if not in_flight:  # the next arrival is in the future: wait for it, on the judge's clock
            time.sleep(min(0.001, max(0.0, (pending[0][0].arrival_s or 0.0) - (clock() - start))))
            continue
        events = engine.step()
        stamp, steps = clock() - start, steps + 1
        for event in events:
            flight = flights.get(event.request_id)
            problem = _breach(flight, event.request_id, steps)
            if problem:
                violations.append(problem)
                continue
            flight.tokens.append(int(event.token))
            flight.token_s.append(stamp)
            last = len(flight.tokens) >= flight.request.max_tokens or int(event.token) in stop_ids
            if last and not event.finished:  # the judge ends it anyway: nothing past its last token counts
                violations.append(f"request {event.request_id}: its last token (step {steps}) not marked finished")
            flight.finished = bool(event.finished) or last
            if flight.finished and concurrency:
                heapq.heappush(free_slots, stamp)
    ordered = [flights[i] for i in sorted(flights)]
    return Replay(tuple(f.request for f in ordered), tuple(tuple(f.tokens) for f in ordered),
                  tuple(RequestTimeline(f.sent_s, tuple(f.token_s), len(f.request.prompt)) for f in ordered),
                  tuple(violations), clock() - start, late)


def _breach(flight: _Flight | None, request_id: int, step: int) -> str:
    if flight is None:
        return f"request {request_id}: a token for a request the judge never sent, at step {step}"
    if flight.finished:
        return f"request {request_id}: a token after its last, at step {step}"
    return ""


Reference = Callable[[Sequence[int], Sequence[int]], np.ndarray]
Alternatives = Callable[[Sequence[int], Sequence[int]], Iterable[np.ndarray]]


def score(result: Replay, reference_logits: Reference, tolerance: float, vocab: int,
          alternatives: Alternatives | None = None) -> list[str]:
    """Each request's problems with its own tokens (see the module); [] when every request is right.
    `vocab`: tokens must lie in [0, vocab), checked before the reference is handed any of them.
    `reference_logits(prompt, tokens)`: the float64 reference's logits [len(tokens), V], row i the
    prediction of tokens[i] from the prompt and tokens[:i] (one teacher-forced pass over the engine's own).
    `alternatives(prompt, tokens)`: the reference's other readings of the same tokens, each as those logits, where
    a discrete choice inside the model (an MoE router's) was a near tie that an engine's rounding may take the
    other way; asked only when the first reading fails, and the tokens pass if any reading passes them all."""
    problems = list(result.violations)
    for request, tokens in zip(result.requests, result.tokens):
        problems += request_problems(request, tokens, reference_logits, tolerance, vocab, alternatives)
    return problems


def request_problems(request: GenerationRequest, tokens: Sequence[int], reference_logits: Reference,
                      tolerance: float, vocab: int, alternatives: Alternatives | None = None) -> list[str]:
    name = f"request {request.id}"
    if not tokens:
        return [f"{name}: no token"]
    outside = next((step for step, t in enumerate(tokens) if not 0 <= t < vocab), None)
    if outside is not None:
        return [f"{name}: step {outside}: token {tokens[outside]} outside the vocabulary [0, {vocab - 1}]"]
    if len(tokens) > request.max_tokens:
        return [f"{name}: {len(tokens)} tokens, more than its max_tokens {request.max_tokens}"]
    stops = [i for i, t in enumerate(tokens) if t in request.stop_ids]
    if stops and stops[0] < len(tokens) - 1:
        return [f"{name}: tokens after the stop id at step {stops[0]}"]
    if not stops and len(tokens) < request.max_tokens:
        return [f"{name}: stopped after {len(tokens)} of {request.max_tokens} tokens without a stop id"]
    problem = _first_problem(request, tokens, reference_logits(request.prompt, tokens), tolerance)
    if not problem:
        return []
    readings = 0
    for rows in (alternatives(request.prompt, tokens) if alternatives is not None else ()):
        readings += 1
        if not _first_problem(request, tokens, rows, tolerance):
            return []
    also = f" (and under each of {readings} readings routing near-tied experts the other way)" if readings else ""
    return [f"{name}: {problem}{also}"]


def _first_problem(request: GenerationRequest, tokens: Sequence[int], logits, tolerance: float) -> str:
    rows = np.asarray(logits, dtype=np.float64)
    for step, (token, row) in enumerate(zip(tokens, rows)):
        problem = sampling.check(row, token, request.temperature, request.top_p, request.seed, step, tolerance)
        if problem:
            return f"step {step}: {problem}"
    return ""
