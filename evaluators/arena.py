"""Tensors laid out in one flat shared byte buffer, so the judge and the engine's process exchange
inputs and outputs without pickling tensors back to the judge.

The judge allocates the arenas (CPU: an anonymous memory file, `memfd_create`, whose descriptor goes to
the engine's process over its own channel; CUDA: device memory shared through IPC), writes inputs and
reads outputs through views; the engine's process gets the same views from a `Slot` table. Only the
judge ever sends pickles; the engine's process answers in JSON.
"""
from __future__ import annotations

import mmap
import os
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


def allocate(nbytes: int, device: str) -> tuple[torch.Tensor, int | None]:
    """A flat uint8 arena of at least `nbytes` (rounded up to 1 MiB) the other process can map, and on
    CPU the descriptor of its memory file (the caller closes it once sent)."""
    size = max(1 << 20, -(-nbytes // (1 << 20)) * (1 << 20))
    if torch.device(device).type != "cpu":
        return torch.empty(size, dtype=torch.uint8, device=device), None
    fd = os.memfd_create("evo-arena", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return attach(fd, size), fd


def attach(fd: int, size: int) -> torch.Tensor:
    """The CPU arena behind a memory file's descriptor, as a flat uint8 tensor (the mapping outlives `fd`)."""
    mapping = mmap.mmap(fd, size)
    return torch.frombuffer(mapping, dtype=torch.uint8)
