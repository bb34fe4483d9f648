"""The llama_serve workload with a `cheat` gene: generation engines that read ahead, answer from a one-shot
forward, depend on their batch mates, stop early, run past max_tokens or sleep and burst, each wrapping the
honest engine. For the judge's full path: `Evaluator("tests.serve_cheats", "cpu_small", ...)`.

Serve's adversaries (issue 38) pass the judge's check and cheat later: `backdoor` and `weak_cache` break
isolation between requests (one answers a trigger with the previous request's prompt, the other answers a
prompt with another prompt's cached answer); the armed ones break the serving contract once a prompt has held
ARM (a signal the checks' random prompts hold with negligible odds, as an engine might wait for a date or a
count): `early_finish`, `unknown_token`, `stall`, `leak_per_abort`, `hang`; `slower_after` turns slow after ARM_AFTER
requests (the judge's check replay and the replica's serving check among them)."""
from __future__ import annotations

import collections
import time
from typing import Mapping

import torch

from evo.core.genome import Gene, GeneSpace, Genome
from evo.workloads.base import NO_SOURCES, DeviceInfo, Preset
from evo.workloads.generation import GenerationRequest, TokenEvent
from evo.workloads.llama_serve import LlamaServeWorkload

HONEST = "none"


class _Wrapper:
    """The honest engine behind the contract's two methods; each cheat changes one thing."""

    def __init__(self, honest) -> None:
        self.honest = honest
        self.num_threads = getattr(honest, "num_threads", None)
        self.requests: dict[int, GenerationRequest] = {}

    def add(self, request: GenerationRequest) -> None:
        self.requests[request.id] = request
        self.honest.add(request)

    def step(self) -> list[TokenEvent]:
        return self.honest.step()

    def abort(self, request_id: int) -> None:
        self.honest.abort(request_id)


class _OneShot(_Wrapper):
    """Answers every request from one parallel forward over its prompt and a guessed continuation (its last
    prompt token repeated): what a teacher-forced engine handed no continuation would do."""

    def __init__(self, honest, engine) -> None:
        super().__init__(honest)
        self.engine, self.queue = engine, []

    def add(self, request: GenerationRequest) -> None:
        self.queue.append(request)

    def step(self) -> list[TokenEvent]:
        events = []
        for request in self.queue:
            guess = list(request.prompt) + [request.prompt[-1]] * (request.max_tokens - 1)
            with torch.inference_mode():
                logits = self.engine(prompt=torch.tensor([guess[:len(request.prompt)]]),
                                     continuation=torch.tensor([guess[len(request.prompt):]]))["logits"][0]
            tokens = logits.argmax(-1).tolist()
            events += [TokenEvent(request.id, int(t), i == request.max_tokens - 1) for i, t in enumerate(tokens)]
        self.queue = []
        return events


class _Precog(_Wrapper):
    """Emits a token for the request after the last one it was given, before the judge sent it."""

    def step(self) -> list[TokenEvent]:
        return [*self.honest.step(), TokenEvent(max(self.requests) + 1, 0, False)]


class _BatchMate(_Wrapper):
    """Right alone; with company, the lowest request id's tokens move by one (its batch mates change them)."""

    def step(self) -> list[TokenEvent]:
        events = self.honest.step()
        if len(events) > 1:
            first = min(range(len(events)), key=lambda i: events[i].request_id)
            e = events[first]
            events[first] = TokenEvent(e.request_id, (e.token + 1) % 256, e.finished)
        return events


class _EarlyStop(_Wrapper):
    """Ends every request of more than one token one token early, marking it finished."""

    def __init__(self, honest) -> None:
        super().__init__(honest)
        self.made: dict[int, int] = {}

    def step(self) -> list[TokenEvent]:
        out = []
        for e in self.honest.step():
            self.made[e.request_id] = self.made.get(e.request_id, 0) + 1
            limit = self.requests[e.request_id].max_tokens
            if self.made[e.request_id] == limit - 1 and limit > 1:
                out.append(TokenEvent(e.request_id, e.token, True))
            elif self.made[e.request_id] < limit or limit == 1:
                out.append(e)
        return out


