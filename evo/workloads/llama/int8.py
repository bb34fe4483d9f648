"""Int8 weight-only quantisation of the Llama engine's projections (the gene `weight_quant=int8`).

A weight W [out, in] is held as int8 rows q and one scale per output row: scale = absmax(row) / 127,
q = round(W / scale) clamped to [-127, 127] (symmetric, round to nearest; llama.cpp's Q8_0 with one block per
row). x @ W^T is then (x @ q^T) * scale; the activations stay in the engine's dtype. The weights stay int8 in
memory whatever the kernel.

Two kernels (`int8_bench` times them against F.linear on this CPU):
- `int8pack`: torch's `_weight_int8pack_mm(x, q, scale)` (x and scale in one dtype). On x86 only its bfloat16
  path is vectorised (AVX2/AVX512), reading 8 or 16 columns a step with no tail and with aligned loads: it
  is used for bfloat16 when `in` is a multiple of 16, on a 64-byte aligned x. Its float32 path there is a
  scalar loop (5-30x slower than F.linear at the cpu preset's shapes).
- `dequantised`: the int8 rows widened to x's dtype for the call, the output scaled per row (everything else).

`quantise_groups` holds a weight as int8 with one scale per GROUP consecutive inputs of a row instead (llama.cpp's
Q8_0 block, its scale kept float32): a scale per 32 weights follows the weights' local range, so one large weight
coarsens 31 others, not a whole row. On SmolLM2-135M every projection and the LM head so held, float32 activations,
over the accuracy contract's 16 calibration sequences: top-1 agreement with float64 92.3%, mean gap 0.0046, largest
0.53 logits (an honest bfloat16 execution: 92.2%, 0.0048, 0.22; per-row int8: 89.4%, 0.0117, 1.18, outside the
bfloat16-calibrated budget of 84.4%, 0.0096, 0.89). The linear kernel `q8_weights` multiplies such weights.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x [M, in], q, scale) -> [M, out]
VECTOR_COLUMNS = 16  # the widest step of torch's vectorised int8pack kernels (AVX512 bfloat16)
ALIGN = 64  # bytes: the CPU allocator's alignment, enough for the kernels' aligned loads


def quantise_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (q int8 [out, in], scale float32 [out]) with W ~ q * scale[:, None]: one group a row."""
    q, scale = quantise_groups(w, w.shape[1])
    return q, scale[:, 0]


GROUP = 32  # inputs per scale in `quantise_groups` (llama.cpp's QK8_0)


def quantise_groups(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (q int8 [out, in], scale float32 [out, ceil(in / group)]) with W ~ q * scale per group of
    `group` consecutive inputs (the last one shorter where `in` is not a multiple), absmax / 127, round to nearest."""
    out, inputs = w.shape
    groups = -(-inputs // group)
    padded = torch.zeros(out, groups * group, dtype=torch.float32)
    padded[:, :inputs] = w.detach().float()
    blocks = padded.view(out, groups, group)
    scale = blocks.abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny) / 127  # a zero group: q = 0, any scale
    q = torch.round(blocks / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.view(out, -1)[:, :inputs].contiguous(), scale.contiguous()


def dequantised_groups(q: torch.Tensor, scale: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """`quantise_groups`' (q, scale) -> the float32 weight [out, in] they stand for."""
    return q.float() * scale.repeat_interleave(group, 1)[:, :q.shape[1]]


def int8pack(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """torch's int8 weight-only matmul: x [M, in] and scale [out] in one float dtype, q int8 [out, in]."""
    if x.data_ptr() % ALIGN or not x.is_contiguous():  # its loads need aligned rows (a fresh tensor is)
        x = x.clone(memory_format=torch.contiguous_format)
    return torch._weight_int8pack_mm(x, q, scale)


def dequantised(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The int8 rows widened to x's dtype for this call, the per-row scale on the output."""
    return F.linear(x, q.to(x.dtype)) * scale


def choose_kernel(device: torch.device, dtype: torch.dtype, in_features: int) -> Kernel:
    """`int8pack` where torch has a vector kernel for it that is safe at this width (bfloat16 on CPU) or a
    device kernel (probed: it runs and agrees with `dequantised`); else `dequantised`."""
    if in_features % VECTOR_COLUMNS or (device.type == "cpu" and dtype != torch.bfloat16):
        return dequantised
    return int8pack if _int8pack_runs(device, dtype) else dequantised


@functools.lru_cache(maxsize=None)
def _int8pack_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `int8pack` runs on `device` at `dtype` and agrees with `dequantised` on a probe."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4 * VECTOR_COLUMNS, generator=gen).to(device, dtype)
    q, scale = quantise_rows(torch.randn(24, 4 * VECTOR_COLUMNS, generator=gen))
    q, scale = q.to(device), scale.to(device, dtype)
    try:
        got = int8pack(x, q, scale)
    except (AttributeError, NotImplementedError, RuntimeError):  # absent, or no kernel for this device or dtype
        return False
    want = dequantised(x, q, scale).float()
    return torch.allclose(got.float(), want, rtol=0.05, atol=0.05 * want.abs().max().item())


@dataclass(frozen=True, eq=False)
class Int8Weight:
    """A quantised projection: q int8 [out, in], scale [out] in the activation dtype. `w(x)`: x [..., in] -> [..., out]."""

    q: torch.Tensor
    scale: torch.Tensor
    kernel: Kernel

    @classmethod
    def of(cls, w: torch.Tensor, device: torch.device, dtype: torch.dtype) -> Int8Weight:
        q, scale = quantise_rows(w)
        return cls(q.to(device), scale.to(device, dtype), choose_kernel(device, dtype, w.shape[1]))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # the kernels take 2-D rows
        return self.kernel(rows, self.q, self.scale).view(*x.shape[:-1], self.q.shape[0])
