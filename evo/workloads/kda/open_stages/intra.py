"""Open stage `intra` of the chunked KDA forward: the intra-chunk matrices and the (I + A) solve.

Entry point: intra(ctx, plan) -> dict. Everything is float32 unless said otherwise.
  ctx["q"], ctx["k"]  [..., C, K]  l2-normalised (q also scaled by K**-0.5)
  ctx["v"]            [..., C, V]
  ctx["beta"]         [..., C]     in (0, 1)
  ctx["G"]            [..., C, K]  inclusive chunk-local cumulative log decay (<= 0, falling along C)
  ctx["gC"]           [..., K]     G at the chunk's last token
The leading dims "..." are [B, H, N] (all chunks at once) when intra is its own stage, and [B*H] (one
chunk) when it runs inside the state loop (fuse_intra_recurrence): touch only the trailing dims.
  plan: a frozen dataclass of the genome's decisions; read its attributes, never import it:
    chunk_size C, sub_chunk_size c (divides C), intra_algorithm ("blocked_inverse",
    "forward_substitution", "triangular_solve"), exponent_form ("factored_subchunk", "pairwise",
    "factored_chunk"), compute_dtype ("float32" or "bfloat16": the matmul operand dtype),
    intermediates ("store" or "recompute").
Returns, with Gamma = exp(G):
  "W"  [..., C, K] = (I + A)^-1 diag(beta) (K * Gamma)
  "U0" [..., C, V] = (I + A)^-1 diag(beta) V
  "M"  [..., C, C] in the compute dtype: M[t, i] = sum_k q_t k_i exp(G_t - G_i) for i <= t, else 0
  and, when plan.intermediates == "store", "Qg" = q * Gamma and "Kd" = k * exp(gC - G) (both [..., C, K]),
  where A[t, i] = beta_t sum_k k_t k_i exp(G_t - G_i) for i < t, else 0 (strictly lower triangular).
Numerics: under strong decay G_t - G_i reaches -5 C; exp(-G) alone overflows float32 past 88. The
engine must match a float64 reference to ~1e-5 relative. Imports allowed: torch, math, numpy.
"""
import torch

# EVOLVE-BLOCK-START
# ---- pair products P[s, ..., t, i] = sum_k X[s, ..., t, k] Kc[..., i, k] exp(G[..., t, k] - G[..., i, k]) (i <= t)
def _pairwise(X, Kc, G, cd):
    C = G.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=G.device).tril()
    D = G.unsqueeze(-2) - G.unsqueeze(-3)  # [..., C(t), C(i), K]; > 0 above the diagonal
    E = D.masked_fill(~causal[:, :, None], float("-inf")).exp()
    EK = (E * Kc.unsqueeze(-3)).to(cd)  # [..., t, i, K]
    return (X.to(cd).unsqueeze(-2) @ EK.transpose(-1, -2)).squeeze(-2)  # [S, ..., C, C]


def _factored_chunk(X, Kc, G, cd):
    # exp(-G) overflows once G < -88 (float32): under strong decay this form gives inf/NaN
    return (X * G.exp()).to(cd) @ (Kc * (-G).exp()).to(cd).transpose(-1, -2)


def _factored_subchunk(X, Kc, G, c, cd):
    # Blocks of c tokens. Off-diagonal block (r, s < r): offset G at the last row of block s, so both
    # factors are <= 1. Diagonal blocks: offset G at the block's middle row (finite for c <= 32).
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
    # rows in blocks <= s would get positive exponents; the clamp keeps them finite, they are masked below
    row = (X.unsqueeze(-3) * (G.unsqueeze(-3) - Gref.unsqueeze(-2)).clamp(max=0).exp()).to(cd)  # [S, ..., nb, C, K]
    off = (row @ col.transpose(-1, -2)).movedim(-3, -2).flatten(-2, -1)  # [S, ..., C, C], column = s*c + j
    block = torch.arange(C, device=G.device) // c
    below = block[:, None] > block[None, :]  # [C, C] strictly-lower blocks
    return torch.where(below, off, full)


def pair_products(X, Kc, G, plan):
    cd = getattr(torch, plan.compute_dtype)
    if plan.exponent_form == "pairwise":
        return _pairwise(X, Kc, G, cd)
    if plan.exponent_form == "factored_chunk":
        return _factored_chunk(X, Kc, G, cd)
    return _factored_subchunk(X, Kc, G, min(plan.sub_chunk_size, G.shape[-2]), cd)


# ---- (I + A) X = R with A strictly lower triangular
def unit_lower_inverse(A):
    """(I + A)^-1 for strictly lower A [..., c, c], one row at a time (forward substitution)."""
    c = A.shape[-1]
    inv = torch.eye(c, dtype=A.dtype, device=A.device).expand(A.shape).clone()
    for t in range(1, c):
        inv[..., t, :t] -= (A[..., t : t + 1, :t] @ inv[..., :t, :t]).squeeze(-2)
    return inv


def _blocked_solve(A, R, c):
    """Invert the c x c diagonal blocks in one batched pass, then block forward substitution."""
    C = A.shape[-1]
    nb = C // c
    diag = torch.diagonal(A.unflatten(-2, (nb, c)).unflatten(-1, (nb, c)), dim1=-4, dim2=-2)  # [..., c, c, nb]
    dinv = unit_lower_inverse(diag.movedim(-1, -3))  # [..., nb, c, c]
    xs = []
    for r in range(nb):
        rhs = R[..., r * c : (r + 1) * c, :]
        if r:
            rhs = rhs - A[..., r * c : (r + 1) * c, : r * c] @ torch.cat(xs, -2)
        xs.append(dinv[..., r, :, :] @ rhs)
    return torch.cat(xs, -2)


def solve_unit_lower(A, R, plan):
    if plan.intra_algorithm == "triangular_solve":
        # unitriangular=True: the (zero) diagonal of A is never read, it stands for I
        return torch.linalg.solve_triangular(A, R, upper=False, unitriangular=True)
    if plan.intra_algorithm == "forward_substitution":
        return unit_lower_inverse(A) @ R
    return _blocked_solve(A, R, min(plan.sub_chunk_size, A.shape[-1]))
# EVOLVE-BLOCK-END


def intra(ctx, plan):
    # EVOLVE-BLOCK-START
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
        out["Kd"] = k * (ctx["gC"].unsqueeze(-2) - G).exp()  # factors <= 1
    return out
    # EVOLVE-BLOCK-END
