"""The llama_serve workload with a `cheat` gene: generation engines that are wrong only in a corner of the
contract the judge's old traffic never reached (stop ids, sampling past the eighth token, aborts, a queue, more
than R + 2 requests held), that are honest only on the old judge's traffic, or that hold tokens back to game a
TPOT objective; each wraps the honest engine. For the judge's full path:
`Evaluator("tests.contract_cheats", "cpu_small", ...)` (tests/test_contract_judge.py)."""
from __future__ import annotations

import time
from collections import deque
from typing import Mapping

from evo.workloads.base import DeviceInfo, Preset
from evo.workloads.generation import GenerationRequest, TokenEvent
from tests.serve_cheats import HONEST, CheatWorkload  # noqa: F401 - HONEST: the honest value, for tests


class _Wrapper:
    """The honest engine behind the contract's three methods, keeping what every cheat reads: the requests in
    the order added, those it holds now, and how many tokens each made."""

    def __init__(self, honest, shape: Mapping[str, int]) -> None:
        self.honest, self.R, self.vocab = honest, int(shape["R"]), int(shape["V"])
        self.num_threads = getattr(honest, "num_threads", None)
        self.added: list[GenerationRequest] = []
        self.requests: dict[int, GenerationRequest] = {}
        self.held: set[int] = set()
        self.made: dict[int, int] = {}

    def add(self, request: GenerationRequest) -> None:
        self.added.append(request)
        self.requests[request.id] = request
        self.held.add(request.id)
        self.made[request.id] = 0
        self.honest.add(request)

    def step(self) -> list[TokenEvent]:
        return self._seen(self.honest.step())

    def abort(self, request_id: int) -> None:
        self.held.discard(request_id)
        self.honest.abort(request_id)

    def _seen(self, events: list[TokenEvent]) -> list[TokenEvent]:
        for e in events:
            self.made[e.request_id] = self.made.get(e.request_id, 0) + 1
            if e.finished:
                self.held.discard(e.request_id)
        return events

    def off_by_one(self, event: TokenEvent) -> TokenEvent:
        return TokenEvent(event.request_id, (event.token + 1) % self.vocab, event.finished)


class _WrongWith(_Wrapper):
    """Every token off by one for the requests `wrong` picks (a set of ids, filled as requests come)."""

    def __init__(self, honest, shape) -> None:
        super().__init__(honest, shape)
        self.wrong: set[int] = set()

    def step(self) -> list[TokenEvent]:
        return [self.off_by_one(e) if e.request_id in self.wrong else e for e in super().step()]


class _StopIds(_WrongWith):
    """Wrong only for requests that carry stop ids."""

    def add(self, request: GenerationRequest) -> None:
        if request.stop_ids:
            self.wrong.add(request.id)
        super().add(request)


class _SampledLate(_Wrapper):
    """Wrong only for sampled tokens past the eighth of their request."""

    def step(self) -> list[TokenEvent]:
        before = dict(self.made)
        out, count = [], {}
        for e in super().step():
            index = before.get(e.request_id, 0) + count.get(e.request_id, 0)
            count[e.request_id] = count.get(e.request_id, 0) + 1
            sampled = not self.requests[e.request_id].greedy
            out.append(self.off_by_one(e) if sampled and index >= 8 else e)
        return out


class _AbortHole(_WrongWith):
    """After an abort, the request added right after the aborted one gets wrong tokens (a row moved into the
    hole and read from the wrong place)."""

    def abort(self, request_id: int) -> None:
        ids = [r.id for r in self.added]
        if request_id in self.held and request_id in ids and ids.index(request_id) + 1 < len(ids):
            self.wrong.add(ids[ids.index(request_id) + 1])
        super().abort(request_id)


