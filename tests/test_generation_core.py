"""The shared scheduler (`evo.workloads.generation_core.Scheduler`) driven over a fake pool and runner, no
model: continuous and static admission, chunked prefill, aborts wherever a request is, stop ids, speculation
(prompt lookup drafts, verified). The fake model's next token depends on every token in its row's memory, so a
request whose memory went to the wrong row, or was cut short, makes other tokens than `_generate` does."""
from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from evo.workloads.generation import GenerationRequest, TokenEvent
from evo.workloads.generation_core import Scheduler, SchedulerPolicy, prompt_lookup

VOCAB = 50


def _next(memory: list[int]) -> int:
    return (7 * sum((i + 1) * t for i, t in enumerate(memory)) + 3) % VOCAB


def _periodic(memory: list[int]) -> int:
    """A model prompt lookup drafts well for: it repeats its memory's last 4 tokens, except at every 7th position,
    where it makes `_next` of the whole memory (a draft through there is rejected)."""
    return _next(memory) if len(memory) % 7 == 0 or len(memory) < 4 else memory[-4]


def _generate(request: GenerationRequest, model=_next) -> list[int]:
    """The request's tokens, one at a time, as the fake model makes them."""
    memory, made = list(request.prompt), []
    while True:
        made.append(model(memory))
        if len(made) == request.max_tokens or made[-1] in request.stop_ids:
            return made
        memory.append(made[-1])


class FakePool:
    """Rows of token memory (None: free); reserve, release, move and swap recorded."""

    def __init__(self, rows: int) -> None:
        self.memory: list[list[int] | None] = [None] * rows
        self.calls: list[tuple] = []

    def reserve(self, row: int, length: int) -> None:
        self.calls.append(("reserve", row, length))

    def release(self, row: int) -> None:
        self.calls.append(("release", row))
        self.memory[row] = None

    def move(self, src: int, dst: int, length: int) -> None:
        """Only the first `length` positions go (after them: a rejected draft's, never read)."""
        self.calls.append(("move", src, dst))
        assert self.memory[dst] is None and len(self.memory[src]) >= length
        self.memory[dst], self.memory[src] = self.memory[src][:length], None

    def swap(self, a: int, b: int, length: int) -> None:
        self.calls.append(("swap", a, b))
        self.memory[a], self.memory[b] = self.memory[b], self.memory[a]


class FakeRunner:
    """Writes fed tokens into the pool's rows and picks `model` of a row's memory; checks every position. A row's
    memory past the position fed is a rejected draft's: dropped when the row is fed there again."""

    def __init__(self, pool: FakePool, model=_next, max_positions: int = 64) -> None:
        self.pool, self.model, self.max_positions = pool, model, max_positions
        self.prefills: list[tuple[int, int, int]] = []  # (request id, pos, T)
        self.batched_prefills: list[list[int]] = []  # the rows of each prefill_rows call
        self.decodes: list[int] = []  # rows per decode step
        self.verifies: list[list[tuple[list[int], list[int]]]] = []  # per verify step, each row's (fed, picked)
        self.mixes: list[tuple[int, int]] = []  # per mixed forward: (decode rows, prompt chunks)

    def prefill(self, row, tokens, pos, pick):
        if pos == 0:
            self.pool.memory[row] = []
        memory = self.pool.memory[row]
        assert len(memory) == pos, (row, len(memory), pos)
        memory += tokens
        self.prefills.append((pick[0].id if pick else None, pos, len(tokens)))  # id: the prompt's last chunk
        return self.model(memory) if pick else None

    def prefill_rows(self, rows, chunks, positions, picks):
        self.batched_prefills.append(list(rows))
        return [self.prefill(*args) for args in zip(rows, chunks, positions, picks)]

    def decode(self, tokens, positions, picks):
        self.decodes.append(len(tokens))
        return [row[0] for row in self._feed([[t] for t in tokens], positions, [[p] for p in picks])]

    def mixed(self, tokens, positions, picks, rows, chunks, starts, prefill_picks):
        self.mixes.append((len(tokens), len(rows)))
        decoded = [row[0] for row in self._feed([[t] for t in tokens], positions, [[p] for p in picks])]
        return decoded, [self.prefill(*args) for args in zip(rows, chunks, starts, prefill_picks)]

    def verify(self, fed, positions, picks):
        picked = self._feed(fed, positions, picks)
        self.verifies.append(list(zip(fed, picked)))
        return picked

    def _feed(self, fed, positions, picks):
        """Each row's tokens fed at its positions: never past max_tokens' last index nor the last position."""
        made = []
        for r, (tokens, pos, row_picks) in enumerate(zip(fed, positions, picks)):
            memory = self.pool.memory[r]
            assert len(memory) >= pos and pos + len(tokens) <= self.max_positions, (r, len(memory), pos)
            del memory[pos:]
            made.append([])
            for j, (token, (request, index)) in enumerate(zip(tokens, row_picks)):
                assert index == pos + j - len(request.prompt) + 1 and index < request.max_tokens, (r, pos, j, index)
                memory.append(token)
                made[-1].append(self.model(memory))
        return made


