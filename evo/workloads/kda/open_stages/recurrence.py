"""Open stage `recurrence` of the chunked KDA forward: the state update of one chunk.

The engine's loop driver walks the chunks in order and calls, per chunk,
chunk_step(c, S, plan) -> {"S": next state, "U": corrected values}.
  S     [BH, K, V] float32: the state at the chunk's start (BH = batch * heads); [BH, V, K] when
        plan.state_layout == "vk". Return the next state in the same layout, shape and dtype.
  c     this chunk's tensors, float32, leading dim BH (a chunk of C tokens):
        c["W"] [BH, C, K], c["U0"] [BH, C, V]  (from the intra stage)
        c["gammaC"] [BH, K]  exp of the chunk's total log decay
        c["Kd"] [BH, C, K] = k * exp(gC - G) when present (plan.intermediates == "store"); otherwise
        compute it from c["k"] [BH, C, K], c["G"] [BH, C, K] and c["gC"] [BH, K]
        (also present, unused here: q, v, beta, M, Qg)
  plan  a frozen dataclass of the genome's decisions; read its attributes (state_layout, intermediates,
        compute_dtype, chunk_size), never import it.
Math, in the kv layout:
  U      = U0 - W S                              [BH, C, V]
  S_next = diag(gammaC) S + Kd^T U               [BH, K, V]
Return {"S": S_next, "U": U}; the output stage then computes O = Qg S + M U from U and this S.
The state carries through the whole sequence, so errors compound: the engine must match a float64
reference to ~1e-5 relative. Imports allowed: torch, math, numpy.
"""
import torch


def chunk_step(c, S, plan):
    # EVOLVE-BLOCK-START
    Kd = c["Kd"] if "Kd" in c else c["k"] * (c["gC"].unsqueeze(-2) - c["G"]).exp()
    if plan.state_layout == "vk":
        U = torch.baddbmm(c["U0"], c["W"], S.transpose(1, 2), alpha=-1)  # U0 - W S: [BH, C, V]
        S_next = torch.baddbmm(S * c["gammaC"].unsqueeze(1), U.transpose(1, 2), Kd)  # [BH, V, K]
    else:
        U = torch.baddbmm(c["U0"], c["W"], S, alpha=-1)
        S_next = torch.baddbmm(S * c["gammaC"].unsqueeze(2), Kd.transpose(1, 2), U)  # [BH, K, V]
    return {"S": S_next, "U": U}
    # EVOLVE-BLOCK-END
