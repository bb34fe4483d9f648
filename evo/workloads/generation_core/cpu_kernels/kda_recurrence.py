"""The KDA recurrence (gated delta rule) for B sequences of tokens: the C kernel (`kda_recurrence.c`) on torch
tensors, each head's state updated in place in one pass over it a token."""
from __future__ import annotations

import functools

import torch

from evo.workloads.generation_core.cpu_kernels.build import (I64, PTR, KernelUnavailable, kernel_function,
                                                             require_cpu)

MAX_DIM = 512  # the kernel's per-head scratch (kda_recurrence.c's MAX_V)


@functools.cache
def _kernel():
    return kernel_function("kda_recurrence", "evo_kda_recurrence", None, (PTR,) * 8 + (I64,) * 5)


def check_recurrence_supported(head_dim: int, value_dim: int, device: torch.device | str) -> None:
    """Raises KernelUnavailable (what is wrong, what is allowed) unless the kernel can serve these heads; builds it."""
    require_cpu(device, "KDA recurrence")
    if value_dim % 8 or not (0 < head_dim <= MAX_DIM and 0 < value_dim <= MAX_DIM):
        raise KernelUnavailable(f"the KDA recurrence kernel needs a value dimension that is a multiple of 8 and "
                                f"head dimensions up to {MAX_DIM}, got K={head_dim}, V={value_dim}")
    _kernel()


def kda_recurrence(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                   beta: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """o [B, T, H, V] of the delta rule over q, k, decay [B, T, H, K], v [B, T, H, V], beta [B, T, H] (float32) from
    `state` [B, H, K, V] (float32, contiguous), which ends as the state after each sequence's last token. With
    `lengths` (int64 [B]) sequence b stops after lengths[b] tokens: its later tokens are not read and their rows of o
    are left as allocated (unset)."""
    B, T, H, K = k.shape
    Vd = v.shape[-1]
    shapes_ok = (q.shape == k.shape == decay.shape and v.shape == (B, T, H, Vd) and beta.shape == (B, T, H)
                 and state.shape == (B, H, K, Vd) and (lengths is None or lengths.shape == (B,)))
    if not shapes_ok or Vd % 8 or K > MAX_DIM or Vd > MAX_DIM:
        raise ValueError(f"kda_recurrence: q, k, decay [B, T, H, K], v [B, T, H, V] (V a multiple of 8, K and V up "
                         f"to {MAX_DIM}), beta [B, T, H], state [B, H, K, V], lengths [B]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, decay {tuple(decay.shape)}, v {tuple(v.shape)}, beta "
                         f"{tuple(beta.shape)}, state {tuple(state.shape)}, lengths "
                         f"{None if lengths is None else tuple(lengths.shape)}")
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"kda_recurrence: the state is updated in place: float32 and contiguous, got {state.dtype}"
                         f"{'' if state.is_contiguous() else ', not contiguous'}")
    q, k, v, decay, beta = (t.to(torch.float32).contiguous() for t in (q, k, v, decay, beta))
    if lengths is not None:
        lengths = lengths.to(torch.int64).contiguous()
        if ((lengths < 0) | (lengths > T)).any():
            raise ValueError(f"kda_recurrence: lengths must lie in [0, {T}], got {lengths.tolist()}")
    o = torch.empty(B, T, H, Vd, dtype=torch.float32)
    _kernel()(state.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), decay.data_ptr(), beta.data_ptr(),
              o.data_ptr(), None if lengths is None else lengths.data_ptr(), B, T, H, K, Vd)
    return o


__all__ = ["KernelUnavailable", "check_recurrence_supported", "kda_recurrence"]
