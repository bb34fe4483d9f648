"""The stage functions of the chunked (WY/UT) KDA forward, written against chunked tensors.

Chunked tensors are [B, H, N, C, D] (N chunks of C tokens); every function also accepts one chunk
([B, H, C, D]) because it only touches the last two dimensions, which is what lets intra run per
chunk inside the state loop. Within a chunk with start state S0 and inclusive cumulative gate G
(Gamma = exp G):
    A[t,i] = beta_t sum_k k_t k_i exp(G_t - G_i)  (i < t)     M[t,i] = sum_k q_t k_i exp(G_t - G_i)  (i <= t)
    W  = (I + A)^-1 diag(beta) (K * Gamma)        U0 = (I + A)^-1 diag(beta) V
    U  = U0 - W S0     O = (Q * Gamma) S0 + M U     S_next = diag(Gamma_C) S0 + (K * exp(G_C - G))^T U
Each stage takes the context dict and returns the entries it adds; the recurrence's unit is the
per-chunk state update `chunk_step`, which `loop_step` composes with intra and output when they are
fused into the loop. Intra, the state update and output are open (see `open_code.py`): a genome may carry
source code that replaces them.
"""
from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Callable, Mapping

import torch

from evo.workloads.kda.genes import Plan
from evo.workloads.kda.reference import L2NORM_EPS

Ctx = dict
Impl = Mapping[str, Callable]  # stage name -> implementation (see HAND_WRITTEN)


# ---- gate and l2norm -------------------------------------------------------------------------
def gate(ctx: Ctx, plan: Plan) -> Ctx:
    G = ctx["g"].cumsum(-2)  # [B, H, N, C, K] inclusive chunk-local cumulative log decay
    gC = G[..., -1, :]  # [B, H, N, K] log decay over the whole chunk
    return {"G": G, "gC": gC, "gammaC": gC.exp()}


def l2norm(ctx: Ctx, plan: Plan) -> Ctx:
    q, k = ctx["q"], ctx["k"]
    scale = q.shape[-1] ** -0.5
    q = q * (torch.rsqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS) * scale)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)
    return {"q": q, "k": k}


# ---- pair products sum_k x_t[k] k_i[k] exp(G_t[k] - G_i[k]) ----------------------------------
def _pairwise(X: torch.Tensor, Kc: torch.Tensor, G: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    C = G.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=G.device).tril()
    D = G.unsqueeze(-2) - G.unsqueeze(-3)  # [..., C(t), C(i), K]; > 0 above the diagonal
    E = D.masked_fill(~causal[:, :, None], float("-inf")).exp()
    EK = (E * Kc.unsqueeze(-3)).to(cd)  # [..., t, i, K]
    return (X.to(cd).unsqueeze(-2) @ EK.transpose(-1, -2)).squeeze(-2)  # [S, ..., C, C]