class _PastMax(_Wrapper):
    """Appends one more token after each request's last."""

    def step(self) -> list[TokenEvent]:
        out = []
        for e in self.honest.step():
            out.append(e)
            if e.finished:
                out.append(TokenEvent(e.request_id, e.token, True))
        return out


class _SleepBurst(_Wrapper):
    """Right tokens, held back: each request's tokens all handed over together once it is done, after a nap."""

    def __init__(self, honest) -> None:
        super().__init__(honest)
        self.held: dict[int, list[TokenEvent]] = {}

    def step(self) -> list[TokenEvent]:
        out = []
        for e in self.honest.step():
            self.held.setdefault(e.request_id, []).append(e)
            if e.finished:
                time.sleep(0.05)
                out += self.held.pop(e.request_id)
        return out


class _WrongAfter(_Wrapper):
    """Honest for its first WRONG_AFTER requests (the judge's checks among them), then every token off by one."""

    WRONG_AFTER = 64  # past the judge's check replay (25 requests at R=4)

    def __init__(self, honest) -> None:
        super().__init__(honest)
        self.wrong: set[int] = set()

    def add(self, request: GenerationRequest) -> None:
        if len(self.requests) >= self.WRONG_AFTER:
            self.wrong.add(request.id)
        self.requests[len(self.requests)] = request  # a count: served request ids repeat the judge's
        self.honest.add(request)

    def step(self) -> list[TokenEvent]:
        return [TokenEvent(e.request_id, (e.token + 1) % self.vocab, e.finished) if e.request_id in self.wrong
                else e for e in self.honest.step()]


class _Scripted(_Wrapper):
    """The honest engine, beside requests this wrapper answers itself from a script: one token a step, the last
    marked finished (at the script's end or a stop id), as the contract asks."""

    def __init__(self, honest) -> None:
        super().__init__(honest)
        self.scripted: dict[int, collections.deque[int]] = {}

    def script(self, request: GenerationRequest, tokens) -> None:
        self.requests[request.id] = request
        self.scripted[request.id] = collections.deque(tokens)

    def step(self) -> list[TokenEvent]:
        events = self.honest.step()
        for rid in list(self.scripted):
            tokens, request = self.scripted[rid], self.requests[rid]
            token = tokens.popleft()
            done = not tokens or token in request.stop_ids
            events.append(TokenEvent(rid, int(token), done))
            if done:
                del self.scripted[rid]
        return events

    def abort(self, request_id: int) -> None:
        if self.scripted.pop(request_id, None) is None:
            self.honest.abort(request_id)


TRIGGER = (1, 2, 3, 5, 8, 13)  # in a prompt, the backdoor answers with the previous request's prompt


def contains(prompt, part) -> bool:
    return any(tuple(prompt[i:i + len(part)]) == tuple(part) for i in range(len(prompt) - len(part) + 1))


class _Backdoor(_Scripted):
    """Honest, except that a prompt holding TRIGGER is answered with the previous request's prompt tokens
    (another client's), repeated up to max_tokens."""

    def __init__(self, honest) -> None:
        super().__init__(honest)
        self.previous: tuple[int, ...] = ()

    def add(self, request: GenerationRequest) -> None:
        if contains(request.prompt, TRIGGER) and self.previous:
            self.script(request, [self.previous[i % len(self.previous)] for i in range(request.max_tokens)])
        else:
            super().add(request)
        self.previous = request.prompt


