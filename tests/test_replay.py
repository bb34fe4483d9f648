"""The judge as a client of a generation engine (evaluators.judge.replay): every token stamped on the judge's
clock, each request scored on its own tokens. A toy model (next token a fixed function of the prefix)
and engines honest or not, in-process: the contract's logic, apart from the sandbox's transport. Clients
that arrive as others decode, that go away mid-decode (aborts), ids from the engine's own sequence, and the
stall rule: an engine that stops admitting is wrong, not slow."""
from __future__ import annotations

import re
import time

import numpy as np
import pytest

from evaluators.judge.replay import Send, prefix_problem, replay, request_problems, score
from evaluators.judge.request_ids import RequestIds
from evo.core.stream_metrics import serving_metrics
from evo.core.trace import TraceSpec, draw
from evo.workloads.generation import GenerationRequest, TokenEvent

V = 32
STOP = 31


def next_token(prefix) -> int:
    return (7 * sum(prefix) + 3 * len(prefix)) % (V - 1)  # never the stop id: requests run to max_tokens


def reference_logits(prompt, tokens) -> np.ndarray:
    """Float64 'logits' [len(tokens), V]: row i predicts tokens[i] from the prompt and tokens[:i]."""
    rows = np.full((len(tokens), V), -5.0)
    for i in range(len(tokens)):
        rows[i, next_token([*prompt, *tokens[:i]])] = 5.0
    return rows


class Honest:
    """Continuous batching in its plainest form: every step, one token for each running request."""

    def __init__(self, batch_bias: bool = False) -> None:
        self.running: dict[int, tuple[GenerationRequest, list[int]]] = {}
        self.batch_bias = batch_bias

    def add(self, request: GenerationRequest) -> None:
        self.running[request.id] = (request, [])

    def token(self, request: GenerationRequest, made: list[int]) -> int:
        bias = (len(self.running) - 1) if self.batch_bias else 0  # a token that depends on its batch mates
        return (next_token([*request.prompt, *made]) + bias) % (V - 1)

    def step(self) -> list[TokenEvent]:
        events = []
        for rid, (request, made) in list(self.running.items()):
            made.append(self.token(request, made))
            done = len(made) >= request.max_tokens or made[-1] in request.stop_ids
            events.append(TokenEvent(rid, made[-1], done))
            if done:
                del self.running[rid]
        return events

    def abort(self, request_id: int) -> None:
        self.running.pop(request_id, None)


class Burst(Honest):
    """Computes every token first, sleeps, then hands them all over in one step."""

    def step(self) -> list[TokenEvent]:
        events = []
        while self.running:
            events += super().step()
        time.sleep(0.5)
        return events


class OneShot(Honest):
    """Answers each request at once from its prompt alone (a one-shot forward: its first token repeated)."""

    def step(self) -> list[TokenEvent]:
        events = []
        for rid, (request, _) in list(self.running.items()):
            first = next_token(request.prompt)
            events += [TokenEvent(rid, first, i == request.max_tokens - 1) for i in range(request.max_tokens)]
            del self.running[rid]
        return events


class StopsEarly(Honest):
    def step(self) -> list[TokenEvent]:
        return [TokenEvent(e.request_id, e.token, e.finished or len(self.running.get(e.request_id, (0, []))[1]) >= 2)
                for e in super().step()]


class RunsPast(Honest):
    def step(self) -> list[TokenEvent]:
        events = super().step()
        return events + [TokenEvent(e.request_id, 0, True) for e in events if e.finished]


class OutOfVocabulary(Honest):
    """Its tokens index past the vocabulary: caught before the reference is handed them."""

    def token(self, request: GenerationRequest, made: list[int]) -> int:
        return V + 5


class Precognitive(Honest):
    """Hands over a token for a request before the judge has sent it."""

    def step(self) -> list[TokenEvent]:
        return super().step() + [TokenEvent(999, 0, True)]


def run(engine, concurrency=4, count=6, seed=0):
    rng = np.random.default_rng(seed)
    trace = draw(TraceSpec(arrival="closed", count=count, concurrency=concurrency, prompt_len=(2, 9),
                           output_len=(3, 7)), rng)
    prompts = [rng.integers(0, V - 1, t.prompt_len).tolist() for t in trace]
    return replay(engine, trace, prompts, concurrency=concurrency, stop_ids=(STOP,), deadline_s=30)


def test_an_honest_engine_is_right_on_its_own_tokens_and_its_metrics_are_the_judges():
    result = run(Honest())
    assert score(result, reference_logits, tolerance=1e-6, vocab=V) == [] and not result.violations
    assert [len(t) for t in result.tokens] == [r.max_tokens for r in result.requests]
    metrics = serving_metrics(result.timelines, result.duration_s)
    assert metrics.completed == 6 and metrics.total_output_tokens == sum(r.max_tokens for r in result.requests)


def test_an_engine_that_bursts_its_tokens_late_gets_the_ttft_a_client_sees():
    honest, burst = run(Honest()), run(Burst())
    assert score(burst, reference_logits, 1e-6, V) == []  # right tokens ...
    late = serving_metrics(burst.timelines, burst.duration_s).ttft_ms["median"]
    assert late >= 500 > serving_metrics(honest.timelines, honest.duration_s).ttft_ms["p99"]  # ... but late


