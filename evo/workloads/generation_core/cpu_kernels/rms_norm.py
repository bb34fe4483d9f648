"""RMSNorm after a residual add, float32 rows: the C kernel (`rms_norm.c`) on torch tensors."""
from __future__ import annotations

import functools

import torch

from evo.workloads.generation_core.cpu_kernels.build import (FLOAT, I64, PTR, KernelUnavailable, kernel_function,
                                                             require_cpu)


@functools.cache
def _kernel():
    return kernel_function("rms_norm", "evo_add_rms_norm", None, (PTR, PTR, PTR, PTR, PTR, I64, I64, FLOAT))


def check_norm_supported(hidden: int, dtype: torch.dtype, device: torch.device | str) -> None:
    """Raises KernelUnavailable (what is wrong, what is allowed) unless the kernel can serve this engine; builds it."""
    require_cpu(device, "RMSNorm")
    if hidden % 8:
        raise KernelUnavailable(f"the RMSNorm kernel needs a hidden size that is a multiple of 8, got {hidden}")
    if dtype != torch.float32:
        raise KernelUnavailable(f"the RMSNorm kernel takes float32 activations, not {dtype}")
    _kernel()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 in_place: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_x) for float32 x [..., D]: new_x = x + residual (written into x when `in_place` and x is
    contiguous), normed = new_x / sqrt(mean(new_x^2) + eps) * weight, the mean accumulated in float32."""
    D = x.shape[-1]
    if (x.dtype != torch.float32 or D % 8 or weight.dtype != torch.float32 or weight.shape != (D,)
            or (residual is not None and residual.shape != x.shape)):
        raise ValueError(f"add_rms_norm: float32 x [..., D] with D a multiple of 8, a float32 weight [D] and a "
                         f"residual shaped as x; got x "
                         f"{tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}, residual "
                         f"{None if residual is None else tuple(residual.shape)}")
    source = x.contiguous()
    new_x = source if (in_place and source is x) or residual is None else torch.empty_like(source)
    if residual is not None:
        residual = residual.to(torch.float32).contiguous()
    weight = weight.contiguous()
    out = torch.empty_like(source)
    _kernel()(source.data_ptr(), None if residual is None else residual.data_ptr(), new_x.data_ptr(),
              weight.data_ptr(), out.data_ptr(), source.numel() // D, D, eps)
    return out, new_x


__all__ = ["KernelUnavailable", "add_rms_norm", "check_norm_supported"]
