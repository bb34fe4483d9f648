"""Baselines a user would pick, timed in the same run: transformers' LlamaForCausalLM with the same
weights (eager and SDPA attention; on CUDA a static cache with torch.compile), when transformers is
importable, and `eager_ours`, a plain eager implementation of our own.

Each runs one generation as the engines do: the prompt prefilled into a cache, then one forward per
continuation token against that cache (teacher forcing), the logits of the last prompt position and of
every step returned as float32 [B, N+1, V]. Weights are loaded in the baseline's own process.
"""
from __future__ import annotations

import importlib.util
from typing import Callable

import torch
import torch.nn.functional as F

from evo.workloads.base import DeviceInfo, Engine
from evo.workloads.llama.model import LlamaPreset, ModelSpec, inv_freq, layer_weights, lm_head, load_weights


def transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


class _Transformers:
    """transformers' LlamaForCausalLM on our weights: prefill with a cache, then one token per forward."""

    def __init__(self, preset: LlamaPreset, device: DeviceInfo, attn: str, static: bool = False) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.num_threads = device.threads if device.kind == "cpu" else None
        self.device = torch.device(device.kind)
        config = LlamaConfig(**preset.model.hf_config())
        config._attn_implementation = attn
        dtype = getattr(torch, preset.dtype)
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        weights = {k: v.to(dtype) for k, v in load_weights(preset.model).items()}
        if preset.model.tie_embeddings:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        model.load_state_dict(weights, assign=True, strict=False)
        model.model.rotary_emb = LlamaRotaryEmbedding(config)  # its buffers were made on the meta device
        self.model = model.to(self.device).eval()
        self.config, self.static = config, static
        self.forward = torch.compile(self.model.forward, mode="reduce-overhead") if static else self.model.forward

    def _cache(self, B: int, L: int):
        from transformers import DynamicCache, StaticCache

        if self.static:
            return StaticCache(config=self.config, max_cache_len=L)
        return DynamicCache(config=self.config)

    def __call__(self, prompt: torch.Tensor, continuation: torch.Tensor) -> dict:
        B, P = prompt.shape
        N = continuation.shape[1]
        with torch.inference_mode():
            cache = self._cache(B, P + N)
            out = self.forward(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
            logits = [out.logits[:, -1].float()]
            for i in range(N):
                out = self.forward(input_ids=continuation[:, i:i + 1], cache=cache, use_cache=True)
                logits.append(out.logits[:, -1].float())
            return {"logits": torch.stack(logits, 1)}


class _EagerOurs:
    """The plainest eager decoder of our own: separate projections, a cache grown by concatenation,
    repeated KV heads, explicit softmax attention, rotary recomputed per call."""

    def __init__(self, preset: LlamaPreset, device: DeviceInfo) -> None:
        self.num_threads = device.threads if device.kind == "cpu" else None
        self.spec: ModelSpec = preset.model
        self.device = torch.device(device.kind)
        dtype = getattr(torch, preset.dtype)
        self.w = {k: v.to(self.device, dtype) for k, v in load_weights(self.spec).items()}
        self.freq = inv_freq(self.spec, torch.float32).to(self.device)

    def _norm(self, x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.spec.rms_eps)).to(x.dtype) * w

    def _rope(self, x, pos):  # x [B, H, T, d]
        angle = torch.arange(pos, pos + x.shape[2], device=x.device, dtype=torch.float32)[:, None] * self.freq
        cos, sin = torch.cat([angle.cos()] * 2, -1).to(x.dtype), torch.cat([angle.sin()] * 2, -1).to(x.dtype)
        a, b = x.chunk(2, -1)
        return x * cos + torch.cat([-b, a], -1) * sin

    def _forward(self, tokens, pos, cache):
        s, w = self.spec, self.w
        B, T = tokens.shape
        x = w["model.embed_tokens.weight"][tokens]
        for i in range(s.layers):
            lw = layer_weights(w, i)
            h = self._norm(x, lw["input_norm"])
            q = self._rope(F.linear(h, lw["q"]).view(B, T, s.heads, s.head_dim).transpose(1, 2), pos)
            k = self._rope(F.linear(h, lw["k"]).view(B, T, s.kv_heads, s.head_dim).transpose(1, 2), pos)
            v = F.linear(h, lw["v"]).view(B, T, s.kv_heads, s.head_dim).transpose(1, 2)
            if cache[i] is not None:
                k, v = torch.cat([cache[i][0], k], 2), torch.cat([cache[i][1], v], 2)
            cache[i] = (k, v)
            k, v = k.repeat_interleave(s.groups, 1), v.repeat_interleave(s.groups, 1)
            scores = q @ k.transpose(-1, -2) / s.head_dim**0.5  # [B, H, T, S]
            S = k.shape[2]
            scores = scores.masked_fill(torch.ones(T, S, dtype=torch.bool, device=x.device).triu(S - T + 1), float("-inf"))
            a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1)
            x = x + F.linear(a, lw["o"])
            h = self._norm(x, lw["post_norm"])
            x = x + F.linear(F.silu(F.linear(h, lw["gate"])) * F.linear(h, lw["up"]), lw["down"])
        return F.linear(self._norm(x[:, -1], w["model.norm.weight"]), lm_head(w)).float()

    def __call__(self, prompt: torch.Tensor, continuation: torch.Tensor) -> dict:
        with torch.inference_mode():
            cache = [None] * self.spec.layers
            P = prompt.shape[1]
            logits = [self._forward(prompt, 0, cache)]
            for i in range(continuation.shape[1]):
                logits.append(self._forward(continuation[:, i:i + 1], P + i, cache))
            return {"logits": torch.stack(logits, 1)}


def baselines(preset: LlamaPreset) -> dict[str, Callable[[DeviceInfo], Engine]]:
    """Name -> builder(DeviceInfo) -> engine, for each baseline available here."""
    out: dict[str, Callable[[DeviceInfo], Engine]] = {"eager_ours": lambda d: _EagerOurs(preset, d)}
    if transformers_available():
        out["hf_eager"] = lambda d: _Transformers(preset, d, "eager")
        out["hf_sdpa"] = lambda d: _Transformers(preset, d, "sdpa")
        if preset.device == "cuda":
            out["hf_static_compiled"] = lambda d: _Transformers(preset, d, "sdpa", static=True)
    return out
