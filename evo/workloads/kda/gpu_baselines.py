"""Baselines that matter on the GPU: flash-linear-attention's Triton KDA kernels (`fla_chunk_kda`,
`fla_fused_recurrent_kda`, when fla-core is importable: the optional `.[fla]` extra), and head
blocking, which lets the pairwise baselines' [.., C, C, K] temporaries fit at the h200 preset."""
from __future__ import annotations

import importlib
import inspect
from typing import Callable

import torch

FLA_KERNELS = {"fla_chunk_kda": "chunk_kda", "fla_fused_recurrent_kda": "fused_recurrent_kda"}
PAIRWISE_BUDGET_BYTES = {"cuda": 8 << 30, "cpu": 2 << 30}  # per head block, all temporaries counted
PAIRWISE_TEMPORARIES = 4  # [B, h, N, C, C, K] float32 tensors alive at once in the pairwise intra pass


def fla_kernels() -> dict[str, Callable]:
    """Baseline name -> fla's KDA kernel, or {} when fla-core (or triton) is not importable."""
    try:
        ops = importlib.import_module("fla.ops.kda")
    except Exception:  # optional extra; fla needs triton and, to run, a GPU
        return {}
    return {name: getattr(ops, fn) for name, fn in FLA_KERNELS.items() if hasattr(ops, fn)}


def fla_engine(kernel: Callable) -> Callable[..., dict]:
    """fla's kernel as an engine: l2norm inside the kernel, scale K**-0.5, final state returned."""
    accepted = set(inspect.signature(kernel).parameters)

    def run(q, k, v, g, beta, initial_state=None) -> dict:
        kw = {"scale": q.shape[-1] ** -0.5, "initial_state": None if initial_state is None else initial_state.float(),
              "output_final_state": True, "use_qk_l2norm_in_kernel": True}
        o, S = kernel(q, k, v, g, beta, **{k_: v_ for k_, v_ in kw.items() if k_ in accepted})
        return {"o": o, "final_state": S}

    return run


def heads_per_block(B: int, T: int, K: int, chunk: int, device: str) -> int:
    """Heads whose pairwise temporaries fit the budget (at least one)."""
    n = -(-T // chunk)
    per_head = PAIRWISE_TEMPORARIES * B * n * chunk * chunk * K * 4
    return max(1, PAIRWISE_BUDGET_BYTES.get(device, PAIRWISE_BUDGET_BYTES["cpu"]) // per_head)


def head_blocked(fn: Callable[..., dict], chunk: int = 64, block: int | None = None) -> Callable[..., dict]:
    """fn over blocks of heads (heads are independent): q, k, v, g, beta split on dim 2, the initial
    state on dim 1; outputs joined the same way. `block` fixes the heads per block (tests)."""

    def run(q, k, v, g, beta, initial_state=None) -> dict:
        B, T, H, K = q.shape
        hb = block or heads_per_block(B, T, K, chunk, q.device.type)
        if hb >= H:
            return fn(q, k, v, g, beta, initial_state)
        outs = []
        for h in range(0, H, hb):
            part = slice(h, h + hb)
            h0 = None if initial_state is None else initial_state[:, part]
            outs.append(fn(q[:, :, part], k[:, :, part], v[:, :, part], g[:, :, part], beta[:, :, part], h0))
        return {"o": torch.cat([o["o"] for o in outs], 2), "final_state": torch.cat([o["final_state"] for o in outs], 1)}

    return run
