"""The KDA oracle: a float64 token-by-token recurrence, as plain as the math.

Per batch b and head h, with state S [K, V]:
    q_t <- l2norm(q_t) * K**-0.5 ;  k_t <- l2norm(k_t)
    S <- diag(exp g_t) S ;  S <- S + beta_t k_t (v_t - S^T k_t)^T ;  o_t = S^T q_t
"""
from __future__ import annotations

import torch

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def recurrent_kda(inputs: dict, dtype: torch.dtype) -> dict:
    """Token recurrence in `dtype` (float64 for the oracle, float32 for the eager baseline)."""
    q, k, v, g, beta = (inputs[n].to(dtype) for n in ("q", "k", "v", "g", "beta"))
    B, T, H, K = q.shape  # q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]
    V = v.shape[-1]
    q = l2norm(q) * K**-0.5
    k = l2norm(k)
    decay = g.exp()
    h0 = inputs.get("initial_state")
    S = h0.to(dtype).clone() if h0 is not None else q.new_zeros(B, H, K, V)  # [B, H, K, V]
    o = v.new_empty(B, T, H, V)
    for t in range(T):
        k_t = k[:, t]  # [B, H, K]
        S = S * decay[:, t, :, :, None]
        residual = v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S)  # v_t - S^T k_t
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k_t, residual)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return {"o": o, "final_state": S}


def reference(inputs: dict) -> dict:
    """Float64 outputs: o [B, T, H, V] and final_state [B, H, K, V]."""
    return recurrent_kda(inputs, torch.float64)
