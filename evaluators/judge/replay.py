"""The judge as a client of a generation engine: replay requests, stamp every token on the judge's clock,
then score each request's own tokens.

`replay` sends each request as its client would (`Send`): at its arrival time; in a closed loop when one of
the `concurrency` clients is free; or once another request has k tokens (a request arriving while others
decode). A client may go away after its request's k-th token: the judge aborts the request in the engine (its
tokens after the k-th in the same exchange never reach the client and are dropped).
It calls the engine's `step` while anything is in flight (an exchange: one engine step, or the genome's
`steps_per_exchange`) and stamps each token when `step` hands it back:
an engine that computes everything and then bursts its tokens gets the TTFT a client would have seen. The
engine's own clock counts for nothing. Tokens that break the contract (for a request never sent, after a
request's last token: past `max_tokens` or its stop id, after the judge aborted it, a last token not marked
finished) are recorded as violations, each naming the request and step; so is a request the engine holds
that gets no token for too many steps (the stall rule: an engine that leaks its rows and stops admitting
is wrong, not slow). A request still unfinished at the deadline is late (a timeout).

`score` then checks each request's tokens against a float64 reference run over the request's prompt
and its own tokens (teacher-forced over what the engine produced, which is legitimate: the engine was
never given them): at every step the engine's token must be what the request's rule picks (greedy: the
reference's argmax, or a near-tie with it, its reference logit within `tolerance` of the top one; sampled:
the seeded draw of `evo.workloads.sampling`, near ties alike); a request ends at `max_tokens` or at its
first stop id, never before; an aborted request's tokens up to its abort are scored as a prefix
(`prefix_problem`). Batch mates cannot change a request's tokens beyond that rule.

Here the engine is any object with the `GenerationEngine` methods: in the judge, `ConfinedGenerator`,
a client of the engine's sandboxed process (`evaluators.sandbox.process.EngineProcess` built with the
generation contract), whose answers are checked before they count; in tests, an engine object itself.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterable, Sequence

import numpy as np

from evaluators.judge.request_ids import RequestIds
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
    one exchange (the candidate frozen in between); a step's events must be [id, token, finished] triples.
    `steps_per_exchange` (the genome's, `GenerationWorkload.exchange_steps`): `step` asks for up to that many
    scheduling steps at once and returns all their tokens."""

    MAX_EVENTS = 1 << 14  # a step's tokens: more than this is not an answer

    def __init__(self, process, timeout_s: float = 60.0, steps_per_exchange: int = 1) -> None:
        self.process, self.deadline = process, time.perf_counter() + timeout_s
        self.steps_per_exchange = max(1, int(steps_per_exchange))

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
        reply = self.process.step(self._left(), self.steps_per_exchange)
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


@dataclass(frozen=True)
class Send:
    """One request of a replay and how its client behaves: it sends the request at `arrival_s` (seconds from
    the replay's start; None in a closed loop: when one of the `concurrency` clients is free), and with `after`
    = (request id, k) not before that request has k tokens (or ended); with `abort_after` = k >= 1 it goes away
    right after the request's k-th token (the judge aborts it in the engine; 0: never)."""

    request: GenerationRequest
    arrival_s: float | None = 0.0
    after: tuple[int, int] | None = None
    abort_after: int = 0


@dataclass
class _Flight:
    send: Send
    request: GenerationRequest  # as the engine was sent it (its id the engine's)
    sent_s: float
    allowance: int  # engine steps it may go without a token while the engine holds it (0: no stall rule)
    token_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    aborted: bool = False
    progress_step: int = 0  # the step of its last token (or of its sending)

    @property
    def client_gone(self) -> bool:
        """Its client went away (it has the k-th token its client leaves after) and the judge has not ended it."""
        return not self.finished and bool(self.send.abort_after) and len(self.tokens) >= self.send.abort_after


@dataclass(frozen=True)
class Replay:
    """What the judge saw: per request (in the order sent to `replay`) its tokens and timeline, the contract's
    violations, the replay's duration on the judge's clock, and the requests the judge aborted."""

    requests: tuple[GenerationRequest, ...]
    tokens: tuple[tuple[int, ...], ...]
    timelines: tuple[RequestTimeline, ...]
    violations: tuple[str, ...]
    duration_s: float
    late: tuple[str, ...] = ()  # requests unfinished or unsent at the replay's deadline (a timeout, not a breach)
    aborted: tuple[int, ...] = ()  # ids of requests the judge aborted (their tokens are a prefix, scored as such)

    def served(self) -> tuple[RequestTimeline, ...]:
        """The timelines of the requests not aborted: what a replay's figures are read off."""
        gone = set(self.aborted)
        return tuple(t for r, t in zip(self.requests, self.timelines) if r.id not in gone)


