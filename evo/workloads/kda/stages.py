"""The stage functions of the chunked (WY/UT) KDA forward, written against chunked tensors.

Chunked tensors are [B, H, N, C, D] (N chunks of C tokens); every function also accepts one chunk
([B, H, C, D]) because it only touches the last two dimensions, which is what lets intra run per
chunk inside the state loop. Within a chunk with start state S0 and inclusive cumulative gate G
(Gamma = exp G):
    A[t,i] = beta_t sum_k k_t k_i exp(G_t - G_i)  (i < t)     M[t,i] = sum_k q_t k_i exp(G_t - G_i)  (i <= t)
    W  = (I + A)^-1 diag(beta) (K * Gamma)        U0 = (I + A)^-1 diag(beta) V
    U  = U0 - W S0     O = (Q * Gamma) S0 + M U     S_next = diag(Gamma_C) S0 + (K * exp(G_C - G))^T U
Each stage takes the context dict and returns the entries it adds; the recurrence's unit is the
per-chunk state update `chunk_step`, which `loop_step` composes with intra and output when they are
fused into the loop. Intra, the state update and output are open (see `open_code.py`): their
hand-written implementations are the seed sources in `open_stages/` (imported here, read as text
there), and a genome may carry source code that replaces them.
"""
from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Callable, Mapping

import torch

from evo.workloads.kda.genes import Plan
from evo.workloads.kda.open_stages import intra as _intra_seed
from evo.workloads.kda.open_stages import output as _output_seed
from evo.workloads.kda.open_stages import recurrence as _recurrence_seed
from evo.workloads.kda.definition import L2NORM_EPS

Ctx = dict
Impl = Mapping[str, Callable]  # stage name -> implementation (see HAND_WRITTEN)


# ---- gate and l2norm -------------------------------------------------------------------------
def gate(ctx: Ctx, plan: Plan) -> Ctx:
    G = ctx["g"].cumsum(-2)  # [B, H, N, C, K] inclusive chunk-local cumulative log decay
    gC = G[..., -1, :]  # [B, H, N, K] log decay over the whole chunk
    return {"G": G, "gC": gC, "gammaC": gC.exp()}


def l2norm(ctx: Ctx, plan: Plan) -> Ctx:
    q, k = ctx["q"], ctx["k"]
    scale = q.shape[-1] ** -0.5
    q = q * (torch.rsqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS) * scale)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)
    return {"q": q, "k": k}


# ---- intra, the per-chunk state update and output: the open stages' seeds (one implementation) ----
# Each is a self-contained source in open_stages/ that a genome's code may replace (open_code.py).
intra = _intra_seed.intra
chunk_step = _recurrence_seed.chunk_step
output = _output_seed.output


def _chunks(ctx: Ctx, names: tuple[str, ...], BH: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per-chunk views of each named chunked tensor: [B, H, N, ...] -> N x [B*H, ...]."""
    return {name: ctx[name].reshape(BH, *ctx[name].shape[2:]).unbind(1) for name in names if name in ctx}


CHUNK_NAMES = ("q", "k", "v", "beta", "G", "gC", "gammaC", "W", "U0", "M", "Qg", "Kd")


def loop_step(c: Ctx, S: torch.Tensor, plan: Plan, impl: Impl, intra_in_loop: bool, output_in_loop: bool) -> Ctx:
    """One chunk of the state loop: intra (when fused into the loop), the state update
    (impl["recurrence"]), then the chunk's output "O" (output_in_loop) or what the batched output
    pass needs ("U", plus "M"/"Qg" when intra ran here)."""
    if intra_in_loop:
        c = {**c, **impl["intra"](c, plan)}
    step = impl["recurrence"](c, S, plan)
    if output_in_loop:
        return {"S": step["S"], "O": impl["output"]({**c, "U": step["U"], "S_starts": S}, plan)["O"]}
    out = {"S": step["S"], "U": step["U"]}
    if intra_in_loop:  # the batched output pass needs what intra made inside the loop
        out["M"] = c["M"]
        if "Qg" in c:
            out["Qg"] = c["Qg"]
    return out


def recurrence(ctx: Ctx, plan: Plan, intra_in_loop: bool, output_in_loop: bool, step=None) -> Ctx:
    """The state loop over chunks. `step` is `loop_step` bound to this plan; a compiled backend
    compiles the step, so the loop is never unrolled into one graph per sequence length. Without
    output_in_loop it hands U and the per-chunk start states to one batched output pass."""
    if step is None:
        step = functools.partial(loop_step, plan=plan, impl=HAND_WRITTEN, intra_in_loop=intra_in_loop,
                                 output_in_loop=output_in_loop)
    B, H = ctx["S0"].shape[:2]
    S = ctx["S0"].reshape(B * H, *ctx["S0"].shape[2:])  # [BH, K, V] float32 ([BH, V, K] for vk)
    chunks = _chunks(ctx, CHUNK_NAMES, B * H)
    collected: dict[str, list[torch.Tensor]] = {}
    for n in range(ctx["G"].shape[2]):
        result = step({name: parts[n] for name, parts in chunks.items()}, S)
        if not output_in_loop:
            collected.setdefault("S_starts", []).append(S)
        S = result.pop("S")
        for name, value in result.items():
            collected.setdefault(name, []).append(value)
    # N x [BH, ...] -> [B, H, N, ...]
    out = {name: torch.stack(parts, 1).unflatten(0, (B, H)) for name, parts in collected.items()}
    out["S_final"] = S.unflatten(0, (B, H))
    return out


# The hand-written implementation of each stage; for the recurrence, its per-chunk state update (the
# loop driver `recurrence` and `loop_step` wrap it). An open stage's code replaces an entry (engine.build).
HAND_WRITTEN: Mapping[str, Callable] = MappingProxyType(
    {"gate": gate, "l2norm": l2norm, "intra": intra, "recurrence": chunk_step, "output": output})
