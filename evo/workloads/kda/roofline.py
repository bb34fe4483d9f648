"""The preset's floor: matmul FLOPs of the chunked algorithm at its cheapest chunk size, and the
bytes of reading every input once and writing every output once."""
from __future__ import annotations

from evo.workloads.base import MachineRates, Preset, Roofline

CHUNK_SIZES = (16, 32, 64, 128)
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def chunk_flops(T: int, K: int, V: int, C: int) -> float:
    """Matmul FLOPs per (batch, head) of the chunked form, triangular halves counted once."""
    n_chunks = -(-T // C)
    per_chunk = (
        2 * C * C * K / 2 * 2  # A and M: lower triangles of two [C,K]x[K,C] products
        + C**3 / 3  # inverse of the unit lower triangle
        + C * C * (K + V)  # applying it to the K+V right-hand sides (triangular)
        + 3 * 2 * C * K * V  # W S0, (K exp)^T U, (Q Gamma) S0
        + C * C * V  # M U (triangular)
    )
    return n_chunks * per_chunk


def roofline(preset: Preset, rates: MachineRates) -> Roofline:
    s = preset.shape
    B, T, H, K, V = s["B"], s["T"], s["H"], s["K"], s["V"]
    flops = B * H * min(chunk_flops(T, K, V, C) for C in CHUNK_SIZES)
    item = _ITEMSIZE[preset.dtype]
    read = B * T * H * (3 * K + V + 1) * item + B * H * K * V * 4  # q, k, g, v, beta, initial state
    write = B * T * H * V * item + B * H * K * V * 4  # o, final state
    return Roofline(flops=float(flops), bytes=float(read + write), rates=rates)
