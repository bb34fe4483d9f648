"""Tensors laid out in one flat shared byte buffer, so the judge and the engine's process exchange
inputs and outputs without pickling tensors back to the judge.

The judge allocates the arenas (CPU shared memory, or CUDA memory shared through IPC), writes inputs
and reads outputs through views; the engine's process gets the same views from a `Slot` table. Only
the judge ever sends pickles; the engine's process answers in JSON.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

ALIGN = 256  # bytes: every slot starts on a boundary any dtype (and vector loads) can use


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in an arena: byte offset, shape, dtype name (e.g. "float32")."""

    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * dtype_of(self.dtype).itemsize


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def layout(specs: Mapping[str, tuple[Sequence[int], str] | None]) -> tuple[dict[str, Slot | None], int]:
    """Slots for named (shape, dtype) specs, in order, aligned; None stays None. Returns (slots, bytes)."""
    slots: dict[str, Slot | None] = {}
    offset = 0
    for name, spec in specs.items():
        if spec is None:
            slots[name] = None
            continue
        shape, dtype = spec
        slot = Slot(offset, tuple(int(s) for s in shape), dtype)
        slots[name] = slot
        offset += -(-max(slot.nbytes, 1) // ALIGN) * ALIGN
    return slots, offset


def view(arena: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The tensor a slot describes, as a view into `arena` (a flat uint8 tensor)."""
    flat = arena[slot.offset: slot.offset + slot.nbytes]
    return flat.view(dtype_of(slot.dtype)).view(slot.shape)


def allocate(nbytes: int, device: str) -> torch.Tensor:
    """A flat uint8 arena of at least `nbytes` (rounded up to 1 MiB) the other process can map."""
    size = max(1 << 20, -(-nbytes // (1 << 20)) * (1 << 20))
    arena = torch.empty(size, dtype=torch.uint8, device=device)
    return arena.share_memory_() if arena.device.type == "cpu" else arena