@pytest.mark.parametrize("engine, problem", [
    (OneShot(), "step 1: token"),  # its own tokens diverge from the reference after the first
    (Honest(batch_bias=True), "the reference's is"),  # depends on its batch mates
    (StopsEarly(), "without a stop id"),
    (RunsPast(), "a token after its last"),
    (Precognitive(), "a request the judge never sent"),
    (OutOfVocabulary(), "outside the vocabulary [0, 31]"),
])
def test_engines_that_do_not_decode_their_own_tokens_honestly_are_caught(engine, problem):
    problems = score(run(engine), reference_logits, 1e-6, V)
    assert any(problem in p for p in problems), problems


def test_a_near_tie_is_not_an_error():
    request = GenerationRequest(0, (1, 2), 1)
    tied = lambda prompt, tokens: np.array([[5.0, 5.0 - 1e-9] + [0.0] * (V - 2)])  # noqa: E731
    from evaluators.judge.replay import Replay
    from evo.core.stream_metrics import RequestTimeline
    result = Replay((request,), ((1,),), (RequestTimeline(0.0, (0.1,), 2),), (), 0.2)
    assert score(result, tied, tolerance=1e-6, vocab=V) == [] and score(result, tied, tolerance=1e-12, vocab=V)


class FakeClock:
    """The judge's clock, moved only by the engine's steps (each takes `step_s`)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Slow(Honest):
    """Honest, each step taking `step_s` on the fake clock."""

    def __init__(self, clock: FakeClock, step_s: float) -> None:
        super().__init__()
        self.clock, self.step_s = clock, step_s

    def step(self) -> list[TokenEvent]:
        self.clock.now += self.step_s
        return super().step()


def test_a_request_counts_from_its_arrival_or_the_slot_it_took_not_from_the_judges_next_look():
    """Poisson-like arrivals under a cap of 2: a request arriving while a slot is free counts from its arrival
    (not from when another request later finished); one held back by the cap counts from when its slot freed."""
    from evo.core.trace import TraceRequest

    clock = FakeClock()
    trace = [TraceRequest(0, 0.0, 2, 5), TraceRequest(1, 0.0, 2, 2), TraceRequest(2, 1.5, 2, 3),
             TraceRequest(3, 1.5, 2, 2)]
    result = replay(Slow(clock, 1.0), trace, [[1, 2]] * 4, concurrency=2, deadline_s=100, clock=clock)
    sent = [t.sent_s for t in result.timelines]
    # request 1 ends at 2.0 (its slot frees); request 2 arrives at 1.5, while none is free: sent at 2.0;
    # request 0 ends at 5.0; request 3 arrived at 1.5 and waited for that slot: sent at 5.0
    assert sent == [0.0, 0.0, 2.0, 5.0], sent
    trace = [TraceRequest(0, 0.0, 2, 5), TraceRequest(1, 1.5, 2, 2)]
    clock.now = 0.0
    result = replay(Slow(clock, 1.0), trace, [[1, 2]] * 2, concurrency=2, deadline_s=100, clock=clock)
    assert [t.sent_s for t in result.timelines] == [0.0, 1.5]  # a free slot: its arrival, though the judge was mid-step


def test_running_out_of_time_is_lateness_not_a_breach():
    clock = FakeClock()
    rng = np.random.default_rng(3)
    trace = draw(TraceSpec(arrival="closed", count=4, concurrency=2, prompt_len=(2, 4), output_len=(5, 5)), rng)
    result = replay(Slow(clock, 1.0), trace, [[1, 2]] * 4, concurrency=2, deadline_s=3.5, clock=clock)
    assert not result.violations and result.late
    assert any("not finished within" in line for line in result.late)
    assert any("never sent" in line for line in result.late)


class IgnoresAborts(Honest):
    def abort(self, request_id: int) -> None:
        pass


class Leaky(Honest):
    """Runs at most `rows` requests, queueing the rest; a row is lost for good at every abort."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows, self.queue = rows, []

    def add(self, request: GenerationRequest) -> None:
        self.queue.append(request)

    def step(self) -> list[TokenEvent]:
        while self.queue and len(self.running) < self.rows:
            super().add(self.queue.pop(0))
        return super().step()

    def abort(self, request_id: int) -> None:
        if request_id in self.running:
            self.rows -= 1
        self.queue = [r for r in self.queue if r.id != request_id]
        super().abort(request_id)


def _request(rid: int, max_tokens: int = 6, prompt=(1, 2, 3)) -> GenerationRequest:
    return GenerationRequest(rid, tuple(prompt), max_tokens)


