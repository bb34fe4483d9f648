"""Open stage `norm` of the Llama engine: RMSNorm, optionally after adding a residual.

Entry point: norm(x, residual, weight, eps, plan) -> (normed, new_x).
  x        [..., D] the residual stream, in the engine's activation dtype
  residual [..., D] a branch output to add to x first, or None
  weight   [D] the norm's weight; eps a float
  new_x = x + residual (or x itself when residual is None); normed = new_x / sqrt(mean(new_x^2) + eps) * weight
  plan: a frozen dataclass of the genome's decisions; read its attributes (norm_fused_residual), never import it.
When plan.norm_fused_residual, new_x may be written into x in place (x is the engine's own buffer).
Accumulate the mean in float32 at least. Imports allowed: torch, math, numpy.
"""
import torch


def norm(x, residual, weight, eps, plan):
    # EVOLVE-BLOCK-START
    if residual is not None:
        x = x.add_(residual) if plan.norm_fused_residual else x + residual
    if x.dtype == torch.float32:  # no conversions to pay for
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps), x
    normed = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)
    return normed.to(x.dtype), x
    # EVOLVE-BLOCK-END
