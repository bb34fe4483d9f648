"""Driving a generation engine by hand in tests: add requests, step, abort some along the way."""
from __future__ import annotations


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
