"""The searched generation engine for the Kimi Linear hybrid decoder (the generation contract,
`evo.workloads.generation`): requests in, tokens out.

Three parts, each blind to the others' insides (as llama_serve's engine, and vLLM, keep them apart):
- the state pool (`StatePool`): per running request a row of every layer's memory: for each KDA layer its
  recurrent state ([H, K, V], or [H, V, K] by `state_layout`) and its convolution window (the last taps-1
  inputs of the q|k|v channels, in order or as a ring by `conv_window`), for each MLA layer its cache (per-head
  keys and values, or the compressed latent and rope key) of P + N positions, in `mla_cache_dtype`.
  Running requests hold the first rows, so a decode step reads views; a row's memory depends only on its
  request (the ring's slot order on its position), so a request that moves rows takes it along by copy;
- the model (`KimiModel`): a prompt of one row (its state from zero), and one decode step of rows [0, n)
  together: the KDA recurrence batched over the rows' states (as torch ops, or our C kernel by `kda_kernel`), MLA
  attending over each row's own positions under a per-row mask, the MoE dispatched by the `moe_dispatch` gene (the
  shared experts among the routed ones, or apart, by `shared_expert`);
- the scheduler, shared with every generation engine here (`evo.workloads.generation_core.Scheduler`, over
  the pool and `KimiRunner`, the model as its runner): continuous batching up to `max_running`: decode every
  running request by one token, then admit waiting requests and prefill each whole (its first token comes
  from there; the recurrence cannot resume a prompt mid-way, so no chunks; with prefill_step=with_decode the
  decode rows run in the prefill's forward); a request that ends leaves its row, and the last running row moves
  into the hole.
Greedy, or each request's seeded sampling (`evo.workloads.generation_core.pick_tokens`).
"""
from __future__ import annotations

import warnings
from typing import Iterator, Mapping

import torch
import torch.nn.functional as F

from evo.core.genome import Genome
from evo.workloads.base import NO_SOURCES, DeviceInfo, Preset
from evo.workloads.generation_core import Pick, Ragged, Scheduler, SchedulerPolicy, cpu_kernels, pick_tokens
from evo.workloads.kda.definition import L2NORM_EPS
from evo.workloads.kimi_linear.genes import KimiPlan, gene_space
from evo.workloads.kimi_linear.model import DENSE, FP32_TENSORS, KDA, LATENT_NORM_EPS, KimiSpec, load_weights
from evo.workloads.kimi_linear.presets import KimiPreset

PREFILL_CHUNK = 256  # prompt tokens a C forward call takes (prefill_step=native): a product's 256 inputs stay in cache


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


class _Linears:
    """Projections of one input, [out, in] weights kept transposed ([in, out]); fused: one matmul, split after."""

    def __init__(self, weights: list[torch.Tensor], fused: bool) -> None:
        self.sizes = [w.shape[0] for w in weights]
        self.fused = fused
        self.w = [torch.cat(weights).T.contiguous()] if fused else [w.T.contiguous() for w in weights]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.fused:
            return list((x @ self.w[0]).split(self.sizes, -1))
        return [x @ w for w in self.w]


# ---------------------------------------------------------------------------------------------- the state pool
class StatePool:
    """Every layer's per-request memory, `rows` rows (see the module). KDA: state [rows, H, K, V] (or
    [rows, H, V, K]: K = V) in the state dtype, conv [rows, taps-1, 3HK]; MLA, in the cache dtype: expanded
    k [rows, Hm, L, nope+rope], v [rows, Hm, L, dv]; compressed one [rows, L, R + rope] of (normalised latent |
    rope key)."""

    def __init__(self, spec: KimiSpec, plan: KimiPlan, length: int, dtype: torch.dtype, device) -> None:
        rows, H, K = plan.max_running, spec.kda_heads, spec.kda_head_dim
        state_dtype, cache_dtype = getattr(torch, plan.state_dtype), getattr(torch, plan.mla_cache_dtype)
        self.tensors: list[list[torch.Tensor]] = []  # per layer, its tensors (row first)
        for mixer in spec.layer_types:
            if mixer == KDA:
                self.tensors.append([torch.zeros(rows, H, K, K, dtype=state_dtype, device=device),
                                     torch.zeros(rows, spec.conv_kernel - 1, 3 * H * K, dtype=dtype, device=device)])
            elif plan.mla_cache == "expanded":
                Hm = spec.mla_heads
                self.tensors.append([torch.zeros(rows, Hm, length, spec.qk_head_dim, dtype=cache_dtype, device=device),
                                     torch.zeros(rows, Hm, length, spec.v_head_dim, dtype=cache_dtype, device=device)])
            else:
                self.tensors.append([torch.zeros(rows, length, spec.kv_lora_rank + spec.qk_rope_dim,
                                                 dtype=cache_dtype, device=device)])
        self.positional = [mixer != KDA for mixer in spec.layer_types]  # MLA: position axis to cut at `length`
        self.expanded = plan.mla_cache == "expanded"

    def reserve(self, row: int, length: int) -> None:
        """Room for positions [0, length) of `row`: every row always has it."""

    def release(self, row: int) -> None:
        """The row's request ended: nothing to give back (a prefill overwrites a row's state from zero)."""

    def move(self, src: int, dst: int, length: int) -> None:
        """Row src's memory (its first `length` positions of the MLA caches) into row dst (src is then free)."""
        for span, t in self._spans(length):
            t[(dst, *span)] = t[(src, *span)]

    def swap(self, a: int, b: int, length: int) -> None:
        """Rows a and b trade their memory (the MLA caches' first `length` positions)."""
        for span, t in self._spans(length):
            t[([a, b], *span)] = t[([b, a], *span)]

    def _spans(self, length: int) -> Iterator[tuple[tuple, torch.Tensor]]:
        """(index after the row axis, tensor) for every tensor: a KDA tensor whole, an MLA cache's first
        `length` positions."""
        for positional, tensors in zip(self.positional, self.tensors):
            span = () if not positional else (slice(None), slice(length)) if self.expanded else (slice(length),)
            for t in tensors:
                yield span, t


