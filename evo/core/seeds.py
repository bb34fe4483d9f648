"""Every seed in a run is derived from the one run seed by name: same seed, same proposals."""
from __future__ import annotations

import hashlib


def derive_seed(run_seed: int, name: str) -> int:
    """A 63-bit seed for component `name` (an agent, an evaluator, the search) of a run."""
    digest = hashlib.sha256(f"{run_seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
