"""The plainest generation engine for a Llama model (the generation contract, `evo.workloads.generation`):
each step, one new token for every running request, each request with a KV cache of its own; a request's
first step is its whole prefill, the others decode the token it produced last, eagerly. Greedy.

It is the floor the searched generation engines (batched decode, a pooled paged cache, chunked prefill,
one compiled step) are to beat, and the "one request at a time" baseline of issue 30. It reuses the call
engine's layers (`LlamaEngine`), so its fusion, layout, kernel, KV-layout and thread genes apply; the call
engine's prefill and decode-step genes do not (yet): this engine always prefills whole and steps eagerly.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from evo.workloads import sampling
from evo.workloads.generation import GenerationRequest, TokenEvent, check_fits
from evo.workloads.llama.engine import KVCache, LlamaEngine


@dataclass
class _Running:
    request: GenerationRequest
    cache: KVCache
    made: list[int]


class LlamaGenerator:
    """`add` and `step` over `engine`'s layers (see the module)."""

    def __init__(self, engine: LlamaEngine, max_positions: int) -> None:
        self.engine, self.max_positions = engine, max_positions
        self.num_threads = engine.num_threads  # its threads gene, as the engine's process reads it
        self.waiting: deque[GenerationRequest] = deque()
        self.running: dict[int, _Running] = {}

    def add(self, request: GenerationRequest) -> None:
        check_fits(request, self.max_positions)
        self.waiting.append(request)

    def step(self) -> list[TokenEvent]:
        while self.waiting:
            request = self.waiting.popleft()
            self.running[request.id] = _Running(request, self._cache(len(request.prompt) + request.max_tokens), [])
        events = []
        with torch.inference_mode(), self.engine._sdpa_backend():
            for rid, run in list(self.running.items()):
                token = self._next(run)
                run.made.append(token)
                done = len(run.made) >= run.request.max_tokens or token in run.request.stop_ids
                events.append(TokenEvent(rid, token, done))
                if done:
                    del self.running[rid]
        return events

    def abort(self, request_id: int) -> None:
        self.waiting = deque(r for r in self.waiting if r.id != request_id)
        self.running.pop(request_id, None)  # its cache goes with it

    def _cache(self, positions: int) -> KVCache:
        """A cache of the request's own (never the call engine's kept one: requests must not share one)."""
        s, engine = self.engine.spec, self.engine
        return KVCache(engine.plan, s.layers, 1, positions, s.kv_heads, s.head_dim, engine.device, engine.kv_dtype)

    def _next(self, run: _Running) -> int:
        """The request's next greedy token: its prefill the first time, then one decode step."""
        device = self.engine.device
        if not run.made:
            tokens, pos = torch.tensor([run.request.prompt], device=device), 0
        else:
            tokens, pos = torch.tensor([[run.made[-1]]], device=device), len(run.request.prompt) + len(run.made) - 1
        logits = self.engine._forward(tokens, pos, run.cache)  # [1, V] of the last position
        if run.request.greedy:
            return int(logits[0].argmax())
        request = run.request
        return sampling.choose(logits[0].float().cpu().numpy(), request.temperature, request.top_p, request.seed,
                               len(run.made))
