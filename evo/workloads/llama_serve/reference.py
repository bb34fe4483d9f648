"""The float64 oracle of a generation engine's own tokens: the Llama model (`evo.workloads.llama.model`)
teacher-forced over a request's prompt and the tokens the engine produced, as plain as the math: every
position's causal attention in one masked softmax, float64 throughout. Judge-only: an engine's process
never loads it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from evo.workloads.llama.model import ModelSpec, inv_freq, layer_weights, lm_head
from evo.workloads.llama.reference import float64_weights


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rotate(x: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """x [T, H, d] rotated at position t by angle t * freq on Llama's pairs (i, i + d/2)."""
    angle = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * freq  # [T, d/2]
    cos, sin = torch.cos(angle)[:, None], torch.sin(angle)[:, None]
    a, b = x[..., : freq.numel()], x[..., freq.numel():]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


def continuation_logits(spec: ModelSpec, prompt: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
    """Float64 logits [len(tokens), V]: row i predicts tokens[i] from the prompt and tokens[:i]."""
    w = float64_weights(spec)
    ids = torch.tensor([*prompt, *tokens[:-1]], dtype=torch.long)
    T, H, KVH, d = ids.numel(), spec.heads, spec.kv_heads, spec.head_dim
    freq = inv_freq(spec)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    x = w["model.embed_tokens.weight"][ids]  # [T, D]
    with torch.inference_mode():
        for i in range(spec.layers):
            lw = layer_weights(w, i)
            h = _rmsnorm(x, lw["input_norm"], spec.rms_eps)
            q = _rotate((h @ lw["q"].T).view(T, H, d), freq).transpose(0, 1)  # [H, T, d]
            k = _rotate((h @ lw["k"].T).view(T, KVH, d), freq).repeat_interleave(spec.groups, 1).transpose(0, 1)
            v = (h @ lw["v"].T).view(T, KVH, d).repeat_interleave(spec.groups, 1).transpose(0, 1)
            scores = (q @ k.transpose(-1, -2) / d**0.5).masked_fill(~causal, float("-inf"))
            x = x + (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, H * d) @ lw["o"].T
            h = _rmsnorm(x, lw["post_norm"], spec.rms_eps)
            x = x + (torch.nn.functional.silu(h @ lw["gate"].T) * (h @ lw["up"].T)) @ lw["down"].T
        x = _rmsnorm(x[len(prompt) - 1:], w["model.norm.weight"], spec.rms_eps)
        return (x @ lm_head(w).T).numpy()
