"""A request trace: the load a generation engine is judged under, declared in the config and drawn
from a seed. Pure: numpy only.

A trace is `count` requests, each with a prompt length and a number of tokens to generate drawn
uniformly from their ranges, arriving by one of three processes (as `vllm bench serve` drives a
server): `burst` (all at time 0), `poisson` (independent arrivals at `rate` requests a second) or
`closed` (a closed loop: `concurrency` clients, each sending its next request when its last one
finished, so arrival times come from the engine's own speed). `concurrency` also caps how many
requests are in flight for the two open processes (0: no cap). The judge draws a trace afresh for
every evaluation from the OS's randomness (`evaluators.judge.traffic`), and its prompts' token ids at
replay time; a spec fixes the process, the counts and the ranges, not the draw.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ARRIVALS = ("burst", "poisson", "closed")


@dataclass(frozen=True)
class TraceSpec:
    """The config's `trace`: each field with its default; `__post_init__` says what is wrong."""

    arrival: str = "closed"  # burst | poisson | closed (see the module)
    count: int = 64  # requests in the trace
    concurrency: int = 16  # clients of a closed loop; for burst and poisson the cap on requests in flight (0: none)
    rate: float = 0.0  # poisson only: requests per second
    prompt_len: tuple[int, int] = (16, 256)  # tokens, drawn uniformly in [low, high]
    output_len: tuple[int, int] = (16, 128)  # tokens to generate (max_tokens), drawn uniformly in [low, high]
    seed: int = 0  # for callers that want one fixed draw (`draw(spec, default_rng(spec.seed))`); the judge ignores it

    def __post_init__(self) -> None:
        problems = []
        if self.arrival not in ARRIVALS:
            problems.append(f"arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}")
        if not (_is_int(self.count) and self.count >= 1):
            problems.append(f"count must be an integer >= 1, got {self.count!r}")
        if not (_is_int(self.concurrency) and self.concurrency >= (1 if self.arrival == "closed" else 0)):
            problems.append(f"concurrency must be an integer >= {1 if self.arrival == 'closed' else 0}"
                            f"{' (the clients of a closed loop)' if self.arrival == 'closed' else ' (0: no cap)'},"
                            f" got {self.concurrency!r}")
        if self.arrival == "poisson" and not (isinstance(self.rate, (int, float)) and self.rate > 0
                                              and math.isfinite(self.rate)):
            problems.append(f"rate must be a number of requests per second > 0 for poisson arrivals, got {self.rate!r}")
        if not _is_int(self.seed):
            problems.append(f"seed must be an integer, got {self.seed!r}")
        for name in ("prompt_len", "output_len"):
            span = getattr(self, name)
            if not (isinstance(span, (tuple, list)) and len(span) == 2 and all(_is_int(v) for v in span)
                    and 1 <= span[0] <= span[1]):
                problems.append(f"{name} must be [low, high] with 1 <= low <= high (tokens), got {span!r}")
        if problems:
            raise ValueError("trace: " + "; ".join(problems))


@dataclass(frozen=True)
class TraceRequest:
    """One request of a drawn trace: when it is sent (seconds from the replay's start; None in a closed
    loop, where a client sends it when its previous request finished) and its shape."""

    index: int
    arrival_s: float | None
    prompt_len: int
    max_tokens: int


def draw(spec: TraceSpec, rng: np.random.Generator) -> tuple[TraceRequest, ...]:
    """The trace's requests in arrival order, from `rng` (the same seed, the same trace)."""
    prompts = rng.integers(spec.prompt_len[0], spec.prompt_len[1] + 1, spec.count)
    outputs = rng.integers(spec.output_len[0], spec.output_len[1] + 1, spec.count)
    if spec.arrival == "poisson":
        arrivals = np.cumsum(rng.exponential(1.0 / spec.rate, spec.count))
        arrivals -= arrivals[0]  # the first request opens the replay
    else:
        arrivals = np.zeros(spec.count)
    return tuple(TraceRequest(i, None if spec.arrival == "closed" else float(arrivals[i]), int(prompts[i]),
                              int(outputs[i])) for i in range(spec.count))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
