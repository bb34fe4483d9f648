"""The KDA oracle in float64: a token-by-token recurrence, as plain as the math, and the same math
by chunks (exact, not an approximation), which the judge uses where it is faster.

Per batch b and head h, with state S [K, V]:
    q_t <- l2norm(q_t) * K**-0.5 ;  k_t <- l2norm(k_t)
    S <- diag(exp g_t) S ;  S <- S + beta_t k_t (v_t - S^T k_t)^T ;  o_t = S^T q_t

`reference_and_scales` also gives, for o, the size of the terms each output is summed from: their
root-sum-square sqrt((q_t^2)^T S_t^2), which is about |o_t| where the terms' signs are random and far
above it where q_t is nearly orthogonal to what the state holds; there o_t cancels and no float32
engine can be within a relative 1e-5 of it, as its rounding error follows the terms (the judge's
condition-aware bound, evaluators/judge/check.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from evo.workloads.kda.definition import L2NORM_EPS

CHUNK = 64  # tokens per chunk of the chunked oracle
MAX_EXPONENT = 600.0  # |cumulative log decay| within one chunk: exp(600) ~ 1e260 stays inside float64
CHUNKED_MIN_T = 8  # below this many tokens the token loop is faster on a CPU (measured, docs/gpu.md)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def recurrent_kda(inputs: dict, dtype: torch.dtype, scales: bool = False) -> dict:
    """Token recurrence in `dtype` (float64 for the oracle, float32 for the eager baseline); with
    `scales`, also "o_scale" = sqrt((q_t^2)^T S_t^2) per token (see the module's docstring)."""
    q, k, v, g, beta = (inputs[n].to(dtype) for n in ("q", "k", "v", "g", "beta"))
    B, T, H, K = q.shape  # q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]
    V = v.shape[-1]
    q = l2norm(q) * K**-0.5
    k = l2norm(k)
    decay = g.exp()
    h0 = inputs.get("initial_state")
    S = h0.to(dtype).clone() if h0 is not None else q.new_zeros(B, H, K, V)  # [B, H, K, V]
    o = v.new_empty(B, T, H, V)
    o_scale = v.new_empty(B, T, H, V) if scales else None
    for t in range(T):
        k_t = k[:, t]  # [B, H, K]
        S = S * decay[:, t, :, :, None]
        residual = v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S)  # v_t - S^T k_t
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k_t, residual)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], S)
        if o_scale is not None:
            o_scale[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] ** 2, S**2).sqrt()
    return {"o": o, "final_state": S, **({"o_scale": o_scale} if scales else {})}


def chunk_for(g: torch.Tensor, chunk: int = CHUNK) -> int:
    """The largest chunk (<= `chunk`, halving) whose cumulative decay exp(+-G) stays finite in float64
    for these log decays; 0 when not even one token does (then only the token loop is exact)."""
    steepest = float(-g.min()) if g.numel() else 0.0
    while chunk >= 1 and steepest * chunk > MAX_EXPONENT:
        chunk //= 2
    return chunk