# ---------------------------------------------------------------------------------------------- the model
def _scripted(fn):
    """`fn` compiled by TorchScript (its loop runs without Python between ops), else `fn` itself (the same
    results: TorchScript is deprecated in torch 2.13 and may go; torch.compile would unroll the loop per length)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return torch.jit.script(fn)
        except Exception:  # noqa: BLE001 - a torch without TorchScript runs the same loop in Python
            return fn


def _recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The KDA recurrence over one prompt from a zero state, token by token, in four ops a token: q, k, v,
    decay [T, H, K], beta [T, H] -> o [T, H, V], the final state [H, K, V]. With S' = diag(decay_t) S, one
    product gives S'^T k_t and S'^T q_t; r_t = v_t - S'^T k_t; S = S' + beta_t k_t r_t^T; and
    o_t = S^T q_t = S'^T q_t + (beta_t k_t . q_t) r_t, taken for every t after the loop. TorchScript runs the
    loop without Python between its ops: bit-identical, 1.5-1.8x as fast at 4 heads of 64 and 136 tokens (one
    thread; 1.3x at 64 heads, the `prefill_rows` form)."""
    T, H, K = k.shape
    S = torch.zeros(H, K, v.shape[-1], device=k.device)
    bk = beta[..., None] * k  # [T, H, K]
    kq = torch.stack((k, q), 2)  # [T, H, 2, K]
    both = torch.empty(T, H, 2, v.shape[-1], device=k.device)  # per token: S'^T k_t, S'^T q_t
    residual = torch.empty_like(v)
    for t in range(T):
        S.mul_(decay[t, :, :, None])
        torch.bmm(kq[t], S, out=both[t])
        torch.sub(v[t], both[t, :, 0], out=residual[t])
        S.baddbmm_(bk[t, :, :, None], residual[t, :, None])
    return both[:, :, 1] + (bk * q).sum(-1, keepdim=True) * residual, S


_recurrent_prefill = _scripted(_recurrence)


def _step_kv(S: torch.Tensor, q, k, v, decay, beta) -> torch.Tensor:
    """One delta-rule step of states S [n, H, K, V] (in place) for q, k, v, decay [n, H, K], beta [n, H];
    o [n, H, V] = q^T S."""
    S.mul_(decay[..., None])
    residual = v - (k[:, :, None] @ S)[:, :, 0]  # [n, H, V]: v - S^T k
    S.add_((beta[..., None] * k)[..., None] * residual[:, :, None])
    return (q[:, :, None] @ S)[:, :, 0]


def _step_vk(S: torch.Tensor, q, k, v, decay, beta) -> torch.Tensor:
    """`_step_kv` for states kept transposed, S [n, H, V, K]: the decay and the rank-one update along the last
    axis; the products read S through its transposed view (k^T S^T). As S k and S q (batched matrix-vector)
    they took 3.7x as long on one CPU thread (16 rows, 4 heads of 64: 560 us against 150 us a layer)."""
    S.mul_(decay[:, :, None])
    residual = v - (k[:, :, None] @ S.mT)[:, :, 0]  # [n, H, V]: v - S k
    S.add_(residual[..., None] * (beta[..., None] * k)[:, :, None])
    return (q[:, :, None] @ S.mT)[:, :, 0]


