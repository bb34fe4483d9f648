"""Open stage `attention` of the Llama engine: grouped-query causal attention over the KV cache.

Entry point: attention(q, k, v, mask, plan) -> [B, H, T, d].
  q [B, H, T, d]: the T new positions' queries, rotary applied (the activation dtype)
  k, v [B, KVH, S, d]: the cache's keys and values up to S positions (the KV dtype; may be strided views)
  mask: None -> causal with the queries at the last T of the S positions (query i sees keys 0..S-T+i);
        else an additive float mask [T, S] (0 where visible, -inf where not) to use as given
  Each query head h reads KV head h // (H // KVH). Scale 1/sqrt(d).
  plan: a frozen dataclass of the genome's decisions; read its attributes (attention: "sdpa" or "matmul"),
  never import it.
Imports allowed: torch, math, numpy.
"""
import torch


def attention(q, k, v, mask, plan):
    # EVOLVE-BLOCK-START
    B, H, T, d = q.shape
    KVH, S = k.shape[1], k.shape[2]
    if mask is None and T > 1:
        mask = torch.full((T, S), float("-inf"), dtype=q.dtype, device=q.device).triu(S - T + 1)
    dtype = q.dtype
    if plan.attention == "sdpa" and k.dtype == torch.bfloat16 and q.dtype == torch.float32:
        # a bfloat16 cache read as it is (SDPA accumulates in float32): the queries narrowed, not the whole cache widened
        q, mask = q.to(k.dtype), mask if mask is None else mask.to(k.dtype)
    elif k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    if plan.attention == "sdpa":
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=bool(KVH != H))
        return out.to(dtype)
    G = H // KVH
    qg = q.reshape(B, KVH, G * T, d)  # the group's query heads share one KV head
    scores = (qg @ k.transpose(-1, -2)).mul_(d**-0.5).view(B, KVH, G, T, S)
    if mask is not None:
        scores = scores + mask
    probs = scores.softmax(-1).view(B, KVH, G * T, S)
    return (probs @ v).view(B, H, T, d)
    # EVOLVE-BLOCK-END
