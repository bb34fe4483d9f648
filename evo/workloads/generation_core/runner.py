"""What the scheduler asks of a model: forwards over pool rows, blind to requests but for how each token is
picked (vLLM's model runner likewise gets a batch, never the scheduler's queues)."""
from __future__ import annotations

from typing import Protocol

from evo.workloads.generation import GenerationRequest

Pick = tuple[GenerationRequest, int]  # how a row's token is chosen: its request, and the index of the token


class ModelRunner(Protocol):
    """A prompt chunk of one pool row (or of several, in one forward), and one decode step of the pool's first n
    rows together (or with the prompt chunks, in one forward); with speculation, a verify forward of those rows,
    several tokens each."""

    def prefill(self, row: int, tokens: tuple[int, ...], pos: int, pick: Pick | None) -> int | None:
        """Prompt tokens at positions [pos, pos+T) of `row`; with `pick` (they end the prompt), the next token."""
        ...

    def prefill_rows(self, rows: list[int], chunks: list[tuple[int, ...]], positions: list[int],
                     picks: list[Pick | None]) -> list[int | None]:
        """`prefill` of several rows in one forward: chunks[i] at positions [positions[i], ...) of rows[i], each
        seeing only its own row's keys; per row the next token, or None without its pick. Optional: called only
        when the policy's prefill_together is set."""
        ...

    def decode(self, tokens: list[int], positions: list[int], picks: list[Pick]) -> list[int]:
        """Rows [0, n) each feed tokens[r] at positions[r]; their next tokens, each picked by its request."""
        ...

    def mixed(self, tokens: list[int], positions: list[int], picks: list[Pick], rows: list[int],
              chunks: list[tuple[int, ...]], starts: list[int],
              prefill_picks: list[Pick | None]) -> tuple[list[int], list[int | None]]:
        """`decode` of rows [0, n) and `prefill_rows` of `rows` (other rows) in one forward: the decode rows' next
        tokens, and per chunk its next token or None. Optional: called only when the policy's prefill_with_decode
        is set."""
        ...

    def verify(self, fed: list[list[int]], positions: list[int], picks: list[list[Pick]]) -> list[list[int]]:
        """Rows [0, n) each feed fed[r] at positions [positions[r], positions[r] + len(fed[r])) in one forward,
        each token seeing the row's earlier positions and itself; per row, the token picked after each fed one
        (by picks[r][j]). Optional: called only when the policy's spec_tokens > 0."""
        ...
