"""The Llama oracle: float64, layer by layer, each position's attention in its own step, as plain as the math.

For each layer, with x the residual stream [B, T, D] of every position (prompt, then continuation):
    h = rmsnorm(x) * w_in ;  q, k, v = h Wq^T, h Wk^T, h Wv^T  (per head; rotary at its position on q, k)
    for each position t:  a_t = softmax(q_t k_{0..t}^T / sqrt(d)) v_{0..t}  (each query head reads its
    group's KV head)
    x = x + a Wo^T ;  x = x + (silu(h' Wg^T) * h' Wu^T) Wd^T  with h' = rmsnorm(x) * w_post
logits_t = rmsnorm(x_t) * w_final W_head^T, kept for the last prompt position and every decode step.
"""
from __future__ import annotations

import functools

import torch

from evo.workloads.llama.model import ModelSpec, inv_freq, layer_weights, lm_head, load_weights


@functools.lru_cache(maxsize=2)
def float64_weights(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The model's weights in float64, loaded once per judge process (the last two models kept)."""
    return {name: w.to(torch.float64) for name, w in load_weights(spec).items()}


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rotate(x: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, d] rotated at each position t by angle t * freq on the pairs (i, i + d/2)
    (Llama's half-split rotary)."""
    angle = torch.arange(x.shape[1], dtype=freq.dtype)[:, None] * freq  # [T, d/2]
    cos, sin = torch.cos(angle)[:, None], torch.sin(angle)[:, None]  # [T, 1, d/2]
    a, b = x[..., : freq.numel()], x[..., freq.numel():]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


def generate(spec: ModelSpec, prompt: torch.Tensor, continuation: torch.Tensor) -> torch.Tensor:
    """Float64 logits [B, N+1, V]: of the last prompt position, then of each continuation token."""
    w = float64_weights(spec)
    device = prompt.device
    P = prompt.shape[1]
    tokens = torch.cat([prompt, continuation], 1).cpu()  # [B, T]
    B, T = tokens.shape
    H, KVH, d = spec.heads, spec.kv_heads, spec.head_dim
    freq = inv_freq(spec)
    x = w["model.embed_tokens.weight"][tokens]  # [B, T, D]
    for i in range(spec.layers):
        lw = layer_weights(w, i)
        h = _rmsnorm(x, lw["input_norm"], spec.rms_eps)
        q = _rotate((h @ lw["q"].T).view(B, T, H, d), freq)
        k = _rotate((h @ lw["k"].T).view(B, T, KVH, d), freq).repeat_interleave(spec.groups, 2)  # [B, T, H, d]
        v = (h @ lw["v"].T).view(B, T, KVH, d).repeat_interleave(spec.groups, 2)
        q, k, v = (z.transpose(1, 2).contiguous() for z in (q, k, v))  # [B, H, T, d]
        attn = torch.empty_like(q)
        for t in range(T):  # position t reads positions 0..t
            scores = q[:, :, t, None] @ k[:, :, : t + 1].transpose(-1, -2) / d**0.5  # [B, H, 1, t+1]
            attn[:, :, t] = (scores.softmax(-1) @ v[:, :, : t + 1])[:, :, 0]
        attn = attn.transpose(1, 2)  # [B, T, H, d]
        x = x + attn.reshape(B, T, H * d) @ lw["o"].T
        h = _rmsnorm(x, lw["post_norm"], spec.rms_eps)
        x = x + (torch.nn.functional.silu(h @ lw["gate"].T) * (h @ lw["up"].T)) @ lw["down"].T
    x = _rmsnorm(x[:, P - 1:], w["model.norm.weight"], spec.rms_eps)
    return (x @ lm_head(w).T).to(device)  # [B, N+1, V]
