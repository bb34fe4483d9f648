"""What the scheduler asks of a model: forwards over pool rows, blind to requests but for how each token is
picked (vLLM's model runner likewise gets a batch, never the scheduler's queues)."""
from __future__ import annotations

from typing import Protocol

from evo.workloads.generation import GenerationRequest

Pick = tuple[GenerationRequest, int]  # how a row's token is chosen: its request, and the index of the token


class ModelRunner(Protocol):
    """A prompt chunk of one pool row, and one decode step of the pool's first n rows together."""

    def prefill(self, row: int, tokens: tuple[int, ...], pos: int, pick: Pick | None) -> int | None:
        """Prompt tokens at positions [pos, pos+T) of `row`; with `pick` (they end the prompt), the next token."""
        ...

    def decode(self, tokens: list[int], positions: list[int], picks: list[Pick]) -> list[int]:
        """Rows [0, n) each feed tokens[r] at positions[r]; their next tokens, each picked by its request."""
        ...
