"""Driving a generation engine by hand in tests: the cpu_small presets' trace and its prompts; add requests,
step, abort some along the way."""
from __future__ import annotations

import numpy as np

from evo.core.trace import TraceSpec, draw

# ten requests, four in flight: the engine tests' replay of a cpu_small preset
TRACE = draw(TraceSpec("closed", count=10, concurrency=4, prompt_len=(1, 24), output_len=(1, 12)),
             np.random.default_rng(11))


def trace_prompts(vocab: int, seed: int, trace=TRACE) -> list[list[int]]:
    """Fresh ids for the trace's prompts, the vocabulary's two ends among them."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, t.prompt_len).tolist() for t in trace]
    prompts[0][0], prompts[1][-1] = 0, vocab - 1
    return prompts


def drive(generator, requests, abort_after: dict[int, int] | None = None) -> dict[int, list[int]]:
    """Add `requests`, step until each ended; abort request i once it made abort_after[i] tokens (0: before
    its first step). Request id -> its tokens."""
    abort_after = dict(abort_after or {})
    made: dict[int, list[int]] = {r.id: [] for r in requests}
    ended: set[int] = set()
    for request in requests:
        generator.add(request)
    for rid in [i for i, n in abort_after.items() if n == 0]:
        generator.abort(rid)
        ended.add(rid)
    for _ in range(200):
        if len(ended) == len(requests):
            return made
        for event in generator.step():
            assert event.request_id not in ended, f"a token for request {event.request_id} after it ended"
            made[event.request_id].append(event.token)
            if event.finished:
                ended.add(event.request_id)
            elif abort_after.get(event.request_id) == len(made[event.request_id]):
                generator.abort(event.request_id)
                ended.add(event.request_id)
    raise AssertionError(f"requests {sorted(set(made) - ended)} never ended")