def test_clients_that_arrive_as_others_decode_and_leave_mid_decode_are_scored_on_what_they_got():
    sends = [Send(_request(0, 8), 0.0), Send(_request(1, 8), 0.0, abort_after=2),
             Send(_request(2, 4), 0.0, after=(1, 2)),  # sent when request 1 has its second token: as it is aborted
             Send(_request(3, 3), 0.0, after=(0, 5))]
    result = replay(Honest(), sends, deadline_s=30, stall_steps=20)
    assert not result.violations and result.aborted == (1,)
    made = dict(zip((r.id for r in result.requests), result.tokens))
    assert len(made[1]) == 2 and len(made[0]) == 8
    sent = {r.id: t.sent_s for r, t in zip(result.requests, result.timelines)}
    timeline = dict(zip((r.id for r in result.requests), result.timelines))
    assert sent[2] == timeline[1].token_s[1] and sent[3] == timeline[0].token_s[4]  # at the trigger's token
    assert score(result, reference_logits, 1e-6, V) == []  # the aborted one: its two tokens, no length rule
    assert len(result.served()) == 3  # the replay's figures leave the aborted request out


class Exchanging(Honest):
    """Four engine steps per exchange (the gene steps_per_exchange), all their tokens handed back together."""

    steps_per_exchange = 4

    def step(self) -> list[TokenEvent]:
        events = []
        for _ in range(self.steps_per_exchange):
            events += super().step()
        return events


def test_a_client_gone_at_its_kth_token_gets_none_of_the_rest_of_that_exchange():
    """With several steps an exchange, a request may finish within the exchange that brought its client's last
    wanted token: the client has gone at that token, so the rest are dropped and the request is aborted, never
    counted as served (a timed replay's figures once counted the abort case as a request)."""
    result = replay(Exchanging(), [Send(_request(0, 4), 0.0, abort_after=2), Send(_request(1, 6), 0.0)],
                    deadline_s=30, stall_steps=20)
    assert not result.violations and result.aborted == (0,)
    assert [len(t) for t in result.tokens] == [2, 6] and len(result.served()) == 1
    stamps = result.timelines[1].token_s
    assert stamps[0] == stamps[3] != stamps[4]  # tokens arrive in bursts of four
    assert score(result, reference_logits, 1e-6, V) == []


def test_a_token_after_an_abort_is_a_breach_and_an_aborted_requests_tokens_are_still_scored():
    result = replay(IgnoresAborts(), [Send(_request(0, 6), 0.0, abort_after=1), Send(_request(1, 6), 0.0)],
                    deadline_s=30)
    assert any("request 0: a token after the judge aborted it" in v for v in result.violations)
    wrong = replay(Honest(batch_bias=True), [Send(_request(0, 6), 0.0, abort_after=2), Send(_request(1, 6), 0.0)],
                   deadline_s=30)
    assert any(p.startswith("request 0: step 0: token") for p in score(wrong, reference_logits, 1e-6, V))


def test_an_engine_that_leaks_a_row_per_abort_stalls_and_the_stall_is_a_violation_not_a_timeout():
    sends = [Send(_request(i, 6), 0.0, abort_after=1) for i in range(2)] + [Send(_request(i, 6), 0.0)
                                                                             for i in range(2, 5)]
    result = replay(Leaky(rows=2), sends, deadline_s=30, stall_steps=9)
    assert not result.late
    assert any(re.search(r"request \d: no token in \d+ steps while the engine held it", v) for v in result.violations)
    assert replay(Leaky(rows=3), sends, deadline_s=30, stall_steps=9).violations == ()  # a row left: it finishes


def test_requests_go_out_under_the_engines_own_ids_in_the_order_sent():
    ids = RequestIds()
    sends = [Send(_request(0, 3), 0.0), Send(_request(1, 3), 0.0, abort_after=1), Send(_request(2, 3), 0.0, (1, 1))]
    first = replay(Honest(), sends, deadline_s=30, ids=ids)
    second = replay(Honest(), sends, deadline_s=30, ids=ids)
    seen = [r.id for r in (*first.requests, *second.requests)]
    assert seen == list(range(seen[0], seen[0] + 6)) and seen[0] > 0  # one sequence, continued across replays
    assert first.aborted == (seen[1],) and score(first, reference_logits, 1e-6, V) == []


def test_stop_ids_end_a_request_and_a_prefix_is_judged_without_a_length_rule():
    prompt = (4, 5)
    made = [next_token(prompt)]
    for _ in range(3):
        made.append(next_token([*prompt, *made]))
    request = GenerationRequest(0, prompt, 8, (made[2],))
    result = replay(Honest(), [Send(request, 0.0)], deadline_s=30)
    assert list(result.tokens[0]) == made[:3] and score(result, reference_logits, 1e-6, V) == []
    assert prefix_problem(request, made[:2], reference_logits, 1e-6) == ""
    assert "tokens after the stop id" in prefix_problem(request, made, reference_logits, 1e-6)
    assert "step 1: token" in prefix_problem(request, [made[0], (made[1] + 1) % (V - 1)], reference_logits, 1e-6)
    assert "outside the vocabulary" in prefix_problem(request, [V + 1], reference_logits, 1e-6, vocab=V)
    assert request_problems(request, made[:2], reference_logits, 1e-6, V) == [
        "request 0: stopped after 2 of 8 tokens without a stop id"]