def replay(engine: GenerationEngine, trace: Sequence[TraceRequest] | Sequence[Send],
           prompts: Sequence[Sequence[int]] | None = None, concurrency: int = 0, stop_ids: tuple[int, ...] = (),
           deadline_s: float = 60.0, clock: Callable[[], float] = time.perf_counter, stall_steps: int = 0,
           ids: RequestIds | None = None) -> Replay:
    """Replay `trace` against `engine`: `Send`s, or trace requests with each one's prompt token ids (request
    id = its index, greedy, `stop_ids`). `concurrency`: clients of a closed loop (requests without an arrival
    time), or the cap on requests in flight (0: none). `stall_steps` (the most positions a request holds, P + N;
    0: no stall rule): a request the engine holds that gets no token in (requests held when it was sent + 1) x
    `stall_steps` engine steps, whether or not others progress, is a violation, and the replay stops there.
    `ids`: each request is sent under the next id of the engine's sequence (`evaluators.judge.request_ids`), so the
    engine sees ids counting up in the order it was sent requests, as from any client; a `Send`'s own id then
    only names it within the replay (for `after`). The result names requests by the ids the engine saw."""
    sends = _as_sends(trace, prompts, stop_ids)
    order = sorted(range(len(sends)), key=lambda i: (sends[i].arrival_s or 0.0, i))
    pending = [sends[i] for i in order]  # in sending order; a trigger or the cap holds some back
    flights: dict[int, _Flight] = {}  # by the id the engine saw
    planned: dict[int, _Flight] = {}  # by the Send's own id
    violations: list[str] = []
    aborted: list[int] = []
    start, steps, late = clock(), 0, ()
    free_slots = [0.0] * concurrency  # a min-heap: when each free slot of the cap (a closed loop's client) freed
    while pending or any(not f.finished for f in flights.values()):
        now = clock() - start
        if now > deadline_s:
            late = tuple(f"request {i}: not finished within the replay's {deadline_s:g} s"
                         for i, f in flights.items() if not f.finished)
            late += tuple(f"request {s.request.id}{'' if ids is None else ' (of the replay)'}: never sent, the replay"
                          " ran out of time" for s in pending)
            break
        in_flight = sum(not f.finished for f in flights.values())
        held_back = []
        for send in pending:
            triggered = _triggered(send, planned)
            if (send.arrival_s or 0.0) > now or triggered is None or (concurrency and in_flight >= concurrency):
                held_back.append(send)
                continue
            # a client sends at its arrival time (or its trigger's), or when the slot it takes freed, even while
            # the engine is mid-step: the time the judge spent waiting for that step counts against the engine
            freed = heapq.heappop(free_slots) if concurrency else 0.0
            request = send.request if ids is None else replace(send.request, id=ids.next())
            flight = _Flight(send, request, max(send.arrival_s or 0.0, triggered, freed), (in_flight + 1) * stall_steps,
                             progress_step=steps)
            flights[request.id] = planned[send.request.id] = flight
            engine.add(request)
            in_flight += 1
        pending = held_back
        if not in_flight:  # the next arrival is in the future: wait for it, on the judge's clock
            due = min((s.arrival_s or 0.0 for s in pending), default=0.0)
            time.sleep(min(0.001, max(0.0, due - (clock() - start))))
            continue
        events = engine.step()  # an exchange: up to its steps_per_exchange engine steps, all their tokens
        stamp, steps = clock() - start, steps + getattr(engine, "steps_per_exchange", 1)
        problems, ended = _receive(flights, events, steps, stamp)
        violations += problems
        left = _leave(engine, flights)
        aborted += left
        for _ in range((ended + len(left)) if concurrency else 0):
            heapq.heappush(free_slots, stamp)
        stalled = _stalled(flights, steps, stall_steps)
        if stalled:
            violations.append(stalled)
            break
    ordered = [planned[s.request.id] for s in sends if s.request.id in planned]
    return Replay(tuple(f.request for f in ordered), tuple(tuple(f.tokens) for f in ordered),
                  tuple(RequestTimeline(f.sent_s, tuple(f.token_s), len(f.request.prompt)) for f in ordered),
                  tuple(violations), clock() - start, late, tuple(aborted))


