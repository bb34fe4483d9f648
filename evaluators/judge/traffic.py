"""What the generation judge sends an engine: its check replay and its timed replays, drawn afresh for every
evaluation from the OS's randomness (never the run's seed nor the trace's), so that nothing in them (shapes,
lengths, ids, arrival times, where the contract's cases sit) marks a request as the judge's.

**The check replay** (`check_sends`) exercises the whole contract, every evaluation, with R (requests in
flight), P (longest prompt), N (most new tokens) and V (vocabulary) the preset's:
- a burst of at least 2R + 2 requests at once, with no cap: the engine must queue;
- the domain's edges: a one-token prompt (token V-1) asking for N tokens, a P-token prompt (from token 0)
  asking for one, one of both (every position an engine holds), a prompt of one token repeated;
- stop ids: one the float64 reference hits at a step in 1..STOP_STEPS (greedy, and under a seeded sampling),
  beside ids it need not hit, and requests with stop ids it may never hit;
- seeded sampled requests, one per SAMPLING pair, fresh seeds, run to their full length (9 to N tokens);
- 2R + 1 aborts mid-decode (after a request's k-th token, k in 1..MAX_ABORT_AFTER): R + 1 of the burst's
  requests, each added right before a request that outlives its abort (so the aborted row is never the last
  added), and R of the requests sent in their place; every abort is followed by a new request that may take
  the freed row, sent as the abort happens (a request arriving while others decode). More aborts than any
  gene space offers rows (2R): an engine that leaks a row per abort runs out, and the replay's stall rule
  finds the requests it no longer admits;
- every other request of a random shape, greedy or sampled, some with stop ids: user traffic.
Lengths are drawn log-uniformly over their ranges (short requests common, long ones present), so about four
times the old check's R + 2 uniform requests cost ~1.5 times as much (docs/generation.md).

**A timed replay** (`draw_timed`, then `timed_sends`) is the run's trace drawn afresh (its arrival process,
counts and ranges are the config's; its lengths and arrival times are not fixed by its seed), with the
contract's cases mixed in at random places: one of its requests has a stop id the reference hits, one is
sampled, and one more request (beyond the trace's count, left out of the replay's figures) is aborted
mid-decode. A drawn `TimedShape` fixes all of that but the prompts and seeds, which `timed_sends` draws for
each replay (the stop-id request's, `stop_case`, drawn beforehand: it asks the reference): paired re-timing
gives A and B of one round the same shape.

Requests are numbered 0.. within a replay here; `evaluators.judge.replay.replay` sends each under the next id of
the engine's own `RequestIds` sequence.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Mapping

import numpy as np

from evaluators.judge.replay import Send
from evo.core.trace import TraceRequest, TraceSpec, draw
from evo.workloads.generation import GenerationRequest

SAMPLING = ((1.0, 1.0), (0.7, 0.9), (1.5, 0.5), (0.3, 0.95))  # (temperature, top_p) of the sampled cases
STOP_STEPS = 4  # a hit stop id is the reference's own token at one of the first STOP_STEPS steps
MAX_ABORT_AFTER = 3  # an aborted request goes after its k-th token, k in [1, this]
LONG = MAX_ABORT_AFTER + 5  # tokens a request added right after an aborted one asks for, at least (N at most)

# (a request drafted with its prompt, sampling and seed; k) -> the reference's first k tokens by its rule
Prefix = Callable[[GenerationRequest, int], list[int]]


def log_uniform(rng: np.random.Generator, low: int, high: int) -> int:
    """An integer in [low, high], log-uniformly: short lengths common, the longest still drawn."""
    if high <= low:
        return int(low)
    return int(min(high, max(low, math.floor(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))))


class _Requests:
    """Numbers the replay's requests (0, 1, ...) and draws their prompts and seeds."""

    def __init__(self, rng: np.random.Generator, vocab: int, greedy_only: bool) -> None:
        self.rng, self.vocab, self.greedy_only, self.count = rng, vocab, greedy_only, 0

    def prompt(self, length: int) -> tuple[int, ...]:
        return tuple(int(t) for t in self.rng.integers(0, self.vocab, length))

    def sampling(self) -> tuple[float, float]:
        return SAMPLING[int(self.rng.integers(len(SAMPLING)))]

    def make(self, prompt, max_tokens: int, stop_ids=(), temperature: float = 0.0, top_p: float = 1.0
             ) -> GenerationRequest:
        """The next request; a baseline that decodes greedily only is sent it greedy (same shape)."""
        if self.greedy_only:
            temperature, top_p = 0.0, 1.0
        seed = int(self.rng.integers(0, 2**62)) if temperature else 0
        return GenerationRequest(self.number(), tuple(prompt), int(max_tokens), tuple(int(s) for s in stop_ids),
                                 temperature, top_p, seed)

    def number(self) -> int:
        """The next request's number in the replay."""
        self.count += 1
        return self.count - 1

    def misses(self, count: int, avoid=()) -> tuple[int, ...]:
        """`count` stop ids outside `avoid` (the reference may still reach them later: scored by the rule)."""
        out: list[int] = []
        while len(out) < min(count, self.vocab - len(set(avoid))):
            token = int(self.rng.integers(0, self.vocab))
            if token not in avoid and token not in out:
                out.append(token)
        return tuple(out)

    def hitting_stop(self, prompt, max_tokens: int, temperature: float, top_p: float, prefix: Prefix,
                     step: int = 0) -> GenerationRequest:
        """A request whose stop ids hold the reference's own token at step `step` (0: a random step in
        1..STOP_STEPS) by the request's rule, beside 0 to 2 ids outside its first tokens."""
        draft = self.make(prompt, max_tokens, (), temperature, top_p)
        step = min(step or int(self.rng.integers(1, STOP_STEPS + 1)), max_tokens)
        made = prefix(draft, step)
        stops = [made[step - 1], *self.misses(int(self.rng.integers(0, 3)), made)]
        return replace(draft, stop_ids=tuple(int(stops[i]) for i in self.rng.permutation(len(stops))))

    def random(self, P: int, N: int) -> GenerationRequest:
        """A request of a random shape, as users send: greedy, or sampled; a quarter with stop ids."""
        prompt, out = self.prompt(log_uniform(self.rng, 1, P)), log_uniform(self.rng, 1, N)
        stops = self.misses(int(self.rng.integers(1, 4))) if self.rng.random() < 0.25 else ()
        temperature, top_p = self.sampling() if self.rng.random() < 0.3 else (0.0, 1.0)
        return self.make(prompt, out, stops, temperature, top_p)


