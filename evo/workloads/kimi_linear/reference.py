"""The Kimi Linear oracle: float64, layer by layer, as plain as the math; judge-only (an engine's process
never loads it). Written from transformers 5.24's `modeling_kimi_linear.py`, checked against it in
tests/test_kimi_linear_reference.py; it imports nothing of transformers.

For a sequence of T tokens, x = embed[tokens] [T, D], then per layer
    x = x + mixer(rmsnorm(x) * w_in) ;  x = x + ffn(rmsnorm(x) * w_post)
and logits = (rmsnorm(x) * w_final) W_head^T [T, V]. The mixers:

KDA (`linear_attention`), H heads of K = V dims:
    q, k, v = silu(causal_conv([x Wq^T | x Wk^T | x Wv^T]))   (depthwise, `conv_kernel` taps, zero history)
    g = -exp(A_log_h) softplus((x Wfa^T) Wfb^T + dt_bias)      [T, H, K], log decay per channel
    beta = sigmoid(x Wb^T)                                     [T, H]
    o = the KDA recurrence (evo.workloads.kda.reference.recurrent_kda, token by token: q, k l2-normalised,
        q scaled by K^-0.5, S <- diag(exp g_t) S, S <- S + beta_t k_t (v_t - S^T k_t)^T, o_t = S^T q_t)
    out = (rmsnorm_per_head(o) * w_onorm * sigmoid((x Wga^T) Wgb^T)) Wo^T
MLA (`full_attention`), Hm heads, no rotary embedding anywhere (NoPE):
    q = x Wq^T (or (rmsnorm(x Wqa^T) * w_qa) Wqb^T)            [T, Hm, nope + rope]
    [c, k_rope] = x Wkva^T ;  [k_nope, v] = (rmsnorm(c) * w_kva) Wkvb^T  per head; k = [k_nope, k_rope] (k_rope
    shared by every head) ;  o_t = softmax_{s <= t}(q_t k_s / sqrt(nope + rope)) v_s ;  out = o Wo^T
The feed-forwards: dense = (silu(x Wg^T) * x Wu^T) Wd^T; sparse (MoE) = shared(x) + sum over the chosen experts
e of w_e expert_e(x), with s = sigmoid(x Wr^T) [E], the choice made on s + bias: the n_group groups scored by
the sum of their top two, the best topk_group groups kept, the top_k experts among them; w_e = s_e (divided
by their sum + 1e-20 when renormalised) times routed_scaling_factor.

The same computation runs at a lower `Precision` too (`Workload.honest_logits`, llama_serve's `Precision`):
weights and activations in its `act` dtype, and in its `wide` one (float32) what this workload's engine
(`evo.workloads.kimi_linear.engine`) keeps wider at a bfloat16 preset, and nothing more: the weights it keeps in
float32 (FP32_TENSORS: the router, its bias, dt_bias); KDA's q, k, v after the convolution, its gates g and
beta and the recurrence (o returns to `act` before its norm); MLA's scores and softmax (its SDPA accumulates
them in float32; the probabilities meet v in `act`); the MoE router, scored in float32 from the `act`
activations, its weights renormalised there (+ 1e-20 stays finite) and rounded to `act` before they scale the
experts. RMSNorms run in `act`, as the engine's do (transformers' normalise in float32). The oracle is the
float64 precision, whose every conversion is a no-op.
"""
from __future__ import annotations

import functools
import itertools
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from evo.workloads.kda.reference import recurrent_kda
from evo.workloads.kimi_linear.model import DENSE, FP32_TENSORS, KDA, LATENT_NORM_EPS, KimiSpec, load_weights
from evo.workloads.kimi_linear.presets import KimiPreset
from evo.workloads.llama_serve.reference import FLOAT64, Precision


@functools.lru_cache(maxsize=2)
def float64_weights(spec: KimiSpec) -> dict[str, torch.Tensor]:
    """The model's weights in float64, converted once per judge process (the last two models kept)."""
    return {name: w.to(torch.float64) for name, w in load_weights(spec).items()}


