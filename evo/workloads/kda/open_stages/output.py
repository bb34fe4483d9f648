"""Open stage `output` of the chunked KDA forward: O = (Q * Gamma) S + M U per chunk.

Entry point: output(ctx, plan) -> {"O": [..., C, V] float32}.
  ctx["S_starts"] [..., K, V] float32: the state at each chunk's start ([..., V, K] when
                  plan.state_layout == "vk")
  ctx["U"]        [..., C, V] float32: corrected values from the recurrence
  ctx["M"]        [..., C, C] in the compute dtype: the causal intra-chunk q-k products (lower incl. diagonal)
  ctx["Qg"]       [..., C, K] float32 = q * exp(G), when present (plan.intermediates == "store");
                  otherwise compute it from ctx["q"] and ctx["G"] (both [..., C, K])
The leading dims "..." are [B, H, N] (all chunks in one batched pass) when output is its own stage, and
[B*H] (one chunk) when it runs inside the state loop (fuse_recurrence_output): touch only the trailing dims.
  plan: a frozen dataclass of the genome's decisions; read its attributes (state_layout, compute_dtype,
  intermediates), never import it.
The engine must match a float64 reference to ~1e-5 relative. Imports allowed: torch, math, numpy.
"""
import torch


def output(ctx, plan):
    # EVOLVE-BLOCK-START
    Qg = ctx["Qg"] if "Qg" in ctx else ctx["q"] * ctx["G"].exp()
    S = ctx["S_starts"]
    inter = Qg @ (S.transpose(-1, -2) if plan.state_layout == "vk" else S)  # [..., C, V]
    M = ctx["M"]
    return {"O": inter + (M @ ctx["U"].to(M.dtype)).float()}
    # EVOLVE-BLOCK-END
