"""Triton kernels of the chunked (WY/UT) KDA forward, written here against `stages.py`'s math.

Layouts: inputs are contiguous [B, T, H, D] (read in place, no transposes); workspaces are head-major
[B*H, Tp, D] with Tp = N*C (N chunks of C tokens, the last one zero-padded by masks: g=0, beta=0 and
q=k=0 make padded tokens no-ops). Per chunk, with inclusive chunk-local cumulative log decay G:
    A[t,i] = beta_t sum_k k_t k_i exp(G_t - G_i) (i < t)    M[t,i] = sum_k q_t k_i exp(G_t - G_i) (i <= t)
    W = (I + A)^-1 diag(beta) (K * exp G)     U0 = (I + A)^-1 diag(beta) V
    U = U0 - W S     O = (Q * exp G) S + M U     S' = diag(exp G_C) S + (K * exp(G_C - G))^T U
exp(-G) over a whole chunk is never formed: pair products go by sub-chunk column blocks of SUB
tokens, each offset by G at the block's first row (row factors <= 1, column factors <= exp(5*(SUB-1))
= exp(75) at SUB=16 and g >= -5, finite in float32 and bfloat16).

Dot operands: DOT=0 float32 (ieee), 1 tf32, 2 bfloat16; accumulation is always float32. The
intra-chunk products (pair products, M U) take DOT; every product that feeds or reads the float32
state (W, U0, W S, Qg S, Kd^T U) takes SDOT, which the classic engine sets to tf32 when DOT is bfloat16
(rounding those to bfloat16 every chunk measured ~1e-2 relative error at T=200, K=V=64, with float32
workspaces); the blocked kernels take it from the gene state_operands.

Two kernel families (gene triton_kernels): classic (prepare, intra over the whole chunk and K, the
row-by-row inverse, float32 workspaces incl. Qg; kept as a choice) and blocked (below the classic
kernels: intra by 16-row blocks and K tiles with a blocked solve, workspaces in W's dtype, Qg
recomputed, K-split recurrence whose loads pipeline, output parallel over chunks), sized by their
sm_90 compile facts (`python -m evo kernels`).
Only API common to Triton 3.6 and 3.9 is used (tl.dot input_precision, tl.cumsum, tl.static_range,
triton.knobs). This file is also the seed of the open stage `code_triton` (`open_code`): it imports
only triton, and a genome's code may replace everything between the EVOLVE-BLOCK marks.
"""
from __future__ import annotations

import triton
import triton.language as tl

# EVOLVE-BLOCK-START
# Triton's interpreter (3.9) multiplies bfloat16 dot operands as their raw uint16 bits, truncates
# float32 -> bfloat16 casts (the GPU rounds to nearest even) and ignores input_precision="tf32". Under
# the interpreter, bf16 operands and stores are rounded to nearest even here, tf32 operands truncated to
# 10 mantissa bits, and both multiplied in float32: the GPU's numerics.
_EMULATE_BF16_DOT = tl.constexpr(bool(triton.knobs.runtime.interpret))  # TRITON_INTERPRET=1
SUB = 16  # sub-chunk block of the pair products (see the module docstring for why 16)
# l2norm epsilon: 1e-6, written inline in _prepare as in the reference (definition.L2NORM_EPS)


@triton.jit
def _round_bf16(x):
    """float32 rounded to the nearest bfloat16 (ties to even), still float32 (NaN/inf not handled)."""
    bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _truncate_tf32(x):
    """float32 with the low 13 mantissa bits cleared: the 10-bit mantissa tf32 tensor cores read."""
    bits = x.to(tl.float32).to(tl.uint32, bitcast=True) & 0xFFFFE000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _cast(x, ptr):
    """x in the element type of `ptr`, rounded to nearest even as on the GPU."""
    if _EMULATE_BF16_DOT:
        if ptr.dtype.element_ty == tl.bfloat16:
            x = _round_bf16(x)
    return x.to(ptr.dtype.element_ty)


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    """a @ b with float32 accumulation; operands in float32, tf32 or bfloat16."""
    if DOT == 2:
        if _EMULATE_BF16_DOT:
            out = tl.dot(_round_bf16(a), _round_bf16(b), input_precision="ieee", out_dtype=tl.float32)
        else:
            out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), out_dtype=tl.float32)
    elif DOT == 1:
        if _EMULATE_BF16_DOT:  # the interpreter ignores input_precision: truncate as the tensor cores do
            out = tl.dot(_truncate_tf32(a), _truncate_tf32(b), input_precision="ieee", out_dtype=tl.float32)
        else:
            out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32", out_dtype=tl.float32)
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)
    return out


