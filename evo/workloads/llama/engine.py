"""Build a Llama engine from a genome: one call is one generation, prefill then decode, with its own KV cache.

engine(prompt [B, P] int64, continuation [B, N] int64) -> {"logits": [B, N+1, V] float32}: the prompt
is prefilled (whole or in chunks), then each continuation token is decoded as one step against the
cache (teacher forcing: the work of greedy decoding, each step's logits computed before the next
token is read), and the logits of the last prompt position and of every step come back.

The weights are loaded here, in the engine's own process (`model.load_weights`), converted once to
the genome's dtype and layout (packed QKV and gate-up, pre-transposed), the projections to int8 rows
with weight_quant=int8 (`int8`: the LM head and embedding stay in the dtype), or every projection and the LM
head packed for a CPU kernel with linear_kernel (`linear_kernels`). The stages attention, mlp and
norm are the open stages' seeds unless the genome carries code for them (`open_code`).
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch
import torch.nn.functional as F

from evo.core.genome import Genome
from evo.workloads.base import DeviceInfo
from evo.workloads.llama import open_code
from evo.workloads.llama.genes import Plan, gene_space
from evo.workloads.llama.int8 import Int8Weight
from evo.workloads.llama.linear_kernels import PackedLinear
from evo.workloads.llama.model import LlamaPreset, ModelSpec, inv_freq, layer_weights, lm_head, load_weights
from evo.workloads.llama.open_stages import attention as _attention_seed
from evo.workloads.llama.open_stages import mlp as _mlp_seed
from evo.workloads.llama.open_stages import norm as _norm_seed

HAND_WRITTEN: Mapping[str, Callable] = {"attention": _attention_seed.attention, "mlp": _mlp_seed.mlp,
                                        "norm": _norm_seed.norm}


def project(x: torch.Tensor, w: torch.Tensor, layout: str) -> torch.Tensor:
    """x [M, in] times a weight in `layout`: [in, out] (pretransposed) or [out, in] (native, native_left).
    native_left runs (W @ x^T)^T: at a few rows MKL's sgemm reads the weight ~2x faster that way round
    (measured at B=4 on the 2-core host); the result is made contiguous (a few rows: a small copy)."""
    if layout == "pretransposed":
        return torch.mm(x, w)
    if layout == "native_left":
        return torch.mm(w, x.t()).t().contiguous()
    return F.linear(x, w)


def _rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, d] rotated on the pairs (i, i + d/2), Llama's layout; cos, sin [T, d/2]."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


def _rope_interleaved(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, d] whose pairs sit side by side (2i, 2i+1), rotated by one complex multiply; rot
    [T, d/2] complex (cos + i sin)."""
    pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)))  # [B, h, T, d/2] complex, a view
    return torch.view_as_real(pairs * rot).flatten(-2)