class KdaLayer:
    """Kimi Delta Attention with its per-request recurrent state and convolution window in the pool."""

    def __init__(self, spec: KimiSpec, w: Mapping[str, torch.Tensor], p: str, plan: KimiPlan,
                 memory: list[torch.Tensor], chunked) -> None:
        self.H, self.K, self.eps = spec.kda_heads, spec.kda_head_dim, spec.rms_eps
        self.state, self.conv = memory  # [rows, H, K, V] (vk: [rows, H, V, K]), [rows, taps-1, 3HK]
        self.state_f32 = self.state.dtype == torch.float32
        self.vk = plan.state_layout == "vk"
        self.step = _step_vk if self.vk else _step_kv
        self.ring = plan.conv_window == "ring" and spec.conv_kernel > 1  # one tap: no window to keep
        self.slots = torch.arange(spec.conv_kernel - 1, device=self.conv.device)  # [taps-1]
        self.conv_slots = self.conv.view(-1, self.conv.shape[-1])  # [rows (taps-1), C]: row r's slot s at r(taps-1)+s
        self.qkv = _Linears([w[p + f"{n}_proj.weight"] for n in "qkv"], plan.fused_projections)
        # f_a, g_a (rank K) and beta's projection read the same input
        self.low = _Linears([w[p + "forget_gate.f_a_proj.weight"], w[p + "g_a_proj.weight"], w[p + "b_proj.weight"]],
                            plan.fused_projections)
        self.f_b, self.g_b = w[p + "forget_gate.f_b_proj.weight"].T.contiguous(), w[p + "g_b_proj.weight"].T.contiguous()
        self.dt_bias = w[p + "forget_gate.dt_bias"].float()  # [HK]
        self.a = -w[p + "forget_gate.A_log"].float().exp().reshape(self.H, 1)  # [H, 1]
        self.conv_t = w[p + "conv1d.weight"][:, 0].T.contiguous()  # [taps, C] of the [C, 1, taps] kernel
        self.o_norm, self.o = w[p + "o_norm.weight"], w[p + "o_proj.weight"].T.contiguous()
        self.chunked = chunked  # the KDA workload's engine (kda_prefill=chunked), or None
        self.native = plan.kda_kernel == "native"  # our C recurrence (prefill and decode; [K, V] states)
        # a float32 recurrent prefill through C between its products: window, gates, recurrence, norm in one call
        self.native_prefill = self.native and chunked is None and self.state_f32 and self.conv.dtype == torch.float32
        self.a_heads = self.a.flatten().contiguous()  # [H]

    def _gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [n, D] -> g [n, H, K] (float32 log decay), beta [n, H] (float32), output gate [n, H, K]."""
        f, ga, b = self.low(x)
        g = self.a * F.softplus((f @ self.f_b).float() + self.dt_bias).view(-1, self.H, self.K)
        return g, torch.sigmoid(b.float()), torch.sigmoid((ga @ self.g_b).view(-1, self.H, self.K))

    def _out(self, o: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        o = _rmsnorm(o.to(dtype), self.o_norm, self.eps) * gate  # [n, H, V]
        return o.flatten(1) @ self.o

    def _qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Convolved channels [n, 3HK] -> q (l2-normalised, scaled), k (l2-normalised), v, each [n, H, K] float32."""
        q, k, v = F.silu(mixed).float().view(-1, 3, self.H, self.K).unbind(1)
        return _l2norm(q) * self.K**-0.5, _l2norm(k), v

    def _convolve(self, padded: torch.Tensor, T: int) -> torch.Tensor:
        """The causal depthwise convolution of inputs [n, taps-1 + T, C] (their history first) -> [n, T, C], tap by
        tap (F.conv1d took 2.4x the time: 16 prompts of 136 tokens, 768 channels, one thread), summed in float32
        and rounded once to the inputs' dtype, as conv1d does."""
        x, w = padded.float(), self.conv_t.float()
        out = x[:, :T] * w[0]
        for j in range(1, w.shape[0]):
            out.addcmul_(x[:, j:j + T], w[j])
        return out.to(padded.dtype)

    def _keep_window(self, row: int, last: torch.Tensor, T: int) -> None:
        """The inputs at positions [T - (taps-1), T) [taps-1, C] into `row`'s window: in order, or (ring) each
        at slot position % (taps-1)."""
        self.conv[row] = last.roll(T % last.shape[0], 0) if self.ring else last

    def _shift(self, new: torch.Tensor) -> torch.Tensor:
        """new inputs [n, C] of rows [0, n) -> convolved [n, C]; each window moves up by one."""
        n = new.shape[0]
        window = torch.cat([self.conv[:n], new[:, None]], 1)  # [n, taps, C]
        self.conv[:n] = window[:, 1:]
        return (window * self.conv_t).sum(1)

    def _ring(self, new: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """`_shift` for ring windows: row r's inputs at positions pos[r] - (taps-1) .. pos[r] - 1 lie at slots
        (pos[r] + i) % (taps-1), read in that order; the new input goes over the oldest."""
        n, slots = new.shape[0], self.slots.shape[0]
        order = rows[:, None] * slots + (pos[:, None] + self.slots) % slots  # [n, taps-1] into conv_slots
        history = self.conv_slots.index_select(0, order.flatten()).view(n, slots, -1)  # [n, taps-1, C]
        self.conv_slots.index_copy_(0, rows * slots + pos % slots, new)
        return (history * self.conv_t[:-1]).sum(1) + new * self.conv_t[-1]

    def prefill_rows(self, x: torch.Tensor, rows: list[int], batch: Ragged) -> torch.Tensor:
        """Prompts from position 0 (zero state, zero history), x [N, D] their tokens packed (`batch`; one prompt or
        several), each prompt's state and window into its row of `rows`. The recurrence (or the chunks) runs over
        the prompts as rows padded to the longest with a decay of 1 and beta 0 after each end, which leaves its
        state as its last token left it."""
        if self.native_prefill:
            return self._prefill_in_c(x, rows, batch)
        taps = self.conv_t.shape[0]
        raw = torch.cat(self.qkv(x), -1)  # [N, C]
        padded = F.pad(batch.padded(raw), (0, 0, taps - 1, 0))  # [n, taps-1 + longest, C]
        for i, (row, T) in enumerate(zip(rows, batch.lengths)):
            self._keep_window(row, padded[i, T:T + taps - 1], T)
        T = batch.longest
        mixed = self._convolve(padded, T)  # [n, longest, C]
        g, beta, gate = self._gates(x)
        g, beta = batch.padded(g), batch.padded(beta)  # pads: log decay 0, beta 0: a state passes them unchanged
        n = g.shape[0]
        if self.chunked is not None:
            q, k, v = F.silu(mixed).float().view(n, T, 3, self.H, self.K).unbind(2)
            out = self.chunked(q, k, v, g, beta)
            o, S = batch.packed(out["o"]), out["final_state"]  # [N, H, V], [n, H, K, V]
        else:
            q, k, v = (t.view(n, T, self.H, self.K) for t in self._qkv(mixed.flatten(0, 1)))  # [n, T, H, K]
            if self.native:  # our C recurrence, each prompt to its own length (its pads not read)
                S = torch.zeros(n, self.H, self.K, v.shape[-1], device=x.device)
                o = batch.packed(cpu_kernels.kda_recurrence(S, q, k, v, g.exp(), beta, torch.tensor(batch.lengths)))
            else:  # the one-prompt recurrence over n*H heads: [n, T, H, ...] -> [T, n H, ...]
                heads = lambda t: t.transpose(0, 1).flatten(1, 2)  # noqa: E731
                o, S = _recurrent_prefill(heads(q), heads(k), heads(v), heads(g.exp()), heads(beta))
                o, S = batch.packed(o.view(T, n, self.H, -1).transpose(0, 1)), S.view(n, self.H, self.K, -1)
        self.state[torch.tensor(rows, device=x.device)] = (S.mT if self.vk else S).to(self.state.dtype)
        return self._out(o, gate, x.dtype)

    def _prefill_in_c(self, x: torch.Tensor, rows: list[int], batch: Ragged) -> torch.Tensor:
        """`prefill_rows` with the products in torch and everything between them in C, each prompt to its own
        length (`cpu_kernels.kda_prefill`: the decode step's per-token code over the prompt's tokens)."""
        q, k, v = (t.contiguous() for t in self.qkv(x))  # [N, HK] each
        f, ga, b = self.low(x)
        o = cpu_kernels.kda_prefill(q, k, v, f @ self.f_b, ga @ self.g_b, b.contiguous(), list(batch.lengths), rows,
                                    self.conv, self.state, self.conv_t, self.dt_bias, self.a_heads, self.o_norm,
                                    self.eps, L2NORM_EPS)
        if self.ring:  # the window as the C code leaves it, oldest first, into ring order (`_keep_window`)
            for row, T in zip(rows, batch.lengths):
                self.conv[row] = self.conv[row].roll(T % self.conv.shape[1], 0)
        return o @ self.o

    def decode(self, x: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [n, D]: one token of rows [0, n) at positions pos [n], each from its own state and window (updated
        in place)."""
        n = x.shape[0]
        new = torch.cat(self.qkv(x), -1)  # [n, C]
        q, k, v = self._qkv(self._ring(new, rows, pos) if self.ring else self._shift(new))
        g, beta, gate = self._gates(x)
        S = self.state[:n] if self.state_f32 else self.state[:n].float()  # [n, H, K, V] or [n, H, V, K]
        if self.native:  # one token per row: sequences of length one
            o = cpu_kernels.kda_recurrence(S, q[:, None], k[:, None], v[:, None], g.exp()[:, None], beta[:, None])[:, 0]
        else:
            o = self.step(S, q, k, v, g.exp(), beta)  # [n, H, V]
        if not self.state_f32:
            self.state[:n] = S
        return self._out(o, gate, x.dtype)


class MlaLayer:
    """Multi-head latent attention without rotary embedding, over each request's own cache rows (kept in the
    cache dtype, read back in the model's)."""

    def __init__(self, spec: KimiSpec, w: Mapping[str, torch.Tensor], p: str, plan: KimiPlan,
                 memory: list[torch.Tensor]) -> None:
        self.H, self.nope, self.rope = spec.mla_heads, spec.qk_nope_dim, spec.qk_rope_dim
        self.R, self.dv, self.scale = spec.kv_lora_rank, spec.v_head_dim, spec.qk_head_dim**-0.5
        self.memory, self.compressed = memory, plan.mla_cache == "compressed"
        self.q_lora = spec.q_lora_rank is not None
        first = [w[p + "q_a_proj.weight"] if self.q_lora else w[p + "q_proj.weight"], w[p + "kv_a_proj_with_mqa.weight"]]
        self.input = _Linears(first, plan.fused_projections)  # q (or its latent) and the kv latent | rope key
        if self.q_lora:
            self.q_a_norm, self.q_b = w[p + "q_a_layernorm.weight"], w[p + "q_b_proj.weight"].T.contiguous()
        self.kv_norm = w[p + "kv_a_layernorm.weight"]
        kv_b = w[p + "kv_b_proj.weight"]  # [H (nope + dv), R]
        self.kv_b = kv_b.T.contiguous()
        o = w[p + "o_proj.weight"]  # [D, H dv]
        self.o = o.T.contiguous()
        if self.compressed:  # W_UK absorbed into the query, W_UV into o_proj
            per_head = kv_b.view(self.H, self.nope + self.dv, self.R)
            self.w_uk = per_head[:, :self.nope].contiguous()  # [H, nope, R]
            w_uv = per_head[:, self.nope:]  # [H, dv, R]
            self.o_latent = torch.einsum("dhv,hvr->hrd", o.view(-1, self.H, self.dv), w_uv).reshape(
                self.H * self.R, -1).contiguous()  # [H R, D]

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [n, D] -> q [n, H, nope+rope], normalised latent [n, R], rope key [n, rope]."""
        q, kv_a = self.input(x)
        if self.q_lora:
            q = _rmsnorm(q, self.q_a_norm, LATENT_NORM_EPS) @ self.q_b
        latent, k_rope = kv_a.split([self.R, self.rope], -1)
        return q.view(-1, self.H, self.nope + self.rope), _rmsnorm(latent, self.kv_norm, LATENT_NORM_EPS), k_rope

    def _expand(self, c: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent [n, R], rope key [n, rope] -> k [n, H, nope+rope], v [n, H, dv]."""
        k_nope, v = (c @ self.kv_b).view(-1, self.H, self.nope + self.dv).split([self.nope, self.dv], -1)
        return torch.cat([k_nope, k_rope[:, None].expand(-1, self.H, self.rope)], -1), v

    def prefill_rows(self, x: torch.Tensor, rows: list[int], batch: Ragged) -> torch.Tensor:
        """Prompts at positions [0, T) (one or several), x [N, D] their tokens packed (`batch`), each prompt's cache
        into its row of `rows`; causal attention over each prompt on its own on the CPU (padding the prompts to the
        longest took 3.4x the time: 16 prompts of 16-256 tokens, 4 heads, one thread)."""
        q, c, k_rope = self._project(x)
        k, v = self._expand(c, k_rope)
        row, pos = torch.tensor(rows, device=x.device)[batch.owner], batch.position
        if self.compressed:
            self.memory[0][row, pos] = torch.cat([c, k_rope], -1).to(self.memory[0].dtype)
        else:
            self.memory[0][row, :, pos] = k.to(self.memory[0].dtype)
            self.memory[1][row, :, pos] = v.to(self.memory[1].dtype)
        # values padded with zeros to the keys' width: SDPA's fused CPU kernel takes equal widths, and ran this
        # attention 2.1-2.6x faster than the matmul form it falls back to (4 rows of 200, 4 heads, one thread)
        dv = v.shape[-1]
        v = F.pad(v, (0, max(0, q.shape[-1] - dv)))
        if x.device.type != "cpu":  # one launch over the prompts padded to the longest (a pad follows every real token)
            q, k, v = (batch.padded(t).transpose(1, 2) for t in (q, k, v))  # [n, H, longest, d]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)[..., :dv]
            return batch.packed(o.transpose(1, 2)).flatten(1) @ self.o
        o, start = x.new_empty(x.shape[0], self.H, dv), 0
        for T in batch.lengths:
            heads = [t[start:start + T].transpose(0, 1)[None] for t in (q, k, v)]  # [1, H, T, d]
            o[start:start + T] = F.scaled_dot_product_attention(*heads, is_causal=True, scale=self.scale)[
                0, :, :, :dv].transpose(0, 1)
            start += T
        return o.flatten(1) @ self.o

    def decode(self, x: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [n, D] of rows [0, n) at positions pos [n]; each attends to its keys [0, S) under mask [n, 1, 1, S]."""
        n, S = x.shape[0], mask.shape[-1]
        q, c, k_rope = self._project(x)
        if self.compressed:
            cache = self.memory[0]
            cache[rows, pos] = torch.cat([c, k_rope], -1).to(cache.dtype)
            q_nope, q_rope = q.split([self.nope, self.rope], -1)
            q_lat = torch.cat([torch.einsum("nhd,hdr->nhr", q_nope, self.w_uk), q_rope], -1)  # [n, H, R + rope]
            keys = cache[:n, None, :S].to(x.dtype)  # [n, 1, S, R + rope]: one key head shared by every query head
            o = F.scaled_dot_product_attention(q_lat[:, None], keys, keys[..., :self.R], attn_mask=mask,
                                               scale=self.scale)  # [n, 1, H, R]
            return o.reshape(n, -1) @ self.o_latent
        k, v = self._expand(c, k_rope)
        keys, values = self.memory
        keys[rows, :, pos], values[rows, :, pos] = k.to(keys.dtype), v.to(values.dtype)
        o = F.scaled_dot_product_attention(q[:, :, None], keys[:n, :, :S].to(x.dtype), values[:n, :, :S].to(x.dtype),
                                           attn_mask=mask, scale=self.scale)  # [n, H, 1, dv]
        return o.reshape(n, -1) @ self.o


class DenseMlp:
    def __init__(self, w: Mapping[str, torch.Tensor], p: str, plan: KimiPlan) -> None:
        self.gate_up = _Linears([w[p + "gate_proj.weight"], w[p + "up_proj.weight"]], plan.fused_projections)
        self.down = w[p + "down_proj.weight"].T.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return (F.silu(gate) * up) @ self.down


def _shared_as_experts(w: Mapping[str, torch.Tensor], p: str, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared SwiGLU (gate, up [S, D], down [D, S]) as S / width experts of `width`, stacked as the routed
    ones are stored ([count, 2 width, D] gate rows then up rows, [count, D, width]). Exact: a SwiGLU is a sum
    over its intermediate columns."""
    gate, up, down = (w[p + f"{n}_proj.weight"] for n in ("gate", "up", "down"))
    (S, D), count = gate.shape, gate.shape[0] // width
    assert count * width == S, f"shared experts' width {S} is not a multiple of moe_intermediate {width}"
    gate_up = torch.cat([gate.reshape(count, width, D), up.reshape(count, width, D)], 1)
    return gate_up, down.reshape(D, count, width).transpose(0, 1)


class MoeMlp:
    """Sigmoid-scored grouped top-k routing (router in float32), routed SwiGLU experts plus the shared ones:
    apart as one dense SwiGLU, or (fused) appended to the routed experts, chosen by every token with weight 1."""

    def __init__(self, spec: KimiSpec, w: Mapping[str, torch.Tensor], p: str, plan: KimiPlan) -> None:
        self.spec, self.dispatch = spec, getattr(self, "_" + plan.moe_dispatch)
        self.router = w[p + "gate.weight"].float().T.contiguous()  # [D, E]
        self.bias = w[p + "gate.e_score_correction_bias"].float()
        gate_up, down = w[p + "experts.gate_up_proj"], w[p + "experts.down_proj"]  # [E, 2I, D], [E, D, I]
        self.shared = None  # fused: the shared experts are the last ones, ids shared_ids
        if plan.shared_expert == "fused":
            shared_gate_up, shared_down = _shared_as_experts(w, p + "shared_experts.", spec.moe_intermediate)
            gate_up, down = torch.cat([gate_up, shared_gate_up]), torch.cat([down, shared_down])
            self.shared_ids = torch.arange(spec.experts, gate_up.shape[0], device=gate_up.device)
        else:
            self.shared = DenseMlp(w, p + "shared_experts.", plan)
        self.experts = gate_up.shape[0]  # routed, then (fused) shared
        self.gate_up = gate_up.transpose(1, 2).contiguous()  # [E', D, 2I]
        self.down = down.transpose(1, 2).contiguous()  # [E', I, D]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, D] -> chosen experts [n, top_k], their weights [n, top_k] (float32)."""
        s = self.spec
        n, E, G = x.shape[0], s.experts, s.expert_groups
        scores = torch.sigmoid(x.float() @ self.router)  # [n, E]
        choice = scores + self.bias
        if G > 1:
            group_score = choice.view(n, G, E // G).topk(2, -1).values.sum(-1)  # [n, G]
            kept = torch.zeros(n, G, dtype=torch.bool, device=x.device)
            kept.scatter_(1, group_score.topk(s.topk_groups, -1).indices, True)
            choice = choice.masked_fill(~kept.repeat_interleave(E // G, 1), float("-inf"))
        chosen = choice.topk(s.top_k, -1).indices
        weight = scores.gather(1, chosen)
        if s.renormalize:
            weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
        return chosen, weight * s.routed_scaling

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.gate_up[e]).chunk(2, -1)
        return (F.silu(gate) * up) @ self.down[e]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        chosen, weight = self.route(x)
        weight = weight.to(x.dtype)
        if self.shared is not None:
            return self.dispatch(x, chosen, weight, self.shared(x))
        n, shared = x.shape[0], self.shared_ids.shape[0]  # fused: every token chooses the shared experts too
        chosen = torch.cat([chosen, self.shared_ids.expand(n, -1)], 1)
        weight = torch.cat([weight, torch.ones(n, shared, dtype=x.dtype, device=x.device)], 1)
        return self.dispatch(x, chosen, weight, torch.zeros_like(x))

    def _dense(self, x: torch.Tensor, chosen: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, combined with the routing weights (zero where not routed), added to out."""
        gate, up = torch.einsum("nd,edi->eni", x, self.gate_up).chunk(2, -1)  # [E', n, I] each
        y = torch.bmm(F.silu(gate) * up, self.down)  # [E', n, D]
        dense = torch.zeros(x.shape[0], self.experts, dtype=x.dtype, device=x.device)
        dense.scatter_(1, chosen, weight)  # [n, E']
        return out + torch.einsum("ne,end->nd", dense, y)

    def _grouped(self, x: torch.Tensor, chosen: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """(token, expert) pairs sorted by expert; each expert's contiguous run in one product, its routing weights
        applied to the intermediate and its rows added into out (1.2-1.4x the time when the runs' outputs were
        concatenated, weighted and added at once: 2193 tokens, one thread; level at 150)."""
        flat = chosen.flatten()  # [n k]
        order = flat.argsort(stable=True)
        tokens = order // chosen.shape[1]
        counts = torch.bincount(flat, minlength=self.experts).tolist()
        xs, ws = x[tokens], weight.flatten()[order, None]
        start = 0
        for e, count in enumerate(counts):
            if count:
                end = start + count
                gate, up = (xs[start:end] @ self.gate_up[e]).chunk(2, -1)
                out.index_add_(0, tokens[start:end], (F.silu(gate).mul_(up).mul_(ws[start:end])) @ self.down[e])
            start += count
        return out

    def _loop(self, x: torch.Tensor, chosen: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Per expert, its routed tokens."""
        for e in range(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, weight[rows, slot, None] * self._expert(e, x[rows]))
        return out


class KimiModel:
    """The decoder's forwards, blind to requests: a prompt of one pool row, one decode step of rows [0, n)."""

    def __init__(self, spec: KimiSpec, plan: KimiPlan, pool: StatePool, weights: Mapping[str, torch.Tensor],
                 max_positions: int, dtype: torch.dtype, device, chunked=None) -> None:
        # the router and dt_bias stay float32 (transformers' _keep_in_fp32_modules_strict); the rest in `dtype`
        w = {name: t.to(device=device, dtype=torch.float32 if name.endswith(FP32_TENSORS) else dtype)
             for name, t in weights.items()}
        self.eps, self.device = spec.rms_eps, device
        self.embed, self.norm, self.head = (w["model.embed_tokens.weight"], w["model.norm.weight"],
                                            w["lm_head.weight"].T.contiguous())
        self.layers = []
        for i, (mixer, ffn) in enumerate(zip(spec.layer_types, spec.mlp_types)):
            p = f"model.layers.{i}."
            attn = (KdaLayer(spec, w, p + "self_attn.", plan, pool.tensors[i], chunked) if mixer == KDA
                    else MlaLayer(spec, w, p + "self_attn.", plan, pool.tensors[i]))
            mlp = DenseMlp(w, p + "mlp.", plan) if ffn == DENSE else MoeMlp(spec, w, p + "mlp.", plan)
            self.layers.append((mixer, w[p + "input_layernorm.weight"], attn, w[p + "post_attention_layernorm.weight"], mlp))
        self.key_positions = torch.arange(max_positions, device=device)
        self.row_ids = torch.arange(plan.max_running, device=device)
        # our C decode step (decode_step=native; its forward: prefill_step=native) over the same weights' float32
        # values and the pool's memory
        self.native_step = self.native_decode = self.native_prefill = None
        if plan.decode_step != "eager" or plan.prefill_step != "torch":
            self.native_step = cpu_kernels.KimiDecodeStep(spec, w, pool.tensors, LATENT_NORM_EPS, L2NORM_EPS)
            self.native_decode = self.native_step if plan.decode_step == "native" else None
            self.native_prefill = self.native_step if plan.prefill_step != "torch" else None

    def _block(self, x: torch.Tensor, mix) -> torch.Tensor:
        for mixer, norm_in, attn, norm_post, mlp in self.layers:
            x = x + mix(mixer, attn, _rmsnorm(x, norm_in, self.eps))
            x = x + mlp(_rmsnorm(x, norm_post, self.eps))
        return _rmsnorm(x, self.norm, self.eps) @ self.head

    def prefill(self, row: int, prompt: tuple[int, ...]) -> torch.Tensor:
        """The prompt into `row` from position 0; the logits [1, V] of its last position."""
        return self.prefill_rows([row], [prompt])

    def prefill_rows(self, rows: list[int], prompts: list[tuple[int, ...]]) -> torch.Tensor:
        """Prompts into their rows of `rows` from position 0, in one forward: their tokens packed for the
        projections, norms and experts (`Ragged`); logits [n, V] of each one's last position (every layer needs
        all positions, the next one reads them; the head only the last)."""
        if self.native_prefill is not None:
            return self._prefill_by_forward(rows, prompts)
        batch = Ragged.of([len(p) for p in prompts], self.device)
        x = self.embed[torch.tensor([t for p in prompts for t in p], device=self.device)]  # [N, D]
        for mixer, norm_in, attn, norm_post, mlp in self.layers:
            x = x + attn.prefill_rows(_rmsnorm(x, norm_in, self.eps), rows, batch)
            x = x + mlp(_rmsnorm(x, norm_post, self.eps))
        return _rmsnorm(x[batch.last], self.norm, self.eps) @ self.head

    def _prefill_by_forward(self, rows: list[int], prompts: list[tuple[int, ...]]) -> torch.Tensor:
        """`prefill_rows` by the C step's forward (`_forward`): each prompt's last logits [n, V]."""
        return self._forward(rows, prompts, [0] * len(prompts))

    def _forward(self, rows: list[int], parts: list[tuple[int, ...]], starts: list[int]) -> torch.Tensor:
        """Segments through the C step's forward, PREFILL_CHUNK tokens a call: parts[i] at positions [starts[i], ...)
        of rows[i] (packed in order, a part split across calls where a chunk ends inside it; one from position 0
        starts from a zeroed state): each part's last logits [n, V]."""
        x = self.embed[torch.tensor([t for p in parts for t in p])]  # [N, D]
        ends = torch.tensor([len(p) for p in parts]).cumsum(0).tolist()
        logits: list[torch.Tensor | None] = [None] * len(parts)
        for a in range(0, ends[-1], PREFILL_CHUNK):
            b = min(a + PREFILL_CHUNK, ends[-1])
            pieces = [(i, max(a, end - len(p)), min(b, end)) for i, (p, end) in enumerate(zip(parts, ends))
                      if end - len(p) < b and a < end]  # (part, its tokens [lo, hi) of [a, b))
            out = self.native_prefill.forward(x[a:b], [rows[i] for i, _, _ in pieces],
                                              [starts[i] + lo - (ends[i] - len(parts[i])) for i, lo, _ in pieces],
                                              [hi - lo for _, lo, hi in pieces])
            for (i, _, hi), row_logits in zip(pieces, out):
                if hi == ends[i]:
                    logits[i] = row_logits
        return torch.stack(logits)

    def mixed(self, tokens: list[int], positions: list[int], rows: list[int],
              prompts: list[tuple[int, ...]]) -> torch.Tensor:
        """A decode step of rows [0, n) (tokens at positions) and prompts into `rows` from position 0, in the C
        step's forward calls (the decode rows in the first): logits [n + len(prompts), V], the decode rows' first."""
        n = len(tokens)
        return self._forward(list(range(n)) + rows, [(t,) for t in tokens] + list(prompts),
                             list(positions) + [0] * len(prompts))

    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Rows [0, n) each feed tokens[r] at positions[r]; logits [n, V]."""
        n, S = len(tokens), max(positions) + 1
        pos = torch.tensor(positions, device=self.device)
        if self.native_decode is not None:
            return self.native_decode(self.embed[torch.tensor(tokens)], pos)
        rows = self.row_ids[:n]
        mask = (self.key_positions[:S] <= pos[:, None])[:, None, None]  # [n, 1, 1, S]: each row's own positions
        x = self.embed[torch.tensor(tokens, device=self.device)]  # [n, D]
        return self._block(x, lambda mixer, attn, h: attn.decode(h, rows, pos) if mixer == KDA
                           else attn.decode(h, rows, pos, mask))


# ---------------------------------------------------------------------------------------------- the generator
def _check_whole(chunks: list[tuple[int, ...]], positions: list[int], picks: list[Pick | None]) -> None:
    """ValueError unless every chunk is a whole prompt: from position 0, its last token picking the next."""
    if any(positions) or None in picks:
        raise ValueError(f"KimiModel prefills whole prompts from position 0 (prefill='whole'), got chunks of "
                         f"{[len(c) for c in chunks]} tokens at positions {positions}")


class KimiRunner:
    """The model as the shared scheduler's runner (`evo.workloads.generation_core.ModelRunner`): a whole prompt
    from position 0, one decode step of rows [0, n); tokens by `pick_tokens`, read from this module when called
    (so a test that patches it here sees every logits row)."""

    def __init__(self, model: KimiModel) -> None:
        self.model = model

    def prefill(self, row: int, tokens: tuple[int, ...], pos: int, pick: Pick | None) -> int | None:
        return self.prefill_rows([row], [tokens], [pos], [pick])[0]

    def prefill_rows(self, rows: list[int], chunks: list[tuple[int, ...]], positions: list[int],
                     picks: list[Pick | None]) -> list[int | None]:
        _check_whole(chunks, positions, picks)
        return pick_tokens(self.model.prefill_rows(rows, chunks), picks)

    def decode(self, tokens: list[int], positions: list[int], picks: list[Pick]) -> list[int]:
        return pick_tokens(self.model.decode(tokens, positions), picks)

    def mixed(self, tokens: list[int], positions: list[int], picks: list[Pick], rows: list[int],
              chunks: list[tuple[int, ...]], starts: list[int],
              prefill_picks: list[Pick | None]) -> tuple[list[int], list[int | None]]:
        _check_whole(chunks, starts, prefill_picks)
        picked = pick_tokens(self.model.mixed(tokens, positions, rows, chunks), list(picks) + list(prefill_picks))
        return picked[:len(tokens)], picked[len(tokens):]


class KimiGenerator(Scheduler):
    """`add`, `step`, `abort` (the generation contract): the shared scheduler over the state pool and the model,
    continuous batching of whole prefills (every admitted request prefilled in its first step)."""

    def __init__(self, model: KimiModel, pool: StatePool, plan: KimiPlan, max_positions: int) -> None:
        self.model, self.plan = model, plan
        policy = SchedulerPolicy("continuous", plan.max_running, "whole", 0, plan.max_running,
                                 prefill_together=plan.prefill_rows == "together",
                                 prefill_with_decode=plan.prefill_step == "with_decode")
        super().__init__(KimiRunner(model), pool, policy, max_positions, plan.threads, torch.inference_mode)


CHUNKED_KDA_GENES = {"exponent_form": "pairwise", "chunk_size": 16}  # the rest: the KDA space's default
# pairwise: the KDA workload's factored exponent forms are stable only for log decays g >= -5, and this model's
# forget gate reaches -40 (-exp(A_log) softplus(...), A_log up to log 16): they gave NaN there (measured: T=256,
# g ~ -40 U(0, 1): factored_subchunk NaN, pairwise C=16 error 1e-7 in 40 ms, C=64 8e-7 in 140 ms)


def _chunked_kda(preset: KimiPreset, device: DeviceInfo, **kda_genes):
    """The KDA workload's engine for this model's heads (CHUNKED_KDA_GENES, with the genome's KDA genes): q, k,
    v, g, beta in (it normalises q and k itself), o and the final state out, float32."""
    from evo.workloads.kda.engine import build as build_kda
    from evo.workloads.kda.genes import gene_space as kda_gene_space

    s = preset.model
    kda_preset = Preset(f"{preset.name}:kda", {"B": 1, "T": preset.max_positions, "H": s.kda_heads,
                                               "K": s.kda_head_dim, "V": s.kda_head_dim}, "float32", device.kind)
    return build_kda(kda_gene_space(kda_preset, device).make({**CHUNKED_KDA_GENES, **kda_genes}), kda_preset, device)


def build(genome: Genome, preset: KimiPreset, device: DeviceInfo,
          sources: Mapping[str, str] = NO_SOURCES) -> KimiGenerator:
    """Validate `genome` (GenomeError propagates), load the weights and compose the generator."""
    genome = gene_space(preset, device).validate(genome)
    plan = KimiPlan.from_genome(genome)
    torch_device = torch.device("cuda" if device.kind == "cuda" else "cpu")
    dtype = getattr(torch, preset.dtype)
    if plan.kda_kernel == "native":
        try:
            cpu_kernels.check_recurrence_supported(preset.model.kda_head_dim, preset.model.kda_head_dim, torch_device)
        except cpu_kernels.KernelUnavailable as e:
            raise ValueError(f"kda_kernel='native': {e}; use kda_kernel=torch") from None
    for gene, other in (("decode_step", "eager"), ("prefill_step", "torch")):
        if getattr(plan, gene) != other:
            try:
                cpu_kernels.check_kimi_step_supported(preset.model, dtype, torch_device)
            except cpu_kernels.KernelUnavailable as e:
                raise ValueError(f"{gene}={getattr(plan, gene)!r}: {e}; use {gene}={other}") from None
    pool = StatePool(preset.model, plan, preset.max_positions, dtype, torch_device)
    chunked = (_chunked_kda(preset, device, chunk_size=plan.chunk_size, intra_algorithm=plan.intra_algorithm)
               if plan.kda_prefill == "chunked" else None)
    model = KimiModel(preset.model, plan, pool, load_weights(preset.model), preset.max_positions, dtype, torch_device,
                      chunked)
    return KimiGenerator(model, pool, plan, preset.max_positions)


__all__ = ["KimiGenerator", "KimiModel", "KimiRunner", "StatePool", "build", "pick_tokens"]