def _receive(flights: dict[int, _Flight], events: list[TokenEvent], step: int, stamp: float) -> tuple[list[str], int]:
    """A step's tokens onto their requests' flights: (the contract's violations, how many requests ended)."""
    violations, ended = [], 0
    for event in events:
        flight = flights.get(event.request_id)
        if flight is not None and flight.client_gone:
            continue  # its client went away at its k-th token, earlier in this exchange: the rest never reach it
        problem = _breach(flight, event.request_id, step)
        if problem:
            violations.append(problem)
            continue
        flight.tokens.append(int(event.token))
        flight.token_s.append(stamp)
        flight.progress_step = step
        request = flight.request
        last = len(flight.tokens) >= request.max_tokens or int(event.token) in request.stop_ids
        if last and not event.finished:  # the judge ends it anyway: nothing past its last token counts
            violations.append(f"request {event.request_id}: its last token (step {step}) not marked finished")
        flight.finished = bool(event.finished) or last
        ended += flight.finished
    return violations, ended


def _leave(engine: GenerationEngine, flights: dict[int, _Flight]) -> list[int]:
    """The clients that go away now, after the step that brought their request's k-th token: each request aborted
    in the engine; their ids."""
    gone = []
    for flight in flights.values():
        if flight.client_gone:
            engine.abort(flight.request.id)
            flight.finished = flight.aborted = True
            gone.append(flight.request.id)
    return gone


def _as_sends(trace, prompts, stop_ids: tuple[int, ...]) -> list[Send]:
    """`trace` as Sends (trace requests with their prompts: id = index, greedy, `stop_ids`); ValueError where two
    requests share an id or a trigger names a request not sent before it."""
    if prompts is not None:
        trace = [Send(GenerationRequest(t.index, tuple(int(x) for x in p), t.max_tokens, tuple(stop_ids)), t.arrival_s)
                 for t, p in zip(trace, prompts)]
    sends, seen = list(trace), set()
    for send in sends:
        if send.request.id in seen:
            raise ValueError(f"request {send.request.id} appears twice in the replay; ids must be unique")
        if send.after is not None and send.after[0] not in seen:
            raise ValueError(f"request {send.request.id} is sent after request {send.after[0]}, which is not sent "
                             "before it in the replay")
        if send.abort_after < 0:
            raise ValueError(f"request {send.request.id}: abort_after must be >= 0 (0: never), got {send.abort_after}")
        seen.add(send.request.id)
    return sends


def _triggered(send: Send, flights: dict[int, _Flight]) -> float | None:
    """When the send's trigger fired (its request's k-th token, or its end), 0.0 without one, None: not yet."""
    if send.after is None:
        return 0.0
    flight = flights.get(send.after[0])
    if flight is None:
        return None
    k = send.after[1]
    if len(flight.tokens) >= k:
        return flight.token_s[k - 1] if k >= 1 else flight.sent_s
    if flight.finished:
        return flight.token_s[-1] if flight.token_s else flight.sent_s
    return None


def _stalled(flights: dict[int, _Flight], steps: int, stall_steps: int) -> str:
    """The first request the engine holds that went past its allowance of steps without a token, or ""."""
    for rid, f in flights.items():
        if not f.finished and f.allowance and steps - f.progress_step > f.allowance:
            return (f"request {rid}: no token in {f.allowance} steps while the engine held it (the stall rule: "
                    f"(requests held when it was sent + 1) x {stall_steps} steps; it had {len(f.tokens)} of "
                    f"{f.request.max_tokens} tokens)")
    return ""


def _breach(flight: _Flight | None, request_id: int, step: int) -> str:
    if flight is None:
        return f"request {request_id}: a token for a request the judge never sent, at step {step}"
    if flight.aborted:
        return f"request {request_id}: a token after the judge aborted it, at step {step}"
    if flight.finished:
        return f"request {request_id}: a token after its last, at step {step}"
    return ""


Reference = Callable[[Sequence[int], Sequence[int]], np.ndarray]
Alternatives = Callable[[Sequence[int], Sequence[int]], Iterable[np.ndarray]]


