"""The preset's floor: prefill at the matmul rate, each decode step at the bandwidth.

Prefill: the FLOPs of P positions through every layer (attention over the causal prefix) and the LM
head of the last position, or the weights read once, whichever takes longer. Decode step i: the
weights read once (the embedding table excepted: one row a token) plus the KV cache of P+i positions,
at the bandwidth, or its FLOPs at the matmul rate, whichever takes longer. The floor is their sum.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from evo.workloads.base import MachineRates, Roofline
from evo.workloads.llama.model import LlamaPreset

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Breakdown:
    """The floor's parts, seconds: prefill and all decode steps, and per decoded token."""

    prefill_s: float
    decode_s: float
    per_token_s: float
    decode_bytes: float
    prefill_flops: float


@dataclass(frozen=True)
class LlamaRoofline(Roofline):
    """A roofline whose floor is the sum of the prefill's and the decode steps' floors (not one max)."""

    floor_s: float = field(default=0.0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "floor_ms", self.floor_s * 1e3)


def breakdown(preset: LlamaPreset, rates: MachineRates) -> Breakdown:
    m, s = preset.model, preset.shape
    B, P, N = s["B"], s["P"], s["N"]
    item = _ITEMSIZE[preset.dtype]
    D, d, L = m.hidden, m.head_dim, m.layers
    per_token = 2 * (m.parameters(with_embedding=False) - m.vocab * D)  # matmul FLOPs a token, without the head
    head = 2 * D * m.vocab
    weight_bytes = m.parameters(with_embedding=False) * item  # layers, final norm and the head (tied or not)
    attn = lambda positions: 2 * 2 * L * m.heads * d * positions  # noqa: E731 - QK^T and PV of one query
    prefill_flops = B * (P * per_token + attn(P * (P + 1) / 2) + head)
    prefill_s = max(prefill_flops / rates.flops_per_s, weight_bytes / rates.bytes_per_s)
    decode_s, decode_bytes = 0.0, 0.0
    for i in range(N):
        kv = B * L * 2 * m.kv_heads * d * (P + i + 1) * item
        flops = B * (per_token + attn(P + i + 1) + head)
        decode_bytes += weight_bytes + kv
        decode_s += max((weight_bytes + kv) / rates.bytes_per_s, flops / rates.flops_per_s)
    return Breakdown(prefill_s, decode_s, decode_s / N if N else 0.0, decode_bytes, prefill_flops)


def roofline(preset: LlamaPreset, rates: MachineRates) -> Roofline:
    b = breakdown(preset, rates)
    return LlamaRoofline(flops=b.prefill_flops, bytes=b.decode_bytes, rates=rates, floor_s=b.prefill_s + b.decode_s)