def check_sends(shape: Mapping[str, int], rng: np.random.Generator, prefix: Prefix, greedy_only: bool = False
                ) -> list[Send]:
    """The check replay (see the module) for a preset of `shape` (R, P, N, V), drawn from `rng`."""
    R, P, N, V = (int(shape[k]) for k in ("R", "P", "N", "V"))
    make = _Requests(rng, V, greedy_only)
    cases = [make.make([*make.prompt(0), V - 1], N),  # a one-token prompt at the vocabulary's top, N tokens
             make.make([0, *make.prompt(P - 1)], 1),  # the longest prompt from token 0, one token
             make.make(make.prompt(P), N),  # every position an engine holds
             make.make([int(rng.integers(0, V))] * log_uniform(rng, 1, P), log_uniform(rng, 1, N))]
    for temperature, top_p in ((0.0, 1.0), make.sampling()):  # stop ids the reference hits
        cases.append(make.hitting_stop(make.prompt(log_uniform(rng, 1, P)), log_uniform(rng, 1, N), temperature,
                                       top_p, prefix))
    cases.append(make.make(make.prompt(log_uniform(rng, 1, P)), log_uniform(rng, 1, N), make.misses(3)))
    for temperature, top_p in SAMPLING:  # sampled, to their full length
        cases.append(make.make(make.prompt(log_uniform(rng, 1, P)), log_uniform(rng, min(9, N), N), (),
                               temperature, top_p))
    aborts = R + 1 if N >= 2 else 0  # an abort needs a request of 2 or more tokens
    long = min(N, LONG)

    def outlives(request: GenerationRequest) -> bool:  # still running after a neighbour's abort
        return request.max_tokens >= long and not request.stop_ids

    while sum(outlives(c) for c in cases) < aborts:
        cases.append(make.make(make.prompt(log_uniform(rng, 1, P)), log_uniform(rng, long, N)))
    while len(cases) + aborts < 2 * R + 2:
        cases.append(make.random(P, N))
    burst = [cases[i] for i in rng.permutation(len(cases))]
    neighbours = [i for i, c in enumerate(burst) if outlives(c)]
    chosen = sorted(int(i) for i in rng.choice(neighbours, size=aborts, replace=False)) if aborts else []
    sends: list[Send] = []
    victims: list[Send] = []
    for i, request in enumerate(burst):
        if i in chosen:  # an aborted request, added right before one that outlives its abort
            victims.append(_victim(make, rng, P, N, arrival_s=0.0))
            sends.append(victims[-1])
        sends.append(Send(request, 0.0))
    for j, victim in enumerate(victims):  # each abort followed by a new request; R of those aborted in turn
        after = (victim.request.id, victim.abort_after)
        if j < R:
            again = _victim(make, rng, P, N, arrival_s=0.0, after=after)
            sends += [again, Send(make.random(P, N), 0.0, (again.request.id, again.abort_after))]
        else:
            sends.append(Send(make.random(P, N), 0.0, after))
    return sends