def score(result: Replay, reference_logits: Reference, tolerance: float | None, vocab: int,
          alternatives: Alternatives | None = None, tally=None) -> list[str]:
    """Each request's problems with its own tokens (see the module); [] when every request is right.
    `vocab`: tokens must lie in [0, vocab), checked before the reference is handed any of them.
    `reference_logits(prompt, tokens)`: the float64 reference's logits [len(tokens), V], row i the
    prediction of tokens[i] from the prompt and tokens[:i] (one teacher-forced pass over the engine's own).
    `alternatives(prompt, tokens)`: the reference's other readings of the same tokens, each as those logits, where
    a discrete choice inside the model (an MoE router's) was a near tie that an engine's rounding may take the
    other way; asked only when the first reading fails, and the tokens pass if any reading passes them all.
    A request the judge aborted is scored on the tokens it had (a prefix: no length rule).
    `tally` (an `evaluators.judge.accuracy.Tally`): each request's tokens marked against the reference's first
    reading; `tolerance` None (the accuracy contract's budget mode): no token is held to the rule here, the
    tally's budget judges them (every other rule still holds)."""
    problems = list(result.violations)
    aborted = set(result.aborted)
    for request, tokens in zip(result.requests, result.tokens):
        if request.id in aborted:
            problem = prefix_problem(request, tokens, reference_logits, tolerance, alternatives, vocab, tally)
            problems += [problem] if problem else []
        else:
            problems += request_problems(request, tokens, reference_logits, tolerance, vocab, alternatives, tally)
    return problems


def request_problems(request: GenerationRequest, tokens: Sequence[int], reference_logits: Reference,
                     tolerance: float | None, vocab: int, alternatives: Alternatives | None = None,
                     tally=None) -> list[str]:
    """A finished request's problems ([] when right): every token by the rule, and it ends at max_tokens or at
    its first stop id, never before."""
    name = f"request {request.id}"
    if not tokens:
        return [f"{name}: no token"]
    problem = _prefix_bounds(request, tokens, vocab)
    if problem:
        return [f"{name}: {problem}"]
    if not any(t in request.stop_ids for t in tokens) and len(tokens) < request.max_tokens:
        return [f"{name}: stopped after {len(tokens)} of {request.max_tokens} tokens without a stop id"]
    problem = _reference_problem(request, tokens, reference_logits, tolerance, alternatives, tally)
    return [f"{name}: {problem}"] if problem else []


def prefix_problem(request: GenerationRequest, tokens: Sequence[int], reference_logits: Reference,
                   tolerance: float | None, alternatives: Alternatives | None = None, vocab: int = 0,
                   tally=None) -> str:
    """Why the tokens a request has so far break the rule, naming the request ("" when each obeys it): no more
    than max_tokens, none after a stop id, each the rule's pick from the reference (any reading of it). No length
    rule: a prefix may end anywhere. `vocab` > 0: tokens outside [0, vocab) are refused before the reference sees
    them (without it, they must have been checked already)."""
    if not tokens:
        return ""
    problem = _prefix_bounds(request, tokens, vocab) or _reference_problem(request, tokens, reference_logits,
                                                                            tolerance, alternatives, tally)
    return f"request {request.id}: {problem}" if problem else ""


def _prefix_bounds(request: GenerationRequest, tokens: Sequence[int], vocab: int) -> str:
    """Tokens outside the vocabulary (when `vocab` > 0), past max_tokens or after a stop id: why, or ""."""
    outside = next((step for step, t in enumerate(tokens) if not 0 <= t < vocab), None) if vocab else None
    if outside is not None:
        return f"step {outside}: token {tokens[outside]} outside the vocabulary [0, {vocab - 1}]"
    if len(tokens) > request.max_tokens:
        return f"{len(tokens)} tokens, more than its max_tokens {request.max_tokens}"
    stops = [i for i, t in enumerate(tokens) if t in request.stop_ids]
    if stops and stops[0] < len(tokens) - 1:
        return f"tokens after the stop id at step {stops[0]}"
    return ""


def _reference_problem(request: GenerationRequest, tokens: Sequence[int], reference_logits: Reference,
                       tolerance: float | None, alternatives: Alternatives | None, tally=None) -> str:
    """The first token the rule does not pick under the reference's first reading and under every other, or ""
    (always "" in budget mode, `tolerance` None); the tokens marked on `tally` if given."""
    rows = reference_logits(request.prompt, tokens)
    if tally is not None:
        tally.score(request, tokens, rows)
    if tolerance is None:
        return ""
    problem = _first_problem(request, tokens, rows, tolerance)
    if not problem:
        return ""
    readings = 0
    for rows in (alternatives(request.prompt, tokens) if alternatives is not None else ()):
        readings += 1
        if not _first_problem(request, tokens, rows, tolerance):
            return ""
    also = f" (and under each of {readings} readings routing near-tied experts the other way)" if readings else ""
    return f"{problem}{also}"


def _first_problem(request: GenerationRequest, tokens: Sequence[int], logits, tolerance: float) -> str:
    rows = np.asarray(logits, dtype=np.float64)
    for step, (token, row) in enumerate(zip(tokens, rows)):
        problem = sampling.check(row, token, request.temperature, request.top_p, request.seed, step, tolerance)
        if problem:
            return f"step {step}: {problem}"
    return ""