@functools.lru_cache(maxsize=2)
def _rounded_weights(spec: KimiSpec, precision: Precision) -> dict[str, torch.Tensor]:
    """The model's weights in the precision's `act` dtype, FP32_TENSORS in its `wide` one (as the engine keeps
    them), converted once per judge process (the last two kept)."""
    return {name: w.to(precision.wide if name.endswith(FP32_TENSORS) else precision.act)
            for name, w in load_weights(spec).items()}


def weights_in(spec: KimiSpec, precision: Precision) -> dict[str, torch.Tensor]:
    """The oracle's float64 weights, or the model's weights at a lower precision (`_rounded_weights`)."""
    return float64_weights(spec) if precision.act == torch.float64 else _rounded_weights(spec, precision)


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def _causal_conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution: x [T, C], w [C, taps] -> out[t] = sum_j w[:, j] x[t - taps + 1 + j]
    (positions before 0 are zero)."""
    taps = w.shape[1]
    padded = F.pad(x, (0, 0, taps - 1, 0))  # [T + taps - 1, C]
    return sum(w[:, j] * padded[j: j + x.shape[0]] for j in range(taps))


def _kda(spec: KimiSpec, w: dict, p: str, x: torch.Tensor, pr: Precision = FLOAT64) -> torch.Tensor:
    T, H, K = x.shape[0], spec.kda_heads, spec.kda_head_dim
    qkv = torch.cat([x @ w[p + n + "_proj.weight"].T for n in ("q", "k", "v")], -1)  # [T, 3HK]
    qkv = F.silu(_causal_conv(qkv, w[p + "conv1d.weight"][:, 0])).to(pr.wide)
    q, k, v = (z.reshape(1, T, H, K) for z in qkv.split(H * K, -1))  # [1, T, H, K]
    f = ((x @ w[p + "forget_gate.f_a_proj.weight"].T) @ w[p + "forget_gate.f_b_proj.weight"].T).to(pr.wide)  # [T, HK]
    # softplus: its default threshold (x > 20 -> x) is transformers' too
    g = (-w[p + "forget_gate.A_log"].to(pr.wide).exp().reshape(H, 1)
         * F.softplus(f + w[p + "forget_gate.dt_bias"]).view(T, H, K))
    beta = torch.sigmoid((x @ w[p + "b_proj.weight"].T).to(pr.wide))  # [T, H]
    o = recurrent_kda({"q": q, "k": k, "v": v, "g": g[None], "beta": beta[None]}, pr.wide)["o"][0]  # [T, H, K]
    gate = ((x @ w[p + "g_a_proj.weight"].T) @ w[p + "g_b_proj.weight"].T).view(T, H, K)
    o = _rmsnorm(o.to(pr.act), w[p + "o_norm.weight"], spec.rms_eps) * torch.sigmoid(gate)
    return o.reshape(T, H * K) @ w[p + "o_proj.weight"].T


def _mla(spec: KimiSpec, w: dict, p: str, x: torch.Tensor, pr: Precision = FLOAT64) -> torch.Tensor:
    T, H, nope, R = x.shape[0], spec.mla_heads, spec.qk_nope_dim, spec.kv_lora_rank
    if spec.q_lora_rank is None:
        q = x @ w[p + "q_proj.weight"].T
    else:
        q_latent = _rmsnorm(x @ w[p + "q_a_proj.weight"].T, w[p + "q_a_layernorm.weight"], LATENT_NORM_EPS)
        q = q_latent @ w[p + "q_b_proj.weight"].T
    q = q.view(T, H, spec.qk_head_dim)  # [T, H, nope + rope]
    latent, k_rope = (x @ w[p + "kv_a_proj_with_mqa.weight"].T).split([R, spec.qk_rope_dim], -1)  # [T, R], [T, rope]
    kv = (_rmsnorm(latent, w[p + "kv_a_layernorm.weight"], LATENT_NORM_EPS) @ w[p + "kv_b_proj.weight"].T)
    k_nope, v = kv.view(T, H, nope + spec.v_head_dim).split([nope, spec.v_head_dim], -1)  # [T, H, nope], [T, H, dv]
    k = torch.cat([k_nope, k_rope[:, None].expand(T, H, spec.qk_rope_dim)], -1)  # [T, H, nope + rope]
    scores = torch.einsum("thd,shd->hts", q.to(pr.wide), k.to(pr.wide)) * spec.qk_head_dim**-0.5  # [H, T, T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1).to(pr.act)
    o = torch.einsum("hts,shd->thd", probs, v)  # [T, H, dv]
    return o.reshape(T, H * spec.v_head_dim) @ w[p + "o_proj.weight"].T


def _moe(spec: KimiSpec, w: dict, p: str, x: torch.Tensor, route: _Routing, pr: Precision = FLOAT64) -> torch.Tensor:
    T, E, G = x.shape[0], spec.experts, spec.expert_groups
    scores = torch.sigmoid(x.to(pr.wide) @ w[p + "gate.weight"].T)  # [T, E]: gate.weight is wide (FP32_TENSORS)
    choice = scores + w[p + "gate.e_score_correction_bias"]
    group_score = choice.view(T, G, E // G).topk(2, -1).values.sum(-1)  # [T, G]
    kept = torch.zeros(T, G, dtype=torch.bool)
    kept.scatter_(1, group_score.topk(spec.topk_groups, -1).indices, True)
    choice = choice.masked_fill(~kept.repeat_interleave(E // G, 1), float("-inf"))
    ranked = choice.topk(min(spec.top_k + 1, E), -1)  # the chosen and the first left out
    chosen = route.choose(ranked, spec.top_k)  # [T, top_k]
    weight = scores.gather(1, chosen)  # the scores, not the biased choice
    if spec.renormalize:
        weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
    weight = (weight * spec.routed_scaling).to(pr.act)
    out = _swiglu(x, w[p + "shared_experts.gate_proj.weight"], w[p + "shared_experts.up_proj.weight"],
                  w[p + "shared_experts.down_proj.weight"])
    I = spec.moe_intermediate
    for e in range(E):
        rows, slot = (chosen == e).nonzero(as_tuple=True)
        if rows.numel():
            gate_up = w[p + "experts.gate_up_proj"][e]  # [2I, D]: gate rows, then up rows
            y = _swiglu(x[rows], gate_up[:I], gate_up[I:], w[p + "experts.down_proj"][e])
            out = out.index_add(0, rows, weight[rows, slot, None] * y)
    return out


class _Routing:
    """One MoE layer's choice of experts: the top_k by the float64 choice scores, except at the `flips` positions,
    where the last chosen expert gives way to the first left out; the positions whose gap between those two is
    under `tie` are noted in `ties` as (gap, position)."""

    def __init__(self, flips: frozenset[int] = frozenset(), tie: float = 0.0) -> None:
        self.flips, self.tie, self.ties = flips, tie, []

    def choose(self, ranked, top_k: int) -> torch.Tensor:
        chosen = ranked.indices[:, :top_k].clone()
        if ranked.values.shape[1] > top_k:
            gap = ranked.values[:, top_k - 1] - ranked.values[:, top_k]  # -inf beyond the kept groups: no tie
            self.ties += [(float(gap[t]), t) for t in (gap < self.tie).nonzero()[:, 0].tolist()]
            for t in self.flips:
                if t < len(chosen):  # a flip beyond this sequence's positions (a shorter prefix) waits for them
                    chosen[t, top_k - 1] = ranked.indices[t, top_k]
        return chosen


def logits(spec: KimiSpec, weights: dict[str, torch.Tensor], tokens: torch.Tensor,
           routing: dict[int, _Routing] | None = None, precision: Precision = FLOAT64) -> torch.Tensor:
    """Teacher-forced logits [T, V] of token ids [T]: row t predicts token t + 1, computed in `precision` (the
    oracle: float64), with `weights` in it (`weights_in`); `routing`: per MoE layer index, its `_Routing`
    (default: the top_k everywhere)."""
    w, eps, routing, pr = weights, spec.rms_eps, routing or {}, precision
    x = w["model.embed_tokens.weight"][tokens.cpu()]  # [T, D]
    with torch.inference_mode():
        for i, (mixer, ffn) in enumerate(zip(spec.layer_types, spec.mlp_types)):
            p = f"model.layers.{i}."
            h = _rmsnorm(x, w[p + "input_layernorm.weight"], eps)
            x = x + (_kda if mixer == KDA else _mla)(spec, w, p + "self_attn.", h, pr)
            h = _rmsnorm(x, w[p + "post_attention_layernorm.weight"], eps)
            if ffn == DENSE:
                x = x + _swiglu(h, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"], w[p + "mlp.down_proj.weight"])
            else:
                x = x + _moe(spec, w, p + "mlp.", h, routing.get(i) or _Routing(), pr)
        return _rmsnorm(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].T


def continuation_logits(preset: KimiPreset, prompt: Sequence[int], tokens: Sequence[int],
                        dtype: str = "float64") -> np.ndarray:
    """Float64 logits [len(tokens), V]: row i predicts tokens[i] from the prompt and tokens[:i]; computed in
    `dtype` (a `Precision`'s name; the oracle: float64), returned as float64 numbers."""
    precision = Precision.named(dtype)
    if not len(tokens):
        return np.zeros((0, preset.model.vocab))
    return _continuation(preset.model, prompt, tokens, precision=precision)


def _continuation(spec: KimiSpec, prompt: Sequence[int], tokens: Sequence[int],
                  routing: dict[int, _Routing] | None = None, precision: Precision = FLOAT64) -> np.ndarray:
    """`logits` teacher-forced over the prompt and tokens[:-1], the rows that predict `tokens` (non-empty)."""
    ids = torch.tensor([*prompt, *tokens[:-1]], dtype=torch.long)
    out = logits(spec, weights_in(spec, precision), ids, routing, precision)[len(prompt) - 1:]
    return out.to(torch.float64).numpy()


# The gap between the last chosen expert's choice score and the first left out's under which an engine's rounding
# may pick the other one: float32 scores sit within ~1e-6 of float64's at these presets (the router is float32 in
# every engine), so 1e-4 bounds them with room; bfloat16 activations move scores by ~1e-2.
ROUTING_TIE = {"float32": 1e-4, "bfloat16": 2e-2}
MAX_READINGS = 8  # other readings tried for one request: the single flips of the nearest ties, then pairs


def continuation_alternatives(preset: KimiPreset, prompt: Sequence[int], tokens: Sequence[int]) -> Iterator[np.ndarray]:
    """`continuation_logits` under other routings of the same tokens: each MoE choice whose gap is under
    ROUTING_TIE[dtype] flipped alone (the nearest ties first), then two at a time; at most MAX_READINGS."""
    spec = preset.model
    if not len(tokens):
        return
    tie = ROUTING_TIE.get(preset.dtype, ROUTING_TIE["bfloat16"])
    noted = {i: _Routing(tie=tie) for i, ffn in enumerate(spec.mlp_types) if ffn != DENSE}
    _continuation(spec, prompt, tokens, noted)
    nearest = [(layer, t) for _, layer, t in sorted((gap, layer, t) for layer, route in noted.items()
                                                     for gap, t in route.ties)]
    readings = itertools.chain(((choice,) for choice in nearest), itertools.combinations(nearest, 2))
    for flips in itertools.islice(readings, MAX_READINGS):  # pairs drawn only as far as they are read
        routing = {layer: _Routing(frozenset(t for l, t in flips if l == layer)) for layer in noted}
        yield _continuation(spec, prompt, tokens, routing)