def _victim(make: _Requests, rng: np.random.Generator, P: int, N: int, arrival_s: float | None,
            after: tuple[int, int] | None = None) -> Send:
    """A request its client leaves after its k-th token (k < its max_tokens, no stop ids: it is still decoding)."""
    k = int(rng.integers(1, min(MAX_ABORT_AFTER, N - 1) + 1))
    temperature, top_p = make.sampling() if rng.random() < 0.3 else (0.0, 1.0)
    request = make.make(make.prompt(log_uniform(rng, 1, P)), int(rng.integers(k + 1, N + 1)), (), temperature, top_p)
    return Send(request, arrival_s, after, abort_after=k)


@dataclass(frozen=True)
class TimedShape:
    """One timed replay's shape (see the module): the drawn trace; which of its requests stops at the reference's
    token of step `stop_step` (`stop_at`) and which is sampled (`sampled_at`, by SAMPLING[`sampling`]); the extra
    request aborted after its `abort_after`-th token (`abort`), sent before trace request `abort_before` (or
    after all of them). None: that case does not fit the trace."""

    trace: tuple[TraceRequest, ...]
    stop_at: int | None
    stop_step: int
    sampled_at: int | None
    sampling: int
    abort: TraceRequest | None
    abort_before: int
    abort_after: int


def draw_timed(spec: TraceSpec, rng: np.random.Generator) -> TimedShape:
    """A fresh shape of the run's trace `spec` and of its contract cases."""
    trace = draw(spec, rng)
    places = [int(i) for i in rng.permutation(len(trace))]
    stop_at = places[0]
    stop_step = int(rng.integers(1, min(STOP_STEPS, trace[stop_at].max_tokens) + 1))
    sampled_at = places[1] if len(places) > 1 else None
    abort, before, k = None, 0, 0
    low, high = max(2, spec.output_len[0]), spec.output_len[1]
    if high >= 2:
        before = int(rng.integers(0, len(trace) + 1))
        like = trace[min(before, len(trace) - 1)]
        max_tokens = int(rng.integers(low, high + 1))
        k = int(rng.integers(1, min(MAX_ABORT_AFTER, max_tokens - 1) + 1))
        abort = TraceRequest(-1, like.arrival_s, int(rng.integers(spec.prompt_len[0], spec.prompt_len[1] + 1)),
                             max_tokens)
    return TimedShape(trace, stop_at, stop_step, sampled_at, int(rng.integers(len(SAMPLING))), abort, before, k)


def stop_case(shape: TimedShape, rng: np.random.Generator, vocab: int, prefix: Prefix) -> GenerationRequest | None:
    """The request of `shape` whose stop id the reference hits, on a fresh prompt (None: the shape has none).
    Drawn apart from `timed_sends`, before the replays it is used in: on the CPU the reference must not run
    between timed replays (it would evict the engine's caches)."""
    if shape.stop_at is None:
        return None
    item, make = shape.trace[shape.stop_at], _Requests(rng, vocab, False)
    return make.hitting_stop(make.prompt(item.prompt_len), item.max_tokens, 0.0, 1.0, prefix, shape.stop_step)


def timed_sends(shape: TimedShape, rng: np.random.Generator, vocab: int, stop: GenerationRequest | None,
                greedy_only: bool = False) -> list[Send]:
    """One timed replay of `shape`: fresh prompts and seeds from `rng`, and `stop` (`stop_case`) in its place."""
    make = _Requests(rng, vocab, greedy_only)
    sends = []
    for i, item in enumerate(shape.trace):
        if i == shape.abort_before and shape.abort is not None:
            sends.append(_aborted(make, shape))
        if i == shape.stop_at and stop is not None:
            request = replace(stop, id=make.number())
        elif i == shape.sampled_at:
            request = make.make(make.prompt(item.prompt_len), item.max_tokens, (), *SAMPLING[shape.sampling])
        else:
            request = make.make(make.prompt(item.prompt_len), item.max_tokens)
        sends.append(Send(request, item.arrival_s))
    if shape.abort is not None and shape.abort_before >= len(shape.trace):
        sends.append(_aborted(make, shape))
    return sends


def _aborted(make: _Requests, shape: TimedShape) -> Send:
    item = shape.abort
    return Send(make.make(make.prompt(item.prompt_len), item.max_tokens), item.arrival_s, abort_after=shape.abort_after)