class _AbortLeak(_Wrapper):
    """Leaks a row per abort of a running request: admits at most max_running - leaked requests into the honest
    engine, so after enough aborts it admits nothing more (its queue waits forever)."""

    def __init__(self, honest, shape) -> None:
        super().__init__(honest, shape)
        self.rows = honest.plan.max_running
        self.queue: deque[GenerationRequest] = deque()
        self.inside: set[int] = set()
        self.leaked = 0

    def add(self, request: GenerationRequest) -> None:
        self.added.append(request)
        self.requests[request.id] = request
        self.held.add(request.id)
        self.queue.append(request)

    def step(self) -> list[TokenEvent]:
        while self.queue and len(self.inside) < self.rows - self.leaked:
            request = self.queue.popleft()
            self.inside.add(request.id)
            self.honest.add(request)
        events = self._seen(self.honest.step()) if self.inside else []
        self.inside -= {e.request_id for e in events if e.finished}
        return events

    def abort(self, request_id: int) -> None:
        self.queue = deque(r for r in self.queue if r.id != request_id)
        if request_id in self.inside:
            self.inside.discard(request_id)
            self.leaked += 1
        super().abort(request_id)


class _Queued(_WrongWith):
    """Wrong for the requests added while it already held R or more (the ones that must queue)."""

    def add(self, request: GenerationRequest) -> None:
        if len(self.held) >= self.R:
            self.wrong.add(request.id)
        super().add(request)


class _Truncates(_Wrapper):
    """While it holds more than R + 2 requests, ends each running request at its next token, marked finished."""

    def step(self) -> list[TokenEvent]:
        crowded = len(self.held) > self.R + 2
        out = []
        for e in super().step():
            if crowded and not e.finished:
                self.honest.abort(e.request_id)
                self.held.discard(e.request_id)
                e = TokenEvent(e.request_id, e.token, True)
            out.append(e)
        return out


class _JudgeShaped(_WrongWith):
    """Honest when it recognises the old judge: request ids below 1_000_000 or negative, or exactly R + 2
    requests added before its first step (the old check replay: then honest for good); wrong otherwise."""

    def __init__(self, honest, shape) -> None:
        super().__init__(honest, shape)
        self.stepped, self.judged = False, False

    def add(self, request: GenerationRequest) -> None:
        if not (request.id < 1_000_000 or self.judged):
            self.wrong.add(request.id)
        super().add(request)

    def step(self) -> list[TokenEvent]:
        if not self.stepped:
            self.stepped, self.judged = True, len(self.added) == self.R + 2
            if self.judged:
                self.wrong.clear()
        return super().step()


class _HeldFirst(_Wrapper):
    """Right tokens, each request's held back from its first until its last is made, then all handed over at once:
    a TPOT of ~0 whatever its speed. On this toy model a whole request takes a few ms, a TTFT that would not stand
    out from a loaded machine's noise: so the first request it releases after being idle (one a replay) comes
    after a nap of NAP_S, a TTFT p99 over any bound below ~0.89 NAP_S (its TPOT stays ~0)."""

    NAP_S = 3.0

    def __init__(self, honest, shape) -> None:
        super().__init__(honest, shape)
        self.holding: dict[int, list[TokenEvent]] = {}
        self.nap = False

    def add(self, request: GenerationRequest) -> None:
        self.nap |= not self.held
        super().add(request)

    def step(self) -> list[TokenEvent]:
        out = []
        for e in super().step():
            self.holding.setdefault(e.request_id, []).append(e)
            if e.finished:
                if self.nap:
                    time.sleep(self.NAP_S)
                    self.nap = False
                out += self.holding.pop(e.request_id)
        return out

    def abort(self, request_id: int) -> None:
        self.holding.pop(request_id, None)
        super().abort(request_id)


CHEATS = {"stop_ids": _StopIds, "sampled_late": _SampledLate, "abort_hole": _AbortHole, "abort_leak": _AbortLeak,
          "queued": _Queued, "truncates": _Truncates, "judge_shaped": _JudgeShaped, "held_first": _HeldFirst}


class ContractCheats(CheatWorkload):
    name = "contract_cheats"
    cheats = tuple(CHEATS)

    def wrap(self, cheat: str, honest, preset: Preset, device: DeviceInfo):
        return CHEATS[cheat](honest, preset.shape)


WORKLOAD = ContractCheats()