def _scheduler(max_running: int, batching="continuous", prefill="whole", chunk=0, prefills=None, context=None,
               spec=0, model=_next, max_positions=64, together=False, with_decode=False):
    pool = FakePool(max_running)
    policy = SchedulerPolicy(batching, max_running, prefill, chunk, prefills or max_running, spec,
                             prefill_together=together, prefill_with_decode=with_decode)
    kwargs = {"context": context} if context else {}
    return Scheduler(FakeRunner(pool, model, max_positions), pool, policy, max_positions, num_threads=1, **kwargs)


def _step(scheduler: Scheduler) -> list[TokenEvent]:
    """One step, then the rows invariant: decoding requests at rows [0, n), every taken row distinct."""
    events = scheduler.step()
    assert [run.row for run in scheduler.decoding] == list(range(len(scheduler.decoding)))
    taken = [run.row for run in scheduler.running]
    assert len(set(taken)) == len(taken) and not set(taken) & scheduler.free_rows
    return events


def _drive(scheduler: Scheduler, requests, aborts=None) -> tuple[dict[int, list[int]], list[list[TokenEvent]]]:
    """Add `requests`, step until nothing is held (aborting {step: [ids]} before that step); tokens by id and
    the events of every step. Each token is `finished` exactly when it is its request's last."""
    for request in requests:
        scheduler.add(request)
    made, steps = {r.id: [] for r in requests}, []
    expected = {r.id: _generate(r, scheduler.runner.model) for r in requests}
    while scheduler.held:
        for request_id in (aborts or {}).get(len(steps), []):
            scheduler.abort(request_id)
        steps.append(_step(scheduler))
        for event in steps[-1]:
            made[event.request_id].append(event.token)
            assert event.finished == (len(made[event.request_id]) == len(expected[event.request_id]))
    assert scheduler.free_rows == set(range(scheduler.policy.max_running))
    return made, steps


def _first_step(steps, request_id: int) -> int:
    return next(i for i, events in enumerate(steps) if any(e.request_id == request_id for e in events))


def test_continuous_batching_admits_into_a_freed_row_and_static_waits_for_the_whole_batch():
    requests = [GenerationRequest(0, (1, 2, 3), 2), GenerationRequest(1, (4, 5), 5), GenerationRequest(2, (6,), 2)]
    entered = []

    @contextmanager
    def context():
        entered.append(True)
        yield

    continuous = _scheduler(2, context=context)
    made, steps = _drive(continuous, requests)
    assert made == {r.id: _generate(r) for r in requests}
    assert _first_step(steps, 2) == 1  # request 0 ends at step 1's decode; request 2 takes its row there
    assert [e.request_id for e in steps[1]] == [0, 1, 2]  # decode events first, then the prefill's
    assert len(entered) == len(steps)
    static = _scheduler(2, batching="static")
    made, steps = _drive(static, requests)
    assert made == {r.id: _generate(r) for r in requests}
    assert _first_step(steps, 2) == 4  # only once request 1 ended (step 4's decode): the batch is empty