def _factored_chunk(X: torch.Tensor, Kc: torch.Tensor, G: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    # exp(-G) overflows once G < -88 (float32): under strong decay this form gives inf/NaN on purpose.
    return (X * G.exp()).to(cd) @ (Kc * (-G).exp()).to(cd).transpose(-1, -2)


def _factored_subchunk(X: torch.Tensor, Kc: torch.Tensor, G: torch.Tensor, c: int, cd: torch.dtype) -> torch.Tensor:
    """Blocks of c tokens. Off-diagonal block (r, s<r): offset G_ref = G at the last row of block s,
    so both factors are <= 1. Diagonal blocks: offset G at the block's middle row, so each factor is
    at most exp(5 * c/2) at g >= -5: finite for c <= 32 (exp(80)), overflow for c = 64 (exp(160))."""
    C = G.shape[-2]
    nb = C // c
    Gb, Kb, Xb = G.unflatten(-2, (nb, c)), Kc.unflatten(-2, (nb, c)), X.unflatten(-2, (nb, c))
    Gmid = Gb[..., c // 2 : c // 2 + 1, :]  # [..., nb, 1, K]
    diag = (Xb * (Gb - Gmid).exp()).to(cd) @ (Kb * (Gmid - Gb).exp()).to(cd).transpose(-1, -2)  # [S, ..., nb, c, c]
    eye = torch.eye(nb, dtype=torch.bool, device=G.device)[:, None, :, None]  # [r, 1, s, 1]
    full = torch.where(eye, diag.unsqueeze(-2), 0.0).flatten(-4, -3).flatten(-2, -1)  # [S, ..., C, C]
    if nb == 1:
        return full
    Gref = Gb[..., -1, :]  # [..., nb(s), K]
    col = (Kb * (Gref.unsqueeze(-2) - Gb).exp()).to(cd)  # [..., nb(s), c, K], factors <= 1
    # rows in blocks <= s would get positive exponents; clamp keeps them finite, they are masked below
    row = (X.unsqueeze(-3) * (G.unsqueeze(-3) - Gref.unsqueeze(-2)).clamp(max=0).exp()).to(cd)  # [S, ..., nb(s), C, K]
    off = (row @ col.transpose(-1, -2)).movedim(-3, -2).flatten(-2, -1)  # [S, ..., C, C], column = s*c + j
    block = torch.arange(C, device=G.device) // c
    below = block[:, None] > block[None, :]  # [C, C] strictly-lower blocks
    return torch.where(below, off, full)


def pair_products(X: torch.Tensor, Kc: torch.Tensor, G: torch.Tensor, plan: Plan) -> torch.Tensor:
    """P[s, ..., t, i] = sum_k X[s,...,t,k] Kc[...,i,k] exp(G[...,t,k] - G[...,i,k]), valid for i <= t."""
    form, cd = plan.exponent_form, getattr(torch, plan.compute_dtype)
    if form == "pairwise":
        return _pairwise(X, Kc, G, cd)
    if form == "factored_chunk":
        return _factored_chunk(X, Kc, G, cd)
    return _factored_subchunk(X, Kc, G, min(plan.sub_chunk_size, G.shape[-2]), cd)


# ---- (I + A) X = R with A strictly lower triangular --------------------------------------------
def unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for strictly lower A [..., c, c], one row at a time (forward substitution)."""
    c = A.shape[-1]
    inv = torch.eye(c, dtype=A.dtype, device=A.device).expand(A.shape).clone()
    for t in range(1, c):
        inv[..., t, :t] -= (A[..., t : t + 1, :t] @ inv[..., :t, :t]).squeeze(-2)
    return inv


def _blocked_solve(A: torch.Tensor, R: torch.Tensor, c: int) -> torch.Tensor:
    """Invert the c x c diagonal blocks in one batched pass, then block forward substitution."""
    C = A.shape[-1]
    nb = C // c
    diag = torch.diagonal(A.unflatten(-2, (nb, c)).unflatten(-1, (nb, c)), dim1=-4, dim2=-2)  # [..., c, c, nb]
    dinv = unit_lower_inverse(diag.movedim(-1, -3))  # [..., nb, c, c]
    xs: list[torch.Tensor] = []
    for r in range(nb):
        rhs = R[..., r * c : (r + 1) * c, :]
        if r:
            rhs = rhs - A[..., r * c : (r + 1) * c, : r * c] @ torch.cat(xs, -2)
        xs.append(dinv[..., r, :, :] @ rhs)
    return torch.cat(xs, -2)


def solve_unit_lower(A: torch.Tensor, R: torch.Tensor, plan: Plan) -> torch.Tensor:
    if plan.intra_algorithm == "triangular_solve":
        # unitriangular=True: the (zero) diagonal of A is never read, it stands for I
        return torch.linalg.solve_triangular(A, R, upper=False, unitriangular=True)
    if plan.intra_algorithm == "forward_substitution":
        return unit_lower_inverse(A) @ R
    return _blocked_solve(A, R, min(plan.sub_chunk_size, A.shape[-1]))


# ---- intra, recurrence, output ---------------------------------------------------------------
def gated_q(q: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    return q * G.exp()  # Q * Gamma


def gated_k(k: torch.Tensor, G: torch.Tensor, gC: torch.Tensor) -> torch.Tensor:
    return k * (gC.unsqueeze(-2) - G).exp()  # K * exp(G_C - G), factors <= 1


def intra(ctx: Ctx, plan: Plan) -> Ctx:
    q, k, v, beta, G = ctx["q"], ctx["k"], ctx["v"], ctx["beta"], ctx["G"]
    P = pair_products(torch.stack((q, k)), k, G, plan)  # [2, ..., C, C]
    M = P[0].tril()  # i <= t, stays in the compute dtype for the output
    A = (P[1].float().tril(-1)) * beta.unsqueeze(-1)  # i < t
    gamma = G.exp()
    R = torch.cat((k * gamma, v), -1) * beta.unsqueeze(-1)  # [..., C, K + V]
    W, U0 = solve_unit_lower(A, R, plan).split((k.shape[-1], v.shape[-1]), -1)
    out = {"W": W, "U0": U0, "M": M}
    if plan.intermediates == "store":
        out["Qg"] = q * gamma
        out["Kd"] = gated_k(k, G, ctx["gC"])
    return out


def _chunks(ctx: Ctx, names: tuple[str, ...], BH: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per-chunk views of each named chunked tensor: [B, H, N, ...] -> N x [B*H, ...]."""
    return {name: ctx[name].reshape(BH, *ctx[name].shape[2:]).unbind(1) for name in names if name in ctx}


def _output(Qg: torch.Tensor, M: torch.Tensor, U: torch.Tensor, S: torch.Tensor, plan: Plan) -> torch.Tensor:
    """O = Qg S + M U; S is [.., K, V] (or [.., V, K] for state_layout vk)."""
    inter = Qg @ (S.transpose(-1, -2) if plan.state_layout == "vk" else S)
    return inter + (M @ U.to(M.dtype)).float()


CHUNK_NAMES = ("q", "k", "v", "beta", "G", "gC", "gammaC", "W", "U0", "M", "Qg", "Kd")


def chunk_step(c: Ctx, S: torch.Tensor, plan: Plan) -> Ctx:
    """The state update of one chunk, two fused multiply-adds (baddbmm over B*H): the next state "S"
    and the corrected values "U" = U0 - W S0 the output needs."""
    Kd = c["Kd"] if "Kd" in c else gated_k(c["k"], c["G"], c["gC"])
    if plan.state_layout == "vk":
        U = torch.baddbmm(c["U0"], c["W"], S.transpose(1, 2), alpha=-1)  # U0 - W S0: [BH, C, V]
        S_next = torch.baddbmm(S * c["gammaC"].unsqueeze(1), U.transpose(1, 2), Kd)
    else:
        U = torch.baddbmm(c["U0"], c["W"], S, alpha=-1)
        S_next = torch.baddbmm(S * c["gammaC"].unsqueeze(2), Kd.transpose(1, 2), U)
    return {"S": S_next, "U": U}


def loop_step(c: Ctx, S: torch.Tensor, plan: Plan, impl: Impl, intra_in_loop: bool, output_in_loop: bool) -> Ctx:
    """One chunk of the state loop: intra (when fused into the loop), the state update
    (impl["recurrence"]), then the chunk's output "O" (output_in_loop) or what the batched output
    pass needs ("U", plus "M"/"Qg" when intra ran here)."""
    if intra_in_loop:
        c = {**c, **impl["intra"](c, plan)}
    step = impl["recurrence"](c, S, plan)
    if output_in_loop:
        return {"S": step["S"], "O": impl["output"]({**c, "U": step["U"], "S_starts": S}, plan)["O"]}
    out = {"S": step["S"], "U": step["U"]}
    if intra_in_loop:  # the batched output pass needs what intra made inside the loop
        out["M"] = c["M"]
        if "Qg" in c:
            out["Qg"] = c["Qg"]
    return out


def recurrence(ctx: Ctx, plan: Plan, intra_in_loop: bool, output_in_loop: bool, step=None) -> Ctx:
    """The state loop over chunks. `step` is `loop_step` bound to this plan; a compiled backend
    compiles the step, so the loop is never unrolled into one graph per sequence length. Without
    output_in_loop it hands U and the per-chunk start states to one batched output pass."""
    if step is None:
        step = functools.partial(loop_step, plan=plan, impl=HAND_WRITTEN, intra_in_loop=intra_in_loop,
                                 output_in_loop=output_in_loop)
    B, H = ctx["S0"].shape[:2]
    S = ctx["S0"].reshape(B * H, *ctx["S0"].shape[2:])  # [BH, K, V] float32 ([BH, V, K] for vk)
    chunks = _chunks(ctx, CHUNK_NAMES, B * H)
    collected: dict[str, list[torch.Tensor]] = {}
    for n in range(ctx["G"].shape[2]):
        result = step({name: parts[n] for name, parts in chunks.items()}, S)
        if not output_in_loop:
            collected.setdefault("S_starts", []).append(S)
        S = result.pop("S")
        for name, value in result.items():
            collected.setdefault(name, []).append(value)
    # N x [BH, ...] -> [B, H, N, ...]
    out = {name: torch.stack(parts, 1).unflatten(0, (B, H)) for name, parts in collected.items()}
    out["S_final"] = S.unflatten(0, (B, H))
    return out


def output(ctx: Ctx, plan: Plan) -> Ctx:
    """O = Qg S + M U, batched over chunks ([B, H, N, C, V]) or for one chunk inside the loop ([BH, C, V])."""
    Qg = ctx["Qg"] if "Qg" in ctx else gated_q(ctx["q"], ctx["G"])
    return {"O": _output(Qg, ctx["M"], ctx["U"], ctx["S_starts"], plan)}


# The hand-written implementation of each stage; for the recurrence, its per-chunk state update (the
# loop driver `recurrence` and `loop_step` wrap it). An open stage's code replaces an entry (engine.build).
HAND_WRITTEN: Mapping[str, Callable] = MappingProxyType(
    {"gate": gate, "l2norm": l2norm, "intra": intra, "recurrence": chunk_step, "output": output})
