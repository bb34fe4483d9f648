"""Tensors laid out in one flat shared byte buffer, so the judge and the engine's process exchange
inputs and outputs without pickling tensors back to the judge.

The judge allocates the arenas and hands each to the engine's process as a file descriptor over the
engine's own channel (no key of the judge's is handed out): on CPU an anonymous memory file
(`memfd_create`), on CUDA an allocation of its own made with the driver's virtual memory API
(`evaluators.sandbox.cuda_memory`), apart from torch's caching allocator. Either way the descriptor reaches the
arena and nothing else: the judge's inputs and expected outputs (ordinary tensors, on CUDA from the
caching allocator) never share an allocation with an arena. The judge writes inputs and reads outputs
through views; the engine's process gets the same views from a `Slot` table. Only the judge ever sends
pickles; the engine's process answers in JSON.

The arenas belong to the judge, not to an engine's process: an `ArenaPool` per evaluator lends one
pair (inputs, outputs) to each engine process alive at once, takes it back when that process is dead,
grows a pair only when a call needs more, and frees them all at `close`. So candidates that are
SIGKILLed cost nothing: the pool's pairs are allocated once and reused instead of one pair per
candidate (~2 GB per evaluation at a full-size GPU preset), and a pair whose candidate left a process
behind is freed, never lent again (that process keeps only its own mapping).
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from evaluators.sandbox import cuda_memory

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


def allocate(nbytes: int, device: str) -> tuple[torch.Tensor, int]:
    """A flat uint8 arena of at least `nbytes` (rounded up to 1 MiB, on CUDA then to the allocation
    granularity) that another process can map, and the descriptor it maps it from (the caller closes it
    once it is no longer to be sent)."""
    size = max(1 << 20, -(-nbytes // (1 << 20)) * (1 << 20))
    if torch.device(device).type == "cuda":
        return cuda_memory.allocate(size, device)
    fd = os.memfd_create("evo-arena", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return attach(fd, size, device), fd


def attach(fd: int, size: int, device: str = "cpu") -> torch.Tensor:
    """The arena behind a descriptor from `allocate`, as a flat uint8 tensor of `size` bytes on `device`
    (the mapping outlives `fd`)."""
    if torch.device(device).type == "cuda":
        return cuda_memory.attach(fd, size, device)
    mapping = mmap.mmap(fd, size)
    return torch.frombuffer(mapping, dtype=torch.uint8)


@dataclass(eq=False)
class ArenaPair:
    """One engine process's pair of arenas while it is lent; `version` changes whenever the pair is
    replaced, so a process knows it must be sent the new one."""

    device: str
    inputs: torch.Tensor | None = None
    outputs: torch.Tensor | None = None
    fds: tuple[int, ...] = ()  # the arenas' descriptors (memory files, CUDA allocations), sent to each new process
    version: int = 0

    def ensure(self, in_bytes: int, out_bytes: int) -> bool:
        """Both arenas at least this large (both replaced when either is too small, so an engine's process
        maps one pair at a time); True when they were replaced."""
        have_in = 0 if self.inputs is None else self.inputs.numel()
        have_out = 0 if self.outputs is None else self.outputs.numel()
        if self.inputs is not None and have_in >= in_bytes and have_out >= out_bytes:
            return False
        self.release()
        self.inputs, in_fd = allocate(max(in_bytes, have_in), self.device)
        self.fds = (in_fd,)  # closed by the next release even if the second allocation fails
        self.outputs, out_fd = allocate(max(out_bytes, have_out), self.device)
        self.fds = (in_fd, out_fd)
        self.version += 1
        return True

    @property
    def nbytes(self) -> int:
        return sum(0 if t is None else t.numel() for t in (self.inputs, self.outputs))

    def release(self) -> None:
        """Close the descriptors and drop the arenas (their memory is freed once no view of them is left)."""
        for fd in self.fds:
            os.close(fd)
        self.inputs = self.outputs = None
        self.fds = ()


@dataclass(eq=False)
class ArenaPool:
    """The judge's arenas on one device: a pair lent to each live engine process, reused across
    candidates, released at `close` (see the module's docstring)."""

    device: str
    _free: list[ArenaPair] = field(default_factory=list)
    _lent: list[ArenaPair] = field(default_factory=list)

    def lease(self) -> ArenaPair:
        """A pair for one engine process (empty until its first `ensure`), the largest free one first."""
        self._free.sort(key=lambda pair: pair.nbytes)
        pair = self._free.pop() if self._free else ArenaPair(self.device)
        self._lent.append(pair)
        return pair

    def give_back(self, pair: ArenaPair) -> None:
        """Return a pair once its engine process is dead (nothing of that candidate can write to it)."""
        if any(p is pair for p in self._lent):
            self._lent = [p for p in self._lent if p is not pair]
            self._free.append(pair)

    def discard(self, pair: ArenaPair) -> None:
        """Free a pair instead of reusing it (a process of its candidate outlived the kill)."""
        self._lent = [p for p in self._lent if p is not pair]
        pair.release()

    @property
    def pairs(self) -> int:
        return len(self._free) + len(self._lent)

    @property
    def nbytes(self) -> int:
        return sum(pair.nbytes for pair in (*self._free, *self._lent))

    def close(self) -> None:
        """Free every arena (pairs still lent included: call this once no engine process is alive)."""
        for pair in (*self._free, *self._lent):
            pair.release()
        self._free, self._lent = [], []
