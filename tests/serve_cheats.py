"""The llama_serve workload with a `cheat` gene: generation engines that read ahead, answer from a one-shot
forward, depend on their batch mates, stop early, run past max_tokens or sleep and burst, each wrapping the
honest engine. For the judge's full path: `Evaluator("tests.serve_cheats", "cpu_small", ...)`."""
from __future__ import annotations

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

    WRONG_AFTER = 16

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


CHEATS = ("one_shot", "precog", "batch_mate", "early_stop", "past_max", "sleep_burst", "wrong_after")


class ServeCheats(LlamaServeWorkload):
    name = "serve_cheats"

    def gene_space(self, preset: Preset, device: DeviceInfo) -> GeneSpace:
        honest = super().gene_space(preset, device)
        cheat = Gene("cheat", "fusion", (HONEST, *CHEATS), HONEST, "which cheat wraps the honest engine")
        return GeneSpace(self.name, (*honest.genes, cheat), honest.constraints, honest.code_genes, honest.ignored)

    def build_generator(self, genome: Genome, preset: Preset, device: DeviceInfo,
                        sources: Mapping[str, str] = NO_SOURCES):
        values = genome.values()
        cheat = values.pop("cheat")
        honest = super().build_generator(super().gene_space(preset, device).make(values), preset, device, sources)
        if cheat == HONEST:
            return honest
        if cheat == "one_shot":
            from evo.workloads import get_workload

            llama = get_workload("llama")
            from evo.workloads.llama.engine import build

            engine = build(llama.gene_space(preset, device).default(), preset, device, preset.max_positions)
            return _OneShot(honest, engine)
        engine = {"precog": _Precog, "batch_mate": _BatchMate, "early_stop": _EarlyStop, "past_max": _PastMax,
                  "sleep_burst": _SleepBurst, "wrong_after": _WrongAfter}[cheat](honest)
        engine.vocab = preset.shape["V"]
        return engine


WORKLOAD = ServeCheats()