def test_chunked_prefill_makes_the_first_token_after_the_last_chunk_while_others_decode():
    long, short = GenerationRequest(0, tuple(range(1, 11)), 3), GenerationRequest(1, (9, 8), 6)
    scheduler = _scheduler(2, prefill="chunked", chunk=4)
    made, steps = _drive(scheduler, [long, short])
    assert made == {0: _generate(long), 1: _generate(short)}
    assert scheduler.runner.prefills[:4] == [(None, 0, 4), (1, 0, 2), (None, 4, 4), (0, 8, 2)]
    assert [[e.request_id for e in events] for events in steps[:3]] == [[1], [1], [1, 0]]
    # the short request finished its prefill first: it swapped rows with the long one, still prefilling
    assert ("swap", 1, 0) in scheduler.pool.calls


def test_prefills_together_go_through_one_call_per_step_and_make_the_same_tokens():
    """Chunked prompts of three requests, two prefilling at a time: each step's chunks in one prefill_rows call
    (rows behind a decoding one among them), the tokens those of one request at a time; a runner without
    prefill_rows is refused."""
    requests = [GenerationRequest(i, tuple(range(i + 1, i + 2 + 5 * i)), 4) for i in range(4)]
    scheduler = _scheduler(3, prefill="chunked", chunk=4, prefills=2, together=True)
    made, _ = _drive(scheduler, requests)
    assert made == {r.id: _generate(r) for r in requests}
    batches = scheduler.runner.batched_prefills
    assert batches and all(len(rows) == 2 for rows in batches), batches
    assert any(0 not in rows for rows in batches), batches  # row 0 decoding while others prefill together
    pool, one_at_a_time = FakePool(2), SimpleNamespace(prefill=None, decode=None)  # Kimi Linear's runner's shape
    with pytest.raises(ValueError, match="prefill_rows"):
        Scheduler(one_at_a_time, pool, SchedulerPolicy("continuous", 2, "whole", 0, 2, prefill_together=True), 64, 1)


def test_a_steps_decode_rows_join_its_prefills_forward_and_make_the_same_tokens():
    """prefill_with_decode: a step with prompt chunks runs its decode rows in the same forward (`mixed`), a step
    without them a decode forward; the tokens those of one request at a time, each step's decode events before its
    prefills', fewer decode forwards of their own; a runner without `mixed` is refused."""
    requests = [GenerationRequest(i, tuple(range(i + 1, i + 2 + 5 * i)), 3 + i) for i in range(5)]
    apart, mixed = (_scheduler(3, prefill="chunked", chunk=4, prefills=2, with_decode=w) for w in (False, True))
    made, _ = _drive(apart, requests)
    made_mixed, steps = _drive(mixed, requests)
    assert made_mixed == made == {r.id: _generate(r) for r in requests}
    runner = mixed.runner
    assert runner.mixes and all(rows >= 1 and chunks >= 1 for rows, chunks in runner.mixes), runner.mixes
    assert len(runner.decodes) < len(apart.runner.decodes)  # decode forwards of their own: fewer
    seen: set[int] = set()
    for events in steps:  # a request's first token (a prefill's) never precedes a decode event of its step
        first = [e.request_id not in seen for e in events]
        assert first == sorted(first), events
        seen |= {e.request_id for e in events}
    with pytest.raises(ValueError, match="prefill_with_decode needs a model runner with mixed"):
        Scheduler(SimpleNamespace(prefill=None, decode=None), FakePool(2),
                  SchedulerPolicy("continuous", 2, "whole", 0, 2, prefill_with_decode=True), 64, 1)


def test_one_prefill_a_step_takes_the_oldest_admitted_request():
    requests = [GenerationRequest(i, (i + 1, 2), 2) for i in range(3)]
    scheduler = _scheduler(3, prefills=1)
    made, steps = _drive(scheduler, requests)
    assert made == {r.id: _generate(r) for r in requests}
    assert [_first_step(steps, i) for i in range(3)] == [0, 1, 2]