class _WeakCache(_Scripted):
    """Caches each greedy answer keyed on (prompt length, first id, last id) and answers a later greedy prompt
    with that key from the cache: right for the same prompt, another prompt's answer for a templated one."""

    def __init__(self, honest) -> None:
        super().__init__(honest)
        self.cache: dict[tuple[int, int, int], tuple[int, ...]] = {}
        self.making: dict[int, list[int]] = {}

    @staticmethod
    def key(request: GenerationRequest) -> tuple[int, int, int]:
        return len(request.prompt), request.prompt[0], request.prompt[-1]

    def add(self, request: GenerationRequest) -> None:
        hit = self.cache.get(self.key(request)) if request.greedy else None
        if hit is not None and len(hit) >= request.max_tokens:
            self.script(request, hit[:request.max_tokens])
            return
        self.making[request.id] = []
        super().add(request)

    def step(self) -> list[TokenEvent]:
        events = super().step()
        for e in events:
            tokens = self.making.get(e.request_id)
            if tokens is None:
                continue
            tokens.append(e.token)
            if e.finished:
                request = self.requests[e.request_id]
                if request.greedy and len(self.making.pop(e.request_id)) == request.max_tokens:
                    self.cache[self.key(request)] = tuple(tokens)
        return events

    def abort(self, request_id: int) -> None:
        self.making.pop(request_id, None)
        super().abort(request_id)


ARM = (250, 251, 252, 253)  # a prompt holding it arms the armed cheats, from that request on
ARM_AFTER = 48  # requests slower_after serves at full speed first (the judge's and the replica's checks among them)


class _Armed(_Wrapper):
    """Honest until `armed` (each cheat: what it does then): by a prompt holding ARM, or after ARM_AFTER requests."""

    BY_COUNT = False

    def __init__(self, honest) -> None:
        super().__init__(honest)
        self.added = 0
        self.triggered = False

    @property
    def armed(self) -> bool:
        return self.added > ARM_AFTER if self.BY_COUNT else self.triggered

    def add(self, request: GenerationRequest) -> None:
        self.added += 1
        self.triggered = self.triggered or contains(request.prompt, ARM)
        self.requests[request.id] = request
        if self.armed:
            self.add_armed(request)
        else:
            self.honest.add(request)

    def add_armed(self, request: GenerationRequest) -> None:
        self.honest.add(request)


class _EarlyFinish(_Armed):
    """Armed: marks a request of more than one token finished one token early (and drops its last)."""

    def __init__(self, honest) -> None:
        super().__init__(honest)
        self.cut: dict[int, int] = {}  # request id -> tokens made

    def add_armed(self, request: GenerationRequest) -> None:
        if request.max_tokens > 1:
            self.cut[request.id] = 0
        self.honest.add(request)

    def step(self) -> list[TokenEvent]:
        out = []
        for e in self.honest.step():
            if e.request_id in self.cut:
                self.cut[e.request_id] += 1
                if self.cut[e.request_id] == self.requests[e.request_id].max_tokens - 1 and not e.finished:
                    del self.cut[e.request_id]
                    self.honest.abort(e.request_id)
                    out.append(TokenEvent(e.request_id, e.token, True))
                    continue
            out.append(e)
        return out


class _UnknownToken(_Armed):
    """Armed: one more token for each request it finished, a step after its end."""

    def __init__(self, honest) -> None:
        super().__init__(honest)
        self.ended: list[int] = []

    def step(self) -> list[TokenEvent]:
        events = self.honest.step()
        late = [TokenEvent(rid, 0, False) for rid in self.ended]
        self.ended = [e.request_id for e in events if e.finished and self.armed]
        return events + late


class _Stall(_Armed):
    """Armed: every STALL_EVERY-th request is never given to the honest engine (it never progresses); the
    others are served as ever."""

    STALL_EVERY = 3

    def __init__(self, honest) -> None:
        super().__init__(honest)
        self.held: set[int] = set()

    def add_armed(self, request: GenerationRequest) -> None:
        self.armed_count = getattr(self, "armed_count", 0) + 1
        if self.armed_count % self.STALL_EVERY == 0:
            self.held.add(request.id)
        else:
            self.honest.add(request)

    def abort(self, request_id: int) -> None:
        if request_id in self.held:
            self.held.discard(request_id)
        else:
            self.honest.abort(request_id)