def interleave_rows(w: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """A q or k projection [heads*d, D] with each head's rows reordered (0, d/2, 1, d/2+1, ...): its
    outputs hold Llama's rotary pairs (i, i + d/2) side by side. q and k get the same order, so every
    score q.k is unchanged (the keys are cached in this order too)."""
    order = torch.stack([torch.arange(d // 2), torch.arange(d // 2) + d // 2], 1).reshape(-1)
    return w.view(heads, d, -1)[:, order].reshape(heads * d, -1)


class KVCache:
    """Keys and values of every layer for one call's positions. `update(i, k, v, pos)` writes positions
    [pos, pos+T) and returns layer i's keys and values as [B, KVH, S, d] views (S = pos+T). Preallocated:
    one tensor for all layers, and `k[i]`, `v[i]` its [B, KVH, L, d] views made once (a transposed view
    for BLHD), so a step costs one slice and one copy per tensor; `write_at` is the static-shape
    step's write of one position, returning the whole cache (its mask hides the rest)."""

    def __init__(self, plan: Plan, layers: int, B: int, L: int, kv_heads: int, d: int, device, dtype) -> None:
        self.preallocated = plan.kv_alloc == "preallocated"
        self.bhld = plan.kv_layout == "BHLD"
        self.length = L
        if self.preallocated:
            shape = (2, layers, B, kv_heads, L, d) if self.bhld else (2, layers, B, L, kv_heads, d)
            store = torch.zeros(shape, dtype=dtype, device=device)  # zeros: masked slots stay finite
            views = [store[j, i] if self.bhld else store[j, i].transpose(1, 2) for j in (0, 1) for i in range(layers)]
            self.k, self.v = views[:layers], views[layers:]
        else:
            self.grown: list[list[torch.Tensor | None]] = [[None, None] for _ in range(layers)]

    def update(self, i: int, k: torch.Tensor, v: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v: [B, KVH, T, d]
        end = pos + k.shape[2]
        if self.preallocated:
            keys, values = self.k[i], self.v[i]
            keys[:, :, pos:end] = k
            values[:, :, pos:end] = v
            return keys[:, :, :end], values[:, :, :end]
        pair = self.grown[i]
        for j, x in ((0, k), (1, v)):  # BLHD grows [B, S, KVH, d] tensors, BHLD [B, KVH, S, d]
            x = x if self.bhld else x.transpose(1, 2)
            pair[j] = x if pair[j] is None else torch.cat([pair[j], x], 2 if self.bhld else 1)
        return tuple(p if self.bhld else p.transpose(1, 2) for p in pair)  # type: ignore[return-value]

    def write_at(self, i: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one position (`pos` a 1-element index tensor; k, v [B, KVH, 1, d]); the whole cache back."""
        self.k[i].index_copy_(2, pos, k)
        self.v[i].index_copy_(2, pos, v)
        return self.k[i], self.v[i]


class LlamaEngine:
    """engine(prompt, continuation) -> {"logits": [B, N+1, V] float32}; see the module docstring."""

    def __init__(self, spec: ModelSpec, plan: Plan, device: str, max_positions: int,
                 impl: Mapping[str, Callable] = HAND_WRITTEN, genome: Genome | None = None) -> None:
        self.spec, self.plan, self.genome = spec, plan, genome
        self.device = torch.device(device)
        self.dtype = getattr(torch, plan.weight_dtype)
        self.kv_dtype = getattr(torch, plan.kv_dtype)
        self.num_threads: int | None = plan.threads if self.device.type == "cpu" else None
        self.attention, self.mlp, self.norm = impl["attention"], impl["mlp"], impl["norm"]
        self.interleaved = plan.rotary_pairs == "interleaved"
        self.quantised = plan.weight_quant == "int8"
        self.packed = plan.linear_kernel != "torch"  # projections and the LM head packed for a CPU kernel
        # int8 projections ignore weight_layout (their kernels take [out, in] rows); the float head keeps the default
        self.float_layout = "pretransposed" if self.quantised or self.packed else plan.weight_layout
        self._load(load_weights(spec))
        freq = inv_freq(spec, torch.float64)
        self.inv_freq = freq.to(device=self.device, dtype=torch.float32)
        if plan.rotary == "table":  # indexed by position: [L, d/2] complex, or cos and sin [L, d/2]
            angle = torch.arange(max_positions, dtype=torch.float64)[:, None] * freq
            self.table = self._rotation(angle)
        self._static_step = self._compile_step() if plan.decode_step != "eager" else None
        self._graphs: dict[tuple, object] = {}

    # ------------------------------------------------------------------ weights
    def _float_w(self, w: torch.Tensor) -> torch.Tensor:
        w = w.to(self.device, self.dtype)
        return w.t().contiguous() if self.float_layout == "pretransposed" else w.contiguous()

    def _w(self, w: torch.Tensor) -> torch.Tensor | Int8Weight | PackedLinear:
        """A projection [out, in] as the engine multiplies it: packed for the genome's CPU kernel, int8 rows and
        scales, or in the dtype and layout."""
        if self.packed:
            return PackedLinear.of(w, self.plan.linear_kernel, self.plan.one_row_weights)
        if self.quantised:
            return Int8Weight.of(w, self.device, self.dtype)
        return self._float_w(w)

    def _load(self, weights: dict[str, torch.Tensor]) -> None:
        plan = self.plan
        self.embed = weights["model.embed_tokens.weight"].to(self.device, self.dtype)  # [V, D]
        self.final_norm = weights["model.norm.weight"].to(self.device, self.dtype)
        head = lm_head(weights)
        self.head = (PackedLinear.of(head, self.plan.linear_kernel, self.plan.one_row_weights) if self.packed
                     else self._float_w(head))  # [D, V] or [V, D]
        self.layers = []
        for i in range(self.spec.layers):
            lw = layer_weights(weights, i)
            layer = {"input_norm": lw["input_norm"].to(self.device, self.dtype),
                     "post_norm": lw["post_norm"].to(self.device, self.dtype), "o": self._w(lw["o"]),
                     "mlp": {"down": self._w(lw["down"])}}
            if self.interleaved:  # rotary pairs side by side in q and k (see interleave_rows)
                lw["q"] = interleave_rows(lw["q"], self.spec.heads, self.spec.head_dim)
                lw["k"] = interleave_rows(lw["k"], self.spec.kv_heads, self.spec.head_dim)
            if plan.fused_qkv:
                layer["qkv"] = self._w(torch.cat([lw["q"], lw["k"], lw["v"]], 0))
            else:
                layer.update(q=self._w(lw["q"]), k=self._w(lw["k"]), v=self._w(lw["v"]))
            if plan.fused_gate_up:
                layer["mlp"]["gate_up"] = self._w(torch.cat([lw["gate"], lw["up"]], 0))
            else:
                layer["mlp"].update(gate=self._w(lw["gate"]), up=self._w(lw["up"]))
            self.layers.append(layer)

    def _proj(self, x: torch.Tensor, w: torch.Tensor | Int8Weight | PackedLinear) -> torch.Tensor:
        """x [M, in] (2-D: one mm, no batched-matmul folding) times the weight."""
        if isinstance(w, (Int8Weight, PackedLinear)):
            return w(x)
        return project(x, w, self.float_layout)

    # ------------------------------------------------------------------ the model
    def _rotation(self, angle: torch.Tensor):
        """The rotary factors for angles [T, d/2] (position x frequency): complex cos + i sin (interleaved
        pairs), else (cos, sin) in the activation dtype."""
        if self.interleaved:
            return torch.polar(torch.ones_like(angle), angle).to(self.device, torch.complex64)
        return angle.cos().to(self.device, self.dtype), angle.sin().to(self.device, self.dtype)

    def _rotary(self, pos: int, T: int):
        if self.plan.rotary == "table":
            t = self.table
            return t[pos:pos + T] if self.interleaved else (t[0][pos:pos + T], t[1][pos:pos + T])
        return self._rotation(torch.arange(pos, pos + T, device=self.device, dtype=torch.float32)[:, None] * self.inv_freq)

    def _rotary_at(self, pos: torch.Tensor):
        """The rotary factors at a 1-element position tensor (the static-shape step)."""
        if self.plan.rotary == "table":
            t = self.table
            return t[pos] if self.interleaved else (t[0][pos], t[1][pos])
        return self._rotation(pos.to(torch.float32)[:, None] * self.inv_freq)

    def _rope(self, x: torch.Tensor, rot) -> torch.Tensor:
        """x [B, h, T, d] rotated at its positions."""
        if not self.interleaved:
            return _rope_halves(x, *rot)
        if x.dtype == torch.float32:
            return _rope_interleaved(x, rot)
        return _rope_interleaved(x.float(), rot).to(x.dtype)  # complex multiplies in float32

    def _layers(self, x: torch.Tensor, rot, kv: Callable, mask) -> torch.Tensor:
        """The decoder over x [B, T, D] at the positions `rot` rotates by; `kv(i, k, v)` stores layer i's new
        keys and values [B, KVH, T, d] and returns the ones to attend to. Returns the final normed hidden
        [B, T, D]. The residual stream runs as [B*T, D]."""
        s, plan = self.spec, self.plan
        B, T, D = x.shape
        H, KVH, d = s.heads, s.kv_heads, s.head_dim
        x = x.view(B * T, D)
        residual = None
        for i, layer in enumerate(self.layers):
            h, x = self.norm(x, residual, layer["input_norm"], s.rms_eps, plan)
            if plan.fused_qkv:  # one matmul, and q and k rotated together
                qkv = self._proj(h, layer["qkv"]).view(B, T, H + 2 * KVH, d).transpose(1, 2)  # [B, H+2KVH, T, d]
                qk = self._rope(qkv[:, :H + KVH], rot)
                q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + KVH:]
            else:
                q = self._rope(self._proj(h, layer["q"]).view(B, T, H, d).transpose(1, 2), rot)
                k = self._rope(self._proj(h, layer["k"]).view(B, T, KVH, d).transpose(1, 2), rot)
                v = self._proj(h, layer["v"]).view(B, T, KVH, d).transpose(1, 2)
            if k.dtype != self.kv_dtype:
                k, v = k.to(self.kv_dtype), v.to(self.kv_dtype)
            keys, values = kv(i, k, v)
            a = self.attention(q, keys, values, mask, plan)  # [B, H, T, d]
            h, x = self.norm(x, self._proj(a.transpose(1, 2).reshape(B * T, H * d), layer["o"]),
                             layer["post_norm"], s.rms_eps, plan)
            residual = self.mlp(h, layer["mlp"], plan)
        return self.norm(x, residual, self.final_norm, s.rms_eps, plan)[0].view(B, T, D)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self._proj(h, self.head)  # [B, V]
        return logits if logits.dtype == torch.float32 else logits.float()

    def _forward(self, tokens: torch.Tensor, pos: int, cache: KVCache) -> torch.Tensor:
        """tokens [B, T] at positions [pos, pos+T): logits of the last one [B, V]."""
        h = self._layers(self.embed[tokens], self._rotary(pos, tokens.shape[1]),
                         lambda i, k, v: cache.update(i, k, v, pos), None)
        return self._logits(h[:, -1])

    def _step_static(self, token: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One decode step with static shapes: token [B, 1] at position pos (a 1-element int64 tensor),
        attention over the whole preallocated cache with the positions after pos masked."""
        L = cache.length
        visible = torch.arange(L, device=pos.device) <= pos
        mask = torch.zeros(1, L, dtype=self.dtype, device=pos.device).masked_fill(~visible, float("-inf"))
        h = self._layers(self.embed[token], self._rotary_at(pos), lambda i, k, v: cache.write_at(i, k, v, pos), mask)
        return self._logits(h[:, -1])

    def _compile_step(self) -> Callable:
        if self.plan.decode_step == "compiled":
            return torch.compile(self._step_static, dynamic=True)
        return self._step_static  # cuda_graph: captured per shape in _graph_step

    def _graph_step(self, cache: KVCache, B: int) -> Callable:
        """A CUDA graph of the static step for this cache (one per shape), replayed per token."""
        key = (B, cache.length)
        if key not in self._graphs:
            token = torch.zeros(B, 1, dtype=torch.long, device=self.device)
            pos = torch.zeros(1, dtype=torch.long, device=self.device)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up outside the graph (allocations, lazy init)
                    self._step_static(token, pos, cache)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = self._step_static(token, pos, cache)
            self._graphs = {key: (graph, token, pos, logits)}  # one shape kept: its cache is the engine's
        graph, token, pos, logits = self._graphs[key]

        def step(tok: torch.Tensor, p: int) -> torch.Tensor:
            token.copy_(tok)
            pos.fill_(p)
            graph.replay()
            return logits

        return step

    # ------------------------------------------------------------------ one generation
    def _cache(self, B: int, L: int) -> KVCache:
        s = self.spec
        if self.plan.decode_step == "cuda_graph":  # the graph holds the cache's addresses: keep it per shape
            key = (B, L)
            if getattr(self, "_kept", (None,))[0] != key:
                self._kept = (key, KVCache(self.plan, s.layers, B, L, s.kv_heads, s.head_dim, self.device, self.kv_dtype))
            return self._kept[1]
        return KVCache(self.plan, s.layers, B, L, s.kv_heads, s.head_dim, self.device, self.kv_dtype)

    def __call__(self, prompt: torch.Tensor, continuation: torch.Tensor) -> dict:
        with torch.inference_mode(), self._sdpa_backend():
            B, P = prompt.shape
            N = continuation.shape[1]
            cache = self._cache(B, P + N)
            out = torch.empty(B, N + 1, self.spec.vocab, dtype=torch.float32, device=self.device)
            if self.plan.prefill == "whole":
                out[:, 0] = self._forward(prompt, 0, cache)
            else:
                C = self.plan.prefill_chunk
                for start in range(0, P, C):
                    last = self._forward(prompt[:, start:start + C], start, cache)
                out[:, 0] = last
            if self.plan.decode_step == "eager":
                for i in range(N):
                    out[:, i + 1] = self._forward(continuation[:, i:i + 1], P + i, cache)
            elif self.plan.decode_step == "compiled":
                positions = torch.arange(P, P + N, device=self.device)
                for i in range(N):
                    out[:, i + 1] = self._static_step(continuation[:, i:i + 1], positions[i:i + 1], cache)
            else:
                step = self._graph_step(cache, B)
                for i in range(N):
                    out[:, i + 1] = step(continuation[:, i:i + 1], P + i)
            return {"logits": out}

    def _sdpa_backend(self):
        import contextlib

        if self.device.type != "cuda" or self.plan.attention != "sdpa" or self.plan.sdpa_backend == "default":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        names = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
        return sdpa_kernel(names[self.plan.sdpa_backend])


def build(genome: Genome, preset: LlamaPreset, device: DeviceInfo, max_positions: int,
          sources: Mapping[str, str] | None = None, native_step: bool = False) -> LlamaEngine:
    """Validate `genome` (GenomeError propagates), load the weights and compose its engine. `sources`
    maps code hash -> source for the code genes the genome sets; their entry points replace the seeds.
    `native_step`: the layers of a generation engine, whose genome may name its C step's kernels."""
    genome = gene_space(preset, device, native_step).validate(genome)
    impl = {**HAND_WRITTEN, **open_code.implementations(genome.values(), sources or {})}
    return LlamaEngine(preset.model, Plan.from_genome(genome), device.kind,
                       max_positions, impl, genome)
