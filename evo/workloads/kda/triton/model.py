"""A first-order time model of the Triton kernels: HBM bytes each launch moves and the matmul FLOPs it
runs, per dot precision, at a shape; time = max(bytes / bandwidth, flops / rate) per launch, and for the
recurrence at least its sequential chain (chunk steps one after another, one program's products at one
SM's share of the rate, plus an HBM latency per step when nothing is prefetched, num_stages=1); a grid
of fewer programs than SMs gets that share of the bandwidth and rates.

It counts what each kernel reads and writes once per program that reads it (W and Kd once per V tile of
the recurrence), assumes perfect overlap within a launch, ignores caches beyond one program's own data,
and knows nothing of registers or spills (see `compiled`): a ranking aid, not a timer.
"""
from __future__ import annotations

from dataclasses import dataclass

from evo.workloads.kda.triton.engine import DOT_CODES, TritonPlan

# H200 figures measured 2026-11-30 (/work/shared/ENVIRONMENT.md), declared once
HBM_BYTES_PER_S = 4.1e12  # device copy, bytes read + written
DOT_FLOPS_PER_S = {"bfloat16": 773e12, "tfloat32": 434e12, "float32": 50.7e12}  # matmul, by operand precision
SMS = 132  # streaming multiprocessors of an H200
HBM_LATENCY_S = 0.7e-6  # one dependent global load, not hidden when a loop is not pipelined
LAUNCH_S = 3e-6  # one kernel launch, back to back on a stream
PRECISION = {code: name for name, code in DOT_CODES.items()}  # DOT / SDOT code -> precision


@dataclass(frozen=True)
class Modelled:
    """One launch under the model: HBM bytes, FLOPs by precision, and the modelled time (s)."""

    hbm_bytes: float
    flops: dict
    seconds: float


def _time(nbytes: float, flops: dict, programs: int, chain_s: float = 0.0) -> float:
    """Launch overhead plus the slowest of memory, compute and the sequential chain; a grid of fewer
    programs than SMs gets only that share of the bandwidth and of the rates."""
    share = min(1.0, programs / SMS)
    compute = sum(f / DOT_FLOPS_PER_S[p] for p, f in flops.items()) / share
    return LAUNCH_S + max(nbytes / (HBM_BYTES_PER_S * share), compute, chain_s)


def _add(flops: dict, precision: str, amount: float) -> None:
    flops[precision] = flops.get(precision, 0.0) + amount


def model_launch(name: str, grid: tuple[int, ...], kw: dict, plan: TritonPlan, shape: dict,
                 in_bytes: int) -> Modelled:
    """The model of one recorded launch (`compiled.Launch`: its kernel name, grid and keywords)."""
    B, T, H, K, V = (shape[a] for a in ("B", "T", "H", "K", "V"))
    C = plan.chunk_size
    N = -(-T // C)
    BH, Tp = B * H, N * C
    vt = grid[0] if name.startswith("recurrence") or name == "output_kernel" else 1  # programs per head and chunk
    BV = -(-V // vt)
    ws = 2 if plan.workspace_dtype == "bfloat16" and plan.kernels == "blocked" else 4
    mb = 2 if plan.compute_dtype == "bfloat16" else 4  # M's dtype
    dot, sdot = PRECISION[kw.get("DOT", 0)], PRECISION[kw.get("SDOT", 0)]
    tok_k, tok_v = B * T * H * K * in_bytes, B * T * H * V * in_bytes  # one input [B, T, H, K] / [..., V]
    wk, wv, m_ws = BH * Tp * K, BH * Tp * V, BH * Tp * C * mb  # workspace elements / M bytes
    states, state_io = BH * N * K * V, BH * K * V * 4
    flops: dict = {}
    chain = 0.0
    if name == "prepare_kernel":
        nbytes = 3 * tok_k + 3 * wk * 4
    elif name == "intra_kernel":
        reads = 3 * tok_k if kw["FUSED_PREPARE"] else 3 * wk * 4
        nbytes = reads + tok_v + B * T * H * in_bytes + 3 * wk * 4 + wv * 4 + m_ws + BH * N * K * 4
        _add(flops, dot, BH * N * (C // kw["SB"]) * 2 * 2 * C * C * K)  # full [C, C] products per sub-block
        _add(flops, "float32", BH * N * 2 * C**3)  # row-by-row inverse (elementwise)
        _add(flops, sdot, BH * N * 2 * C * C * (K + V))
    elif name == "intra_blocked_kernel":
        nbytes = 3 * tok_k + tok_v + B * T * H * in_bytes + 2 * wk * ws + wv * ws + m_ws + BH * N * K * 4
        _add(flops, dot, BH * N * 2 * 2 * C * C * K)  # row blocks x the chunk's columns, A and M
        _add(flops, sdot, BH * N * (C // 16) * 2 * (16 * C * C + 16 * 16 * C))  # block solve
        _add(flops, sdot, BH * N * 2 * C * C * (K + V))  # W, U0
    elif name in ("recurrence_kernel", "recurrence_blocked_kernel"):
        blocked = name == "recurrence_blocked_kernel"
        wsb = ws if blocked else 4
        fused = kw["FUSED_OUTPUT"]
        nbytes = vt * 2 * wk * wsb + wv * wsb + vt * BH * N * K * 4 + 2 * state_io
        if fused:
            qg = 2 * tok_k if blocked else wk * 4  # q and g (Qg recomputed) or the stored Qg
            nbytes += vt * (qg + m_ws) + tok_v
        else:
            nbytes += wv * wsb + states * wsb
        step = 2 * 2 * C * K * BV + (2 * C * K * BV if fused else 0)
        _add(flops, sdot, BH * vt * N * step)
        if fused:
            _add(flops, dot, BH * vt * N * 2 * C * C * BV)
        step_s = step / (DOT_FLOPS_PER_S[sdot] / SMS) + (HBM_LATENCY_S if plan.num_stages == 1 else 0.0)
        chain = N * step_s * max(1.0, vt * BH / SMS)
    elif name in ("output_kernel", "output_blocked_kernel"):
        blocked = name == "output_blocked_kernel"
        wsb = ws if blocked else 4
        qg = 2 * tok_k if blocked else wk * 4
        nbytes = states * wsb + vt * (qg + m_ws) + wv * wsb + tok_v
        _add(flops, sdot, BH * vt * N * 2 * C * K * BV)
        _add(flops, dot, BH * vt * N * 2 * C * C * BV)
    else:
        raise ValueError(f"no model of kernel {name!r}; modelled: prepare, intra, intra_blocked, recurrence,"
                         " recurrence_blocked, output, output_blocked")
    programs = 1
    for size in grid:
        programs *= size
    return Modelled(float(nbytes), flops, _time(nbytes, flops, programs, chain))