def chunked_kda(inputs: dict, dtype: torch.dtype = torch.float64, chunk: int = CHUNK, scales: bool = False) -> dict:
    """The token recurrence computed by chunks (the WY form), vectorised over batch, heads and chunks
    except for one step per chunk. Exact math: with G_i the cumulative log decay inside a chunk,
    Kg = k exp(G), Kinv = k exp(-G) (factored exponents, finite in float64 for |G| <= MAX_EXPONENT),
        (I + diag(beta) strict_lower(Kg Kinv^T)) U = diag(beta) (V - Kg S0)      (U: the deltas)
        o = Qg S0 + lower(Qg Kinv^T) U ;  S_C = exp(G_C) S0 + (k exp(G_C - G))^T U.
    Tokens past T are padded with zeros and g = 0, beta = 0, which leave the state as it is. With
    `scales`, also "o_scale" = sqrt(Qg^2 S0^2 + lower(Qg^2 (Kinv^2)^T) U^2): the root-sum-square of o's terms."""
    q, k, v, g, beta = (inputs[n].to(dtype) for n in ("q", "k", "v", "g", "beta"))
    B, T, H, K = q.shape
    V, C = v.shape[-1], chunk
    pad = -T % C

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, *D] -> [B, H, N, C, *D]
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.transpose(1, 2).unflatten(2, (-1, C))

    q, k = chunks(l2norm(q) * K**-0.5), chunks(l2norm(k))  # [B, H, N, C, K]
    v, beta = chunks(v), chunks(beta[..., None])  # [B, H, N, C, V], [B, H, N, C, 1]
    G = chunks(g).cumsum(-2)  # [B, H, N, C, K]
    Kg, Kinv, Qg = k * G.exp(), k * (-G).exp(), q * G.exp()
    ones = torch.ones(C, C, dtype=torch.bool, device=q.device)
    zero = q.new_zeros(())
    A = torch.where(ones.tril(-1), Kg @ Kinv.transpose(-1, -2), zero) * beta  # [B, H, N, C, C]
    L = A + torch.eye(C, dtype=dtype, device=q.device)
    W = torch.linalg.solve_triangular(L, beta * Kg, upper=False, unitriangular=True)  # [B, H, N, C, K]
    U0 = torch.linalg.solve_triangular(L, beta * v, upper=False, unitriangular=True)  # [B, H, N, C, V]
    P = torch.where(ones.tril(), Qg @ Kinv.transpose(-1, -2), zero)  # [B, H, N, C, C]
    gC = G[..., -1, :]  # [B, H, N, K]
    Kd = k * (gC[..., None, :] - G).exp()  # [B, H, N, C, K]
    h0 = inputs.get("initial_state")
    S = h0.to(dtype).clone() if h0 is not None else q.new_zeros(B, H, K, V)  # [B, H, K, V]
    o = v.new_empty(v.shape)
    o_scale = v.new_empty(v.shape) if scales else None
    P_sq = torch.where(ones.tril(), Qg**2 @ (Kinv**2).transpose(-1, -2), zero) if scales else None
    for n in range(v.shape[2]):
        U = U0[:, :, n] - W[:, :, n] @ S  # [B, H, C, V]
        o[:, :, n] = Qg[:, :, n] @ S + P[:, :, n] @ U
        if o_scale is not None:
            o_scale[:, :, n] = (Qg[:, :, n] ** 2 @ S**2 + P_sq[:, :, n] @ U**2).sqrt()
        S = gC[:, :, n, :, None].exp() * S + Kd[:, :, n].transpose(-1, -2) @ U

    def tokens(x: torch.Tensor) -> torch.Tensor:  # [B, H, N, C, V] -> [B, T, H, V]
        return x.flatten(2, 3).transpose(1, 2)[:, :T]

    return {"o": tokens(o), "final_state": S, **({"o_scale": tokens(o_scale)} if scales else {})}


def reference(inputs: dict) -> dict:
    """Float64 outputs: o [B, T, H, V] and final_state [B, H, K, V]. By chunks on CUDA and for longer
    sequences (the same math, ~1e-14 apart), else the token loop."""
    return _oracle(inputs, scales=False)


def reference_and_scales(inputs: dict) -> tuple[dict, dict]:
    """`reference`'s outputs and {"o": the root-sum-square of o's terms}, from the same pass."""
    outputs = _oracle(inputs, scales=True)
    return outputs, {"o": outputs.pop("o_scale")}


def _oracle(inputs: dict, scales: bool) -> dict:
    """`reference`'s outputs, by chunks or the token loop (see there), with "o_scale" too where `scales`."""
    T, cuda = inputs["q"].shape[1], inputs["q"].device.type == "cuda"
    chunk = min(chunk_for(inputs["g"]), max(16, 1 << max(T - 1, 0).bit_length()))  # no more padding than needed
    if chunk >= 8 and (cuda or T >= CHUNKED_MIN_T):
        return chunked_kda(inputs, torch.float64, chunk, scales)
    return recurrent_kda(inputs, torch.float64, scales)
