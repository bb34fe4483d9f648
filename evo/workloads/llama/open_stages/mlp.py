"""Open stage `mlp` of the Llama engine: the SwiGLU feed-forward, down(silu(gate(h)) * up(h)).

Entry point: mlp(h, w, plan) -> [..., D].
  h [..., D] the normed residual stream in the activation dtype
  w a dict of this layer's weights: with plan.fused_gate_up, w["gate_up"] (gate then up stacked on the
    output axis); else w["gate"] and w["up"]; and w["down"]. With plan.weight_layout == "pretransposed"
    each is [in, out] (use h @ W); with "native" each is [out, in] (use torch.nn.functional.linear(h, W));
    with "native_left" each is [out, in] too (use (W @ h^T)^T over h's rows).
    With plan.weight_quant == "int8" (weight_layout then unread) each is an int8 weight: W(x) multiplies
    x [..., in] -> [..., out] by the engine's int8 kernel; W.q int8 [out, in] and W.scale [out] (the activation
    dtype) are its rows and per-row scales, the weight being q * scale[:, None].
    With plan.linear_kernel other than "torch" (weight_layout then unread) each is a packed weight: W(x)
    multiplies x [..., in] -> [..., out] by that CPU kernel.
  plan: a frozen dataclass of the genome's decisions; read its attributes, never import it.
Imports allowed: torch, math, numpy.
"""
import torch


def mlp(h, w, plan):
    # EVOLVE-BLOCK-START
    def proj(x, W):
        if plan.weight_quant == "int8" or plan.linear_kernel != "torch":
            return W(x)
        if plan.weight_layout == "pretransposed":
            return x @ W
        if plan.weight_layout == "native_left":
            rows = x.reshape(-1, x.shape[-1])
            return torch.mm(W, rows.t()).t().reshape(*x.shape[:-1], W.shape[0])
        return torch.nn.functional.linear(x, W)

    if plan.fused_gate_up:
        gate, up = proj(h, w["gate_up"]).chunk(2, -1)
    else:
        gate, up = proj(h, w["gate"]), proj(h, w["up"])
    return proj(torch.nn.functional.silu(gate).mul_(up), w["down"])
    # EVOLVE-BLOCK-END