def test_aborts_of_a_waiting_a_prefilling_and_a_decoding_request_free_their_rows_and_keep_rows_compact():
    decoding = [GenerationRequest(i, (i + 3, 1, 4), 8) for i in range(3)]
    prefilling = GenerationRequest(3, tuple(range(20)), 4)  # a chunk a step: still prefilling at the aborts
    waiting = GenerationRequest(4, (2, 7), 4)
    scheduler = _scheduler(4, prefill="chunked", chunk=4)
    made, steps = _drive(scheduler, [*decoding, prefilling, waiting], aborts={2: [4, 3, 0]})
    assert made[4] == [] and made[3] == [] and made[0] == _generate(decoding[0])[:2]
    assert made[1] == _generate(decoding[1]) and made[2] == _generate(decoding[2])
    pool = scheduler.pool
    assert ("release", 3) in pool.calls and ("release", 0) in pool.calls
    assert ("move", 2, 0) in pool.calls  # the last decoding request into the aborted one's row
    assert scheduler.held == 0 and not scheduler.running


def test_a_stop_id_ends_its_request_at_the_prefill_or_a_decode_step():
    plain = GenerationRequest(0, (5, 6, 7), 6)
    tokens = _generate(plain)
    later = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    at_decode = GenerationRequest(0, plain.prompt, 6, stop_ids=(tokens[later],))
    at_prefill = GenerationRequest(1, (3, 1), 6, stop_ids=(_next([3, 1]),))
    scheduler = _scheduler(2)
    made, steps = _drive(scheduler, [at_decode, at_prefill])
    assert made == {0: tokens[:later + 1], 1: [_next([3, 1])]}
    assert steps[0][1] == TokenEvent(1, made[1][0], True) and steps[later][0].finished
    assert ("release", 1) in scheduler.pool.calls and len(steps) == later + 1


# ---------------------------------------------------------------------------------------------- speculation
def _lookup_by_definition(context, k: int, max_ngram: int = 3, min_ngram: int = 1) -> tuple[int, ...]:
    for n in range(max_ngram, min_ngram - 1, -1):
        tail = list(context[len(context) - n:])
        for start in range(len(context) - n - 1, -1, -1):
            if n < len(context) and list(context[start:start + n]) == tail:
                return tuple(context[start + n:start + n + k])
    return ()


def test_prompt_lookup_drafts_what_followed_the_latest_earlier_occurrence_of_the_longest_ngram():
    assert prompt_lookup((1, 2, 3, 4, 1, 2, 3), 3) == (4, 1, 2)
    assert prompt_lookup((5, 2, 3, 8, 9, 3, 6, 2, 3), 2) == (8, 9)  # the 2-gram's match, not the later 3's
    assert prompt_lookup((5, 5, 5, 5), 4) == (5,)  # the latest match: one token follows it
    assert prompt_lookup((1, 2, 3), 4) == () and prompt_lookup((1, 2, 1), 0) == ()
    assert prompt_lookup((1, 2, 9, 2), 2, min_ngram=2) == () and prompt_lookup((1, 2, 9, 2), 2) == (9, 2)
    rng = np.random.default_rng(3)
    for _ in range(300):
        context = tuple(rng.integers(0, 4, rng.integers(1, 30)).tolist())
        k, top = int(rng.integers(1, 6)), int(rng.integers(1, 5))
        low = int(rng.integers(1, top + 1))
        assert prompt_lookup(context, k, top, low) == _lookup_by_definition(context, k, top, low), (context, k)


def _requests_a_draft_suits(stop_ids=()) -> list[GenerationRequest]:
    """Prompts that repeat (drafts accepted, then rejected at `_periodic`'s 7th positions) and prompts that do not,
    max_tokens from 1 (no room for a draft) up; the fourth uses every one of the 64 positions."""
    cycle = (1, 2, 3, 4, 1, 2, 3, 4)
    shapes = [(cycle, 20), (cycle[:5], 3), ((9, 8, 7), 12), (cycle, 56), (cycle[1:], 1), ((6, 6), 2), (cycle, 9)]
    return [GenerationRequest(i, prompt, n, stop_ids) for i, (prompt, n) in enumerate(shapes)]


