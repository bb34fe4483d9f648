"""Grouped-query decode attention over each row's own keys: the C kernel (`decode_attention.c`) on torch tensors."""
from __future__ import annotations

import functools

import torch

from evo.workloads.generation_core.cpu_kernels.build import (FLOAT, I64, INT, PTR, KernelUnavailable, kernel_function,
                                                             require_cpu)


@functools.cache
def _kernel():
    return kernel_function("decode_attention", "evo_decode_attention", INT,
                           (PTR, I64, I64, PTR, PTR, INT, I64, I64, I64, I64, I64, I64, PTR, INT, INT, INT, INT, FLOAT,
                            PTR))


def check_attention_supported(head_dim: int, kv_dtype: torch.dtype, device: torch.device | str) -> None:
    """Raises KernelUnavailable (what is wrong, what is allowed) unless the kernel can serve this engine; builds it."""
    require_cpu(device, "decode attention")
    if head_dim % 8:
        raise KernelUnavailable(f"the decode attention kernel needs a head dim that is a multiple of 8, got {head_dim}")
    if kv_dtype not in (torch.float32, torch.bfloat16):
        raise KernelUnavailable(f"the decode attention kernel reads a float32 or bfloat16 cache, not {kv_dtype}")
    _kernel()


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [n, H, d] (any float dtype); k, v [n, KVH, S, d] (float32 or bfloat16, any strides with d contiguous);
    lengths [n] int64: row r attends to its keys [0, lengths[r]) (each <= S). Returns [n, H, d] float32."""
    n, H, d = q.shape
    KVH = k.shape[1]
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k.dtype != v.dtype or H % KVH or d % 8 or H // KVH > 16:
        raise ValueError(f"decode_attention: k and v need contiguous heads and one dtype, H a multiple of KVH by at "
                         f"most 16, d a multiple of 8 (k {tuple(k.shape)} {k.dtype} strides {k.stride()}, v {v.dtype} "
                         f"strides {v.stride()}, H={H})")
    lengths = lengths.to(torch.int64).contiguous()
    if k.shape != v.shape or k.shape[0] != n or k.shape[3] != d or lengths.shape != (n,) or (
            n and not 1 <= int(lengths.min()) <= int(lengths.max()) <= k.shape[2]):
        raise ValueError(f"decode_attention: q [n, H, d], k and v [n, KVH, S, d], lengths [n] each in [1, S]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, lengths {lengths.tolist()}")
    q = q.float().contiguous()
    out = torch.empty(n, H, d, dtype=torch.float32)
    rc = _kernel()(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), int(k.dtype == torch.bfloat16),
                   k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), lengths.data_ptr(),
                   n, H, KVH, d, scale, out.data_ptr())
    if rc != 0:
        raise MemoryError("decode_attention: the kernel could not allocate its scratch")
    return out


__all__ = ["KernelUnavailable", "check_attention_supported", "decode_attention"]