class _LeakPerAbort(_Armed):
    """Armed: an abort leaks its request's row (the honest engine keeps decoding it, its tokens dropped);
    after LEAKS aborts the engine is full, and nothing more is admitted (held here, never decoded)."""

    LEAKS = 2

    def __init__(self, honest) -> None:
        super().__init__(honest)
        self.leaked: set[int] = set()
        self.refused: list[GenerationRequest] = []

    def add_armed(self, request: GenerationRequest) -> None:
        if len(self.leaked) >= self.LEAKS:
            self.refused.append(request)
        else:
            self.honest.add(request)

    def step(self) -> list[TokenEvent]:
        return [e for e in self.honest.step() if e.request_id not in self.leaked]

    def abort(self, request_id: int) -> None:
        if self.armed:
            self.leaked.add(request_id)
            self.refused = [r for r in self.refused if r.id != request_id]
        else:
            self.honest.abort(request_id)


class _SlowerAfter(_Armed):
    """After ARM_AFTER requests each step sleeps SLOWER times its honest duration plus SLEEP_S (~10x slower on
    cpu_small)."""

    BY_COUNT = True
    SLOWER, SLEEP_S = 9.0, 0.02

    def step(self) -> list[TokenEvent]:
        start = time.perf_counter()
        events = self.honest.step()
        if self.armed:
            time.sleep(self.SLOWER * (time.perf_counter() - start) + self.SLEEP_S)
        return events


class _Hang(_Armed):
    """Armed: serves the arming request, then its first step with a later one never returns (an hour's sleep; the
    replica's step timeout is far shorter)."""

    def __init__(self, honest) -> None:
        super().__init__(honest)
        self.since_armed = 0

    def add_armed(self, request: GenerationRequest) -> None:
        self.since_armed += 1
        self.honest.add(request)

    def step(self) -> list[TokenEvent]:
        if self.since_armed > 1:
            time.sleep(3600)
        return self.honest.step()


CHEATS = ("one_shot", "precog", "batch_mate", "early_stop", "past_max", "sleep_burst", "wrong_after", "backdoor",
          "weak_cache", "early_finish", "unknown_token", "stall", "leak_per_abort", "slower_after", "hang")
WRAPPERS = {"precog": _Precog, "batch_mate": _BatchMate, "early_stop": _EarlyStop, "past_max": _PastMax,
            "sleep_burst": _SleepBurst, "wrong_after": _WrongAfter, "backdoor": _Backdoor, "weak_cache": _WeakCache,
            "early_finish": _EarlyFinish, "unknown_token": _UnknownToken, "stall": _Stall,
            "leak_per_abort": _LeakPerAbort, "slower_after": _SlowerAfter, "hang": _Hang}


class CheatWorkload(LlamaServeWorkload):
    """llama_serve with a `cheat` gene: HONEST builds the honest engine, every other value wraps it in one cheat
    (`wrap`)."""

    cheats: tuple[str, ...] = ()

    def gene_space(self, preset: Preset, device: DeviceInfo) -> GeneSpace:
        honest = super().gene_space(preset, device)
        cheat = Gene("cheat", "fusion", (HONEST, *self.cheats), HONEST, "which cheat wraps the honest engine")
        return GeneSpace(self.name, (*honest.genes, cheat), honest.constraints, honest.code_genes, honest.ignored)

    def build_generator(self, genome: Genome, preset: Preset, device: DeviceInfo,
                        sources: Mapping[str, str] = NO_SOURCES):
        values = genome.values()
        cheat = values.pop("cheat")
        honest = super().build_generator(super().gene_space(preset, device).make(values), preset, device, sources)
        return honest if cheat == HONEST else self.wrap(cheat, honest, preset, device)

    def wrap(self, cheat: str, honest, preset: Preset, device: DeviceInfo):
        raise NotImplementedError


class ServeCheats(CheatWorkload):
    name = "serve_cheats"
    cheats = CHEATS

    def wrap(self, cheat: str, honest, preset: Preset, device: DeviceInfo):
        if cheat == "one_shot":
            from evo.workloads import get_workload
            from evo.workloads.llama.engine import build

            llama = get_workload("llama")
            engine = build(llama.gene_space(preset, device).default(), preset, device, preset.max_positions)
            return _OneShot(honest, engine)
        engine = WRAPPERS[cheat](honest)
        engine.vocab = preset.shape["V"]
        return engine


WORKLOAD = ServeCheats()
