"""The generation contract: a second engine seam beside the call contract (`evo.workloads.base.Engine`).

A call engine is a function: inputs in, outputs out, one batch per call. A generation engine is a
long-lived object that owns its scheduler and its memory, the way a serving engine does (vLLM's
`EngineCore.step`, SGLang's scheduler loop, gpt-fast's `generate`): requests are added while it runs,
and each `step` advances whatever it has admitted and returns the tokens that step produced. How it
batches requests, pools its KV memory or splits prefill from decode is its own business (its genes).

What it never gets is the tokens it is to produce: a request carries only its prompt, how many tokens
it may generate and when to stop. Decoding therefore depends on the engine's own outputs, and the
judge (`evaluators.judge.replay`) scores every request's own trajectory against the float64 reference and
stamps every token on its own clock when `step` hands it over.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

MIN_TEMPERATURE = 1e-3  # below, a request would be greedy in all but name (evo.workloads.sampling)


@dataclass(frozen=True)
class GenerationRequest:
    """One request: its prompt's token ids, at most `max_tokens` new tokens, ending early only at a `stop_ids`
    token. Greedy at `temperature` 0; above, seeded sampling by `evo.workloads.sampling.choose` (the same
    draw the judge checks), over the `top_p` nucleus, keyed on `seed` and the output index."""

    id: int
    prompt: tuple[int, ...]
    max_tokens: int
    stop_ids: tuple[int, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"request {self.id}: an empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.id}: max_tokens must be >= 1, got {self.max_tokens}")
        if not ((self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= 100) and 0 < self.top_p <= 1):
            raise ValueError(f"request {self.id}: temperature must be 0 or in [{MIN_TEMPERATURE}, 100] and top_p in "
                             f"(0, 1], got {self.temperature}, {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class TokenEvent:
    """A token a step produced for a request; `finished`: the request's last (max_tokens or a stop id)."""

    request_id: int
    token: int
    finished: bool = False


class GenerationEngine(Protocol):
    """What a generation workload's `build` returns (see the module)."""

    def add(self, request: GenerationRequest) -> None:
        """Admit a request (it may wait in the engine's own queue); returns at once."""
        ...

    def step(self) -> list[TokenEvent]:
        """Advance the admitted requests by one scheduling step; the tokens it produced, in order."""
        ...

    def abort(self, request_id: int) -> None:
        """Drop a request (its client went away), waiting or running: no token of it after this returns, and
        its memory (its KV rows or blocks, its place in the queue) is free for the next request. An id the
        engine does not hold (finished, or never added) is ignored."""
        ...


def check_fits(request: GenerationRequest, max_positions: int) -> None:
    """ValueError naming the bound when the request's prompt and new tokens need more positions than an engine
    holds (the preset's P + N): what every engine's `add` checks first."""
    if len(request.prompt) + request.max_tokens > max_positions:
        raise ValueError(f"request {request.id}: {len(request.prompt)} prompt + {request.max_tokens} new tokens is"
                         f" over the {max_positions} positions this engine holds (the preset's P + N)")