@triton.jit
def _prepare(q, k, g, b, h, rows, cols, T, scale, H: tl.constexpr, K: tl.constexpr):
    """One chunk of q, k, g ([C, BK] float32): l2norm(q) * scale, l2norm(k), cumsum of g over the chunk."""
    off = ((b * T + rows[:, None]).to(tl.int64) * H + h) * K + cols[None, :]
    m = (rows[:, None] < T) & (cols[None, :] < K)
    qv = tl.load(q + off, mask=m, other=0.0).to(tl.float32)
    kv = tl.load(k + off, mask=m, other=0.0).to(tl.float32)
    gv = tl.load(g + off, mask=m, other=0.0).to(tl.float32)
    G = tl.cumsum(gv, axis=0)  # [C, BK] inclusive, chunk-local
    qv = qv * (scale / tl.sqrt(tl.sum(qv * qv, axis=1) + 1e-6))[:, None]
    kv = kv * (1.0 / tl.sqrt(tl.sum(kv * kv, axis=1) + 1e-6))[:, None]
    return qv, kv, G


@triton.jit
def prepare_kernel(q, k, g, qn, kn, Gw, T, Tp, scale,
                   H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """grid (N, B*H): writes qn, kn, G as float32 [B*H, Tp, K]."""
    n, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows = n * BT + tl.arange(0, BT)
    cols = tl.arange(0, BK)
    qv, kv, G = _prepare(q, k, g, b, h, rows, cols, T, scale, H, K)
    ws = (bh.to(tl.int64) * Tp + rows[:, None]) * K + cols[None, :]
    m = cols[None, :] < K
    tl.store(qn + ws, qv, mask=m)
    tl.store(kn + ws, kv, mask=m)
    tl.store(Gw + ws, G, mask=m)


@triton.jit
def _pair_products(qv, kv, G, BT: tl.constexpr, SB: tl.constexpr, DOT: tl.constexpr):
    """Pq[t,i] = sum_k q_t k_i exp(G_t - G_i), Pk likewise with k_t, valid for i <= t ([C, C] each)."""
    loc = tl.arange(0, BT)
    Pq = tl.zeros([BT, BT], dtype=tl.float32)
    Pk = tl.zeros([BT, BT], dtype=tl.float32)
    for s in tl.static_range(BT // SB):
        ref = tl.sum(tl.where(loc[:, None] == s * SB, G, 0.0), axis=0)  # [BK] G at the block's first row
        incol = (loc >= s * SB) & (loc < s * SB + SB)
        col = tl.where(incol[:, None], kv * tl.exp(tl.where(incol[:, None], ref[None, :] - G, 0.0)), 0.0)
        after = loc >= s * SB  # rows at or after the block: G_t <= ref, factors <= 1
        rowf = tl.where(after[:, None], tl.exp(tl.where(after[:, None], G - ref[None, :], 0.0)), 0.0)
        colT = tl.trans(col)
        Pq += _dot(qv * rowf, colT, DOT)
        Pk += _dot(kv * rowf, colT, DOT)
    return Pq, Pk


@triton.jit
def _unit_lower_inverse(A, BT: tl.constexpr):
    """(I + A)^-1 for strictly lower A [C, C] in float32, one row at a time (forward substitution)."""
    loc = tl.arange(0, BT)
    eye = tl.where(loc[:, None] == loc[None, :], 1.0, 0.0)
    Li = eye
    for i in range(1, BT):
        a = tl.sum(tl.where(loc[:, None] == i, A, 0.0), axis=0)  # [C] row i of A (zero from column i on)
        row = -tl.sum(a[:, None] * Li, axis=0)  # -sum_j A[i,j] Li[j,:] over finished rows j < i
        Li = tl.where(loc[:, None] == i, row[None, :] + eye, Li)
    return Li


@triton.jit
def intra_kernel(q, k, g, v, beta, qn, kn, Gw, W, U0, M, Qg, Kd, gam, T, Tp, scale,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                 BVF: tl.constexpr, SB: tl.constexpr, FUSED_PREPARE: tl.constexpr, DOT: tl.constexpr,
                 SDOT: tl.constexpr):
    """grid (N, B*H): per chunk, W, Qg, Kd [C, K], U0 [C, V] (float32), M [C, C], gam = exp(G_C) [K]."""
    n, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    loc = tl.arange(0, BT)
    rows = n * BT + loc
    cols = tl.arange(0, BK)
    cm = cols[None, :] < K
    ws = (bh.to(tl.int64) * Tp + rows[:, None]) * K + cols[None, :]  # [C, BK] into [B*H, Tp, K]
    if FUSED_PREPARE:
        qv, kv, G = _prepare(q, k, g, b, h, rows, cols, T, scale, H, K)
    else:
        qv = tl.load(qn + ws, mask=cm, other=0.0)
        kv = tl.load(kn + ws, mask=cm, other=0.0)
        G = tl.load(Gw + ws, mask=cm, other=0.0)
    bet = tl.load(beta + (b * T + rows).to(tl.int64) * H + h, mask=rows < T, other=0.0).to(tl.float32)  # [C]
    Pq, Pk = _pair_products(qv, kv, G, BT, SB, DOT)
    A = tl.where(loc[:, None] > loc[None, :], Pk, 0.0) * bet[:, None]  # strictly lower
    Mc = tl.where(loc[:, None] >= loc[None, :], Pq, 0.0)
    Li = _unit_lower_inverse(A, BT)
    gamma = tl.exp(G)  # <= 1
    Wc = _dot(Li, kv * gamma * bet[:, None], SDOT)  # [C, BK]
    cv = tl.arange(0, BVF)
    vm = (rows[:, None] < T) & (cv[None, :] < V)
    vv = tl.load(v + ((b * T + rows[:, None]).to(tl.int64) * H + h) * V + cv[None, :], mask=vm, other=0.0)
    U0c = _dot(Li, vv.to(tl.float32) * bet[:, None], SDOT)  # [C, BVF]
    gC = tl.sum(tl.where(loc[:, None] == BT - 1, G, 0.0), axis=0)  # [BK] log decay over the chunk
    tl.store(W + ws, Wc, mask=cm)
    tl.store(Qg + ws, qv * gamma, mask=cm)
    tl.store(Kd + ws, kv * tl.exp(gC[None, :] - G), mask=cm)
    tl.store(U0 + (bh.to(tl.int64) * Tp + rows[:, None]) * V + cv[None, :], U0c, mask=cv[None, :] < V)
    tl.store(M + (bh.to(tl.int64) * Tp + rows[:, None]) * BT + loc[None, :], _cast(Mc, M))
    tl.store(gam + (bh.to(tl.int64) * (Tp // BT) + n) * K + cols, tl.exp(gC), mask=cols < K)


@triton.jit
def _state_dot(X, S, STATE_VK: tl.constexpr, SDOT: tl.constexpr):
    """X [C, K] times the state as [K, BV] (S is [BV, K] when STATE_VK)."""
    if STATE_VK:
        out = _dot(X, tl.trans(S), SDOT)
    else:
        out = _dot(X, S, SDOT)
    return out


@triton.jit
def recurrence_kernel(W, U0, Kd, gam, Qg, M, h0, o, ht, Us, Ss, T, Tp, NT,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, HAS_H0: tl.constexpr, FUSED_OUTPUT: tl.constexpr,
                      STATE_VK: tl.constexpr, DOT: tl.constexpr, SDOT: tl.constexpr):
    """grid (cdiv(V, BV), B*H): the float32 state tile stays on chip across all chunks.
    FUSED_OUTPUT writes o; otherwise U [B*H, Tp, V] and each chunk's start state [B*H, NT, K, V]."""
    iv, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    loc = tl.arange(0, BT)
    ck = tl.arange(0, BK)
    cv = iv * BV + tl.arange(0, BV)
    km, vm = ck < K, cv < V
    if STATE_VK:  # state tile [BV, BK]
        s_off = (bh.to(tl.int64) * K + ck[None, :]) * V + cv[:, None]
        s_m = vm[:, None] & km[None, :]
    else:  # state tile [BK, BV]
        s_off = (bh.to(tl.int64) * K + ck[:, None]) * V + cv[None, :]
        s_m = km[:, None] & vm[None, :]
    if HAS_H0:
        S = tl.load(h0 + s_off, mask=s_m, other=0.0).to(tl.float32)
    else:
        S = tl.zeros_like(s_off.to(tl.float32))
    for n in range(NT):
        rows = n * BT + loc
        wk = (bh.to(tl.int64) * Tp + rows[:, None]) * K + ck[None, :]
        wv = (bh.to(tl.int64) * Tp + rows[:, None]) * V + cv[None, :]
        Wn = tl.load(W + wk, mask=km[None, :], other=0.0)
        Kdn = tl.load(Kd + wk, mask=km[None, :], other=0.0)
        gn = tl.load(gam + (bh.to(tl.int64) * NT + n) * K + ck, mask=km, other=0.0)
        U = tl.load(U0 + wv, mask=vm[None, :], other=0.0) - _state_dot(Wn, S, STATE_VK, SDOT)  # [C, BV]
        if FUSED_OUTPUT:
            Qgn = tl.load(Qg + wk, mask=km[None, :], other=0.0)
            Mn = tl.load(M + (bh.to(tl.int64) * Tp + rows[:, None]) * BT + loc[None, :])
            On = _state_dot(Qgn, S, STATE_VK, SDOT) + _dot(Mn, U, DOT)
            o_off = ((b * T + rows[:, None]).to(tl.int64) * H + h) * V + cv[None, :]
            tl.store(o + o_off, _cast(On, o), mask=(rows[:, None] < T) & vm[None, :])
        else:
            tl.store(Us + wv, U, mask=vm[None, :])
            tl.store(Ss + (bh.to(tl.int64) * NT + n) * K * V + (s_off - bh.to(tl.int64) * K * V), S, mask=s_m)
        if STATE_VK:
            S = S * gn[None, :] + _dot(tl.trans(U), Kdn, SDOT)  # [BV, C] x [C, BK]
        else:
            S = S * gn[:, None] + _dot(tl.trans(Kdn), U, SDOT)  # [BK, C] x [C, BV]
    tl.store(ht + s_off, S, mask=s_m)


@triton.jit
def output_kernel(Qg, M, Us, Ss, o, T, Tp, NT,
                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, STATE_VK: tl.constexpr, DOT: tl.constexpr, SDOT: tl.constexpr):
    """grid (cdiv(V, BV), N, B*H): O = Qg S_start + M U for one chunk and V tile."""
    iv, n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    loc = tl.arange(0, BT)
    ck = tl.arange(0, BK)
    cv = iv * BV + tl.arange(0, BV)
    km, vm = ck < K, cv < V
    rows = n * BT + loc
    base = (bh.to(tl.int64) * NT + n) * K * V
    if STATE_VK:
        S = tl.load(Ss + base + ck[None, :] * V + cv[:, None], mask=vm[:, None] & km[None, :], other=0.0)
    else:
        S = tl.load(Ss + base + ck[:, None] * V + cv[None, :], mask=km[:, None] & vm[None, :], other=0.0)
    Qgn = tl.load(Qg + (bh.to(tl.int64) * Tp + rows[:, None]) * K + ck[None, :], mask=km[None, :], other=0.0)
    Mn = tl.load(M + (bh.to(tl.int64) * Tp + rows[:, None]) * BT + loc[None, :])
    U = tl.load(Us + (bh.to(tl.int64) * Tp + rows[:, None]) * V + cv[None, :], mask=vm[None, :], other=0.0)
    On = _state_dot(Qgn, S, STATE_VK, SDOT) + _dot(Mn, U, DOT)
    o_off = ((b * T + rows[:, None]).to(tl.int64) * H + h) * V + cv[None, :]
    tl.store(o + o_off, _cast(On, o), mask=(rows[:, None] < T) & vm[None, :])


# ---- blocked kernels (triton_kernels="blocked"): sized to sm_90's registers, workspaces in W's dtype ----
# Intra computes row blocks of 16 tokens against the chunk's earlier columns, K in tiles of BKT, and
# solves (I + A) by blocks: each 16x16 diagonal block by forward substitution, the rest with tl.dot.
# Qg is never stored (the output recomputes it from q and g); the recurrence keeps its state in K halves
# and its chunk loop's loads do not depend on the state, so num_stages > 1 prefetches step n+1.
@triton.jit
def _row_block(q, k, g, b, h, n, T, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BKT: tl.constexpr,
               I: tl.constexpr, DOT: tl.constexpr):
    """Row block I (16 tokens) of one chunk against the chunk's columns, unnormalised and K-tiled:
    Ak [16, C] = k_t . k_s exp(G_t - G_s), Mq likewise with q_t (valid for s up to block I's end), and the
    sums of squares of q, k rows of the block [16] and of k over the chunk [C]."""
    r = I * 16 + tl.arange(0, 16)  # chunk-local rows of the block
    loc = tl.arange(0, BT)
    rows, cols = n * BT + r, n * BT + loc
    Ak = tl.zeros([16, BT], dtype=tl.float32)
    Mq = tl.zeros([16, BT], dtype=tl.float32)
    sq = tl.zeros([16], dtype=tl.float32)
    sk = tl.zeros([16], dtype=tl.float32)
    skc = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(0, K, BKT):
        ck = k0 + tl.arange(0, BKT)
        mc = (cols[:, None] < T) & (ck[None, :] < K)
        offc = ((b * T + cols[:, None]).to(tl.int64) * H + h) * K + ck[None, :]
        kc = tl.load(k + offc, mask=mc, other=0.0).to(tl.float32)  # [C, BKT]
        gc = tl.load(g + offc, mask=mc, other=0.0).to(tl.float32)
        Gc = tl.cumsum(gc, axis=0)
        mr = (rows[:, None] < T) & (ck[None, :] < K)
        offr = ((b * T + rows[:, None]).to(tl.int64) * H + h) * K + ck[None, :]
        qr = tl.load(q + offr, mask=mr, other=0.0).to(tl.float32)  # [16, BKT]
        kr = tl.load(k + offr, mask=mr, other=0.0).to(tl.float32)
        gr = tl.load(g + offr, mask=mr, other=0.0).to(tl.float32)
        carry = tl.sum(tl.where(loc[:, None] < I * 16, gc, 0.0), axis=0)  # [BKT] G before the block
        Gr = carry[None, :] + tl.cumsum(gr, axis=0)  # [16, BKT]
        ref = carry + tl.sum(tl.where(r[:, None] == I * 16, gr, 0.0), axis=0)  # G at the block's first row
        rowf = tl.exp(Gr - ref[None, :])  # <= 1
        upto = loc[:, None] < I * 16 + 16  # columns up to the block's end: exp(ref - G_s) <= exp(5 * 15)
        colT = tl.trans(tl.where(upto, kc * tl.exp(tl.where(upto, ref[None, :] - Gc, 0.0)), 0.0))  # [BKT, C]
        Ak += _dot(kr * rowf, colT, DOT)
        Mq += _dot(qr * rowf, colT, DOT)
        sq += tl.sum(qr * qr, axis=1)
        sk += tl.sum(kr * kr, axis=1)
        skc += tl.sum(kc * kc, axis=1)
    return Ak, Mq, sq, sk, skc


@triton.jit
def _diag_inverse(Arow, I: tl.constexpr, BT: tl.constexpr):
    """(I + D)^-1 of the 16x16 diagonal block D of row block I ([16, C], strictly lower), by forward
    substitution over its 16 rows."""
    NB: tl.constexpr = BT // 16
    blk = tl.arange(0, NB)
    D = tl.sum(tl.where(blk[None, :, None] == I, tl.reshape(Arow, [16, NB, 16]), 0.0), axis=1)  # [16, 16]
    return _unit_lower_inverse(D, 16)


@triton.jit
def intra_blocked_kernel(q, k, g, v, beta, W, U0, M, Kd, gam, T, Tp, scale,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                         BKT: tl.constexpr, BVT: tl.constexpr, DOT: tl.constexpr, SDOT: tl.constexpr):
    """grid (N, B*H): per chunk, W, Kd [C, K], U0 [C, V], M [C, C] in the workspaces' dtype, gam = exp(G_C) [K].
    Ai = (I + A)^-1 is built row block by row block: Ai_I = (I + D_I)^-1 (E_I - A_I,<I Ai_<I), held as
    [NB, 16, C] (a row block replaced by a `where`, read back as [C, C] by a reshape)."""
    n, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    NB: tl.constexpr = BT // 16
    loc = tl.arange(0, BT)
    r16 = tl.arange(0, 16)
    blk = tl.arange(0, NB)
    Ai3 = tl.zeros([NB, 16, BT], dtype=tl.float32)
    rkc = tl.zeros([BT], dtype=tl.float32)
    for I in tl.static_range(NB):
        Ak, Mq, sq, sk, skc = _row_block(q, k, g, b, h, n, T, H, K, BT, BKT, I, DOT)
        r = I * 16 + r16
        rows = n * BT + r
        rkc = 1.0 / tl.sqrt(skc + 1e-6)  # [C] k column norms (the same every block)
        bet = tl.load(beta + (b * T + rows).to(tl.int64) * H + h, mask=rows < T, other=0.0).to(tl.float32)
        Arow = tl.where(loc[None, :] < r[:, None], Ak * ((bet / tl.sqrt(sk + 1e-6))[:, None] * rkc[None, :]), 0.0)
        Mrow = tl.where(loc[None, :] <= r[:, None], Mq * ((scale / tl.sqrt(sq + 1e-6))[:, None] * rkc[None, :]), 0.0)
        tl.store(M + (bh.to(tl.int64) * Tp + rows[:, None]) * BT + loc[None, :], _cast(Mrow, M))
        rhs = tl.where(loc[None, :] == r[:, None], 1.0, 0.0)  # E_I: identity rows of the block
        if I > 0:
            Aoff = tl.where(loc[None, :] < I * 16, Arow, 0.0)
            rhs -= _dot(Aoff, tl.reshape(Ai3, [BT, BT]), SDOT)
        AiI = _dot(_diag_inverse(Arow, I, BT), rhs, SDOT)  # [16, C]
        Ai3 = tl.where(blk[:, None, None] == I, AiI[None, :, :], Ai3)
    Ai = tl.reshape(Ai3, [BT, BT])
    rows = n * BT + loc
    bet = tl.load(beta + (b * T + rows).to(tl.int64) * H + h, mask=rows < T, other=0.0).to(tl.float32)  # [C]
    for k0 in range(0, K, BKT):
        ck = k0 + tl.arange(0, BKT)
        m = (rows[:, None] < T) & (ck[None, :] < K)
        off = ((b * T + rows[:, None]).to(tl.int64) * H + h) * K + ck[None, :]
        kn = tl.load(k + off, mask=m, other=0.0).to(tl.float32) * rkc[:, None]
        G = tl.cumsum(tl.load(g + off, mask=m, other=0.0).to(tl.float32), axis=0)  # [C, BKT]
        gC = tl.sum(tl.where(loc[:, None] == BT - 1, G, 0.0), axis=0)  # [BKT]
        ws = (bh.to(tl.int64) * Tp + rows[:, None]) * K + ck[None, :]
        tl.store(W + ws, _cast(_dot(Ai, kn * tl.exp(G) * bet[:, None], SDOT), W), mask=ck[None, :] < K)
        tl.store(Kd + ws, _cast(kn * tl.exp(gC[None, :] - G), Kd), mask=ck[None, :] < K)
        tl.store(gam + (bh.to(tl.int64) * (Tp // BT) + n) * K + ck, tl.exp(gC), mask=ck < K)
    for v0 in range(0, V, BVT):
        cv = v0 + tl.arange(0, BVT)
        m = (rows[:, None] < T) & (cv[None, :] < V)
        vv = tl.load(v + ((b * T + rows[:, None]).to(tl.int64) * H + h) * V + cv[None, :], mask=m, other=0.0)
        U0c = _dot(Ai, vv.to(tl.float32) * bet[:, None], SDOT)
        tl.store(U0 + (bh.to(tl.int64) * Tp + rows[:, None]) * V + cv[None, :], _cast(U0c, U0), mask=cv[None, :] < V)


@triton.jit
def _gated_q(q, g, b, h, rows, T, scale, H: tl.constexpr, K: tl.constexpr, ck, rq):
    """Qg = l2norm(q) * scale * exp(G) for one chunk's rows and K columns `ck` ([C, len(ck)]), given
    rq = scale / |q| per row; G is the chunk-local cumsum of g, so `ck` spans one K range of every row."""
    m = (rows[:, None] < T) & (ck[None, :] < K)
    off = ((b * T + rows[:, None]).to(tl.int64) * H + h) * K + ck[None, :]
    G = tl.cumsum(tl.load(g + off, mask=m, other=0.0).to(tl.float32), axis=0)
    return tl.load(q + off, mask=m, other=0.0).to(tl.float32) * rq[:, None] * tl.exp(G)


@triton.jit
def _q_scale(q, b, h, rows, T, scale, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BKT: tl.constexpr):
    """scale / |q_t| for one chunk's rows [C], K in tiles."""
    ss = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(0, K, BKT):
        ck = k0 + tl.arange(0, BKT)
        m = (rows[:, None] < T) & (ck[None, :] < K)
        x = tl.load(q + ((b * T + rows[:, None]).to(tl.int64) * H + h) * K + ck[None, :], mask=m, other=0.0)
        ss += tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1)
    return scale / tl.sqrt(ss + 1e-6)


@triton.jit
def recurrence_blocked_kernel(W, U0, Kd, gam, q, g, M, h0, o, ht, Us, Ss, T, Tp, NT, scale,
                              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                              BKH: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr,
                              FUSED_OUTPUT: tl.constexpr, DOT: tl.constexpr, SDOT: tl.constexpr):
    """grid (cdiv(V, BV), B*H): the float32 state as two K halves [BKH, BV] (rows [0, BKH) and [BKH, 2 BKH)).
    Per chunk: U = U0 - W S; FUSED_OUTPUT writes o = Qg S + M U (Qg recomputed from q, g), else U and the
    chunk's start state go to Us, Ss in their dtype; S' = gam * S + Kd^T U. No load depends on the state,
    so num_stages > 1 prefetches the next chunk's. Addresses: a scalar base per program and chunk plus
    int32 offsets shared by the tensors of one layout."""
    iv, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    loc = tl.arange(0, BT)
    k0 = tl.arange(0, BKH)
    cv = iv * BV + tl.arange(0, BV)
    vm = cv < V
    ok0, ok1 = k0 < K, BKH + k0 < K
    s_off = k0[:, None] * V + cv[None, :]  # [BKH, BV] into one [K, V] state, first half; + BKH * V: second
    m0, m1 = ok0[:, None] & vm[None, :], ok1[:, None] & vm[None, :]
    state = bh.to(tl.int64) * K * V
    if HAS_H0:
        S0 = tl.load(h0 + state + s_off, mask=m0, other=0.0).to(tl.float32)
        S1 = tl.load(h0 + state + BKH * V + s_off, mask=m1, other=0.0).to(tl.float32)
    else:
        S0 = tl.zeros([BKH, BV], dtype=tl.float32)
        S1 = tl.zeros([BKH, BV], dtype=tl.float32)
    wk_off = loc[:, None] * K + k0[None, :]  # [C, BKH] into a chunk's [C, K] rows
    wv_off = loc[:, None] * V + cv[None, :]  # [C, BV] into a chunk's [C, V] rows
    for n in range(NT):
        chunk = bh.to(tl.int64) * Tp + n * BT  # first workspace row of the chunk
        W0 = tl.load(W + chunk * K + wk_off, mask=ok0[None, :], other=0.0)
        W1 = tl.load(W + chunk * K + BKH + wk_off, mask=ok1[None, :], other=0.0)
        Kd0 = tl.load(Kd + chunk * K + wk_off, mask=ok0[None, :], other=0.0)
        Kd1 = tl.load(Kd + chunk * K + BKH + wk_off, mask=ok1[None, :], other=0.0)
        gbase = (bh.to(tl.int64) * NT + n) * K
        g0 = tl.load(gam + gbase + k0, mask=ok0, other=0.0)
        g1 = tl.load(gam + gbase + BKH + k0, mask=ok1, other=0.0)
        U = tl.load(U0 + chunk * V + wv_off, mask=vm[None, :], other=0.0).to(tl.float32)
        U = U - _dot(W0, S0, SDOT) - _dot(W1, S1, SDOT)  # [C, BV]
        if FUSED_OUTPUT:
            rows = n * BT + loc
            rq = _q_scale(q, b, h, rows, T, scale, H, K, BT, BKH)
            Mn = tl.load(M + chunk * BT + loc[:, None] * BT + loc[None, :])
            On = (_dot(_gated_q(q, g, b, h, rows, T, scale, H, K, k0, rq), S0, SDOT)
                  + _dot(_gated_q(q, g, b, h, rows, T, scale, H, K, BKH + k0, rq), S1, SDOT) + _dot(Mn, U, DOT))
            o_off = ((b * T + rows[:, None]).to(tl.int64) * H + h) * V + cv[None, :]
            tl.store(o + o_off, _cast(On, o), mask=(rows[:, None] < T) & vm[None, :])
        else:
            tl.store(Us + chunk * V + wv_off, _cast(U, Us), mask=vm[None, :])
            start = (bh.to(tl.int64) * NT + n) * K * V  # this chunk's start state in Ss
            tl.store(Ss + start + s_off, _cast(S0, Ss), mask=m0)
            tl.store(Ss + start + BKH * V + s_off, _cast(S1, Ss), mask=m1)
        S0 = S0 * g0[:, None] + _dot(tl.trans(Kd0), U, SDOT)  # [BKH, C] x [C, BV]
        S1 = S1 * g1[:, None] + _dot(tl.trans(Kd1), U, SDOT)
    tl.store(ht + state + s_off, S0, mask=m0)
    tl.store(ht + state + BKH * V + s_off, S1, mask=m1)


@triton.jit
def output_blocked_kernel(q, g, M, Us, Ss, o, T, Tp, NT, scale,
                          H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                          BKT: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr, SDOT: tl.constexpr):
    """grid (N, B*H), every program independent: O = Qg S_start + M U for one chunk, V in tiles of BV and
    K in tiles of BKT, Qg recomputed from q and g (re-read per V tile from cache: HBM sees one read)."""
    n, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    loc = tl.arange(0, BT)
    rows = n * BT + loc
    rq = _q_scale(q, b, h, rows, T, scale, H, K, BT, BKT)
    Mn = tl.load(M + (bh.to(tl.int64) * Tp + rows[:, None]) * BT + loc[None, :])
    base = (bh.to(tl.int64) * NT + n) * K * V
    for v0 in range(0, V, BV):
        cv = v0 + tl.arange(0, BV)
        vm = cv < V
        U = tl.load(Us + (bh.to(tl.int64) * Tp + rows[:, None]) * V + cv[None, :], mask=vm[None, :], other=0.0)
        On = _dot(Mn, U, DOT)
        for k0 in range(0, K, BKT):
            ck = k0 + tl.arange(0, BKT)
            S = tl.load(Ss + base + ck[:, None] * V + cv[None, :], mask=(ck[:, None] < K) & vm[None, :], other=0.0)
            On += _dot(_gated_q(q, g, b, h, rows, T, scale, H, K, ck, rq), S, SDOT)
        o_off = ((b * T + rows[:, None]).to(tl.int64) * H + h) * V + cv[None, :]
        tl.store(o + o_off, _cast(On, o), mask=(rows[:, None] < T) & vm[None, :])
# EVOLVE-BLOCK-END
