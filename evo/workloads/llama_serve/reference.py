"""The float64 oracle of a generation engine's own tokens: the Llama model (`evo.workloads.llama.model`)
teacher-forced over a request's prompt and the tokens the engine produced, as plain as the math: every
position's causal attention in one masked softmax, float64 throughout. Judge-only: an engine's process
never loads it.

The same computation runs at a lower `Precision` too (`Workload.honest_logits`: an honest execution at that
precision, which calibrates the accuracy contract's budget): weights and activations in its `act` dtype, and
in its `wide` one (float32) what the Llama engine keeps wider at a bfloat16 weight_dtype: the RMSNorm (its
`norm` stage normalises in float32), the rotary angles (cos and sin rounded to `act` after), attention scores
and softmax (SDPA's kernels accumulate them in float32; the probabilities meet v in `act`). The oracle is the
float64 precision, whose every conversion is a no-op.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from evo.workloads.llama.model import ModelSpec, inv_freq, layer_weights, lm_head, load_weights
from evo.workloads.llama.reference import float64_weights

DTYPES = ("float64", "float32", "bfloat16", "float16")  # what a Precision may be named


@dataclass(frozen=True)
class Precision:
    """The dtypes of one execution, named by its `act` dtype: `act` for weights and activations, `wide` for what
    a real engine at that precision keeps in float32 (which parts: each reference's module says). The oracle:
    float64 for both."""

    name: str
    act: torch.dtype
    wide: torch.dtype

    @classmethod
    def named(cls, dtype: str) -> Precision:
        """By name: float64 (the oracle), or float32, bfloat16, float16 with float32 kept wide."""
        if dtype not in DTYPES:
            raise ValueError(f"precision {dtype!r} is not one of {', '.join(DTYPES)}")
        return cls(dtype, getattr(torch, dtype), torch.float64 if dtype == "float64" else torch.float32)


FLOAT64 = Precision.named("float64")


@functools.lru_cache(maxsize=2)
def _rounded_weights(spec: ModelSpec, dtype: str) -> dict[str, torch.Tensor]:
    """The model's weights in `dtype` (not float64), converted once per judge process (the last two kept)."""
    return {name: w.to(getattr(torch, dtype)) for name, w in load_weights(spec).items()}


def weights_in(spec: ModelSpec, precision: Precision) -> dict[str, torch.Tensor]:
    """The model's weights in the precision's `act` dtype: the oracle's float64 ones, or rounded from storage."""
    if precision.act == torch.float64:
        return float64_weights(spec)
    return _rounded_weights(spec, precision.name)


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, p: Precision = FLOAT64) -> torch.Tensor:
    x, w = x.to(p.wide), w.to(p.wide)
    return (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w).to(p.act)


def _rotate(x: torch.Tensor, freq: torch.Tensor, p: Precision = FLOAT64) -> torch.Tensor:
    """x [T, H, d] rotated at position t by angle t * freq on Llama's pairs (i, i + d/2)."""
    angle = torch.arange(x.shape[0], dtype=p.wide)[:, None] * freq.to(p.wide)  # [T, d/2]
    cos, sin = torch.cos(angle)[:, None].to(p.act), torch.sin(angle)[:, None].to(p.act)
    a, b = x[..., : freq.numel()], x[..., freq.numel():]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


def continuation_logits(spec: ModelSpec, prompt: Sequence[int], tokens: Sequence[int],
                        dtype: str = "float64") -> np.ndarray:
    """Float64 logits [len(tokens), V]: row i predicts tokens[i] from the prompt and tokens[:i]; computed in
    `dtype` (a `Precision`'s name; the oracle: float64), returned as float64 numbers."""
    p = Precision.named(dtype)
    w = weights_in(spec, p)
    ids = torch.tensor([*prompt, *tokens[:-1]], dtype=torch.long)
    T, H, KVH, d = ids.numel(), spec.heads, spec.kv_heads, spec.head_dim
    freq = inv_freq(spec)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    x = w["model.embed_tokens.weight"][ids]  # [T, D]
    with torch.inference_mode():
        for i in range(spec.layers):
            lw = layer_weights(w, i)
            h = _rmsnorm(x, lw["input_norm"], spec.rms_eps, p)
            q = _rotate((h @ lw["q"].T).view(T, H, d), freq, p).transpose(0, 1)  # [H, T, d]
            k = _rotate((h @ lw["k"].T).view(T, KVH, d), freq, p).repeat_interleave(spec.groups, 1).transpose(0, 1)
            v = (h @ lw["v"].T).view(T, KVH, d).repeat_interleave(spec.groups, 1).transpose(0, 1)
            scores = (q.to(p.wide) @ k.to(p.wide).transpose(-1, -2) / d**0.5).masked_fill(~causal, float("-inf"))
            x = x + (scores.softmax(-1).to(p.act) @ v).transpose(0, 1).reshape(T, H * d) @ lw["o"].T
            h = _rmsnorm(x, lw["post_norm"], spec.rms_eps, p)
            x = x + (torch.nn.functional.silu(h @ lw["gate"].T) * (h @ lw["up"].T)) @ lw["down"].T
        x = _rmsnorm(x[len(prompt) - 1:], w["model.norm.weight"], spec.rms_eps, p)
        return (x @ lm_head(w).T).to(torch.float64).numpy()