@pytest.mark.parametrize("spec", [1, 2, 4, 8])
@pytest.mark.parametrize("model", [_periodic, _next], ids=["periodic", "hashed"])
def test_speculation_makes_the_tokens_of_plain_decoding(spec, model):
    """The same requests, their rows moved and swapped (chunked prompts, a queue) and one aborted: each request's
    tokens are what one-at-a-time decoding makes; the fake runner checks no draft passes max_tokens or the pool."""
    requests = _requests_a_draft_suits()
    plain, _ = _drive(_scheduler(3, prefill="chunked", chunk=4, model=model), requests)
    scheduler = _scheduler(3, prefill="chunked", chunk=4, model=model, spec=spec)
    made, steps = _drive(scheduler, requests)
    assert made == plain == {r.id: _generate(r, model) for r in requests}
    emitted = [e.request_id for events in steps for e in events]
    if model is _periodic:  # drafts accepted: one request has several tokens in a step, in order
        assert len(steps) < sum(1 for events in steps for _ in events) and scheduler.runner.verifies
        assert any(len([e for e in events if e.request_id == i]) > 1 for events in steps for i in made)
    assert len(emitted) == sum(len(t) for t in made.values())
    aborted, _ = _drive(_scheduler(3, model=model, spec=spec), requests, aborts={2: [0, 3]})
    assert all(aborted[i] == made[i][:len(aborted[i])] for i in made) and len(aborted[3]) < len(made[3])


def test_a_stop_id_inside_an_accepted_run_ends_the_request_there():
    """The first decode step's draft is accepted whole, but the request's stop id is its second token: the step
    emits the tokens up to the stop id and nothing after; a request of 4 tokens drafts 2, not 4."""
    cycle = (1, 2, 3, 4, 1, 2, 3, 4)
    tokens = _generate(GenerationRequest(0, cycle, 10), _periodic)
    assert tokens[:6] == [1, 2, 3, 4, 1, 2]
    stopped, short = GenerationRequest(0, cycle, 10, stop_ids=(3,)), GenerationRequest(1, cycle, 4)
    scheduler = _scheduler(2, model=_periodic, spec=4)
    made, steps = _drive(scheduler, [stopped, short])
    assert made == {0: [1, 2, 3], 1: [1, 2, 3, 4]}
    assert steps[1] == [TokenEvent(0, 2), TokenEvent(0, 3, True), TokenEvent(1, 2), TokenEvent(1, 3),
                        TokenEvent(1, 4, True)]
    (fed0, picked0), (fed1, picked1) = scheduler.runner.verifies[0]
    assert fed0 == [1, 2, 3, 4, 1] and picked0 == [2, 3, 4, 1, 2]  # all agreed: the stop id cut the run
    assert fed1 == [1, 2, 3] and len(steps) == 2


def test_speculation_stops_above_its_row_limit_and_refuses_bad_settings():
    policy = SchedulerPolicy("continuous", 16, "whole", 16, 16, spec_tokens=4, spec_max_rows=4)
    assert [policy.speculates(rows) for rows in (1, 4, 5, 16)] == [True, True, False, False]
    assert SchedulerPolicy("continuous", 16, "whole", 16, 16, spec_tokens=4).speculates(16)  # 0: any rows
    assert not SchedulerPolicy("continuous", 16, "whole", 16, 16).speculates(1)
    with pytest.raises(ValueError, match="spec_min_ngram"):
        SchedulerPolicy("continuous", 16, "whole", 16, 16, spec_tokens=4, spec_min_ngram=0)


def test_ragged_packs_and_pads_prompts_of_different_lengths():
    from evo.workloads.generation_core import Ragged

    batch = Ragged.of([3, 1, 2])
    packed = torch.arange(6.0)[:, None] + 1  # tokens 1..6, prompt by prompt
    padded = batch.padded(packed, pad=-1.0)
    assert padded.shape == (3, 3, 1) and batch.longest == 3
    assert padded[..., 0].tolist() == [[1, 2, 3], [4, -1, -1], [5, 6, -1]]  # each prompt from 0, pad after its end
    assert torch.equal(batch.packed(padded), packed)
    assert batch.owner.tolist() == [0, 0, 0, 1, 2, 2] and batch.position.tolist() == [0, 1, 2, 0, 0, 1]
    assert batch.last.tolist() == [2, 3, 5]
    with pytest.raises(ValueError, match="at least one token"):
        Ragged.of([2, 0])
