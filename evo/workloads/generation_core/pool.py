"""What the scheduler asks of an engine's memory: rows, one per admitted request. SGLang keeps a hybrid
model's recurrent state (`MambaPool`) behind the same interface as its KV slots (`ReqToTokenPool`); so here
a KV pool and Kimi Linear's state pool are both a `Pool`. The scheduler never reads a row's contents."""
from __future__ import annotations

from typing import Protocol


class Pool(Protocol):
    """Rows of per-request memory; the scheduler keeps the decoding requests in the first rows."""

    def reserve(self, row: int, length: int) -> None:
        """Room for positions [0, length) of `row`, before a forward writes them."""
        ...

    def release(self, row: int) -> None:
        """`row`'s request ended: what the row holds may be given back."""
        ...

    def move(self, src: int, dst: int, length: int) -> None:
        """Row src's memory (its first `length` positions) into the free row dst; src is then free."""
        ...

    def swap(self, a: int, b: int, length: int) -> None:
        """Rows a and b trade their memory (the first `length` positions of each)."""
        ...
