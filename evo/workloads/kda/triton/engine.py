"""The Triton KDA engine: a plan of kernel choices (genes) and the launches that follow from it."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from evo.workloads.kda.reference import L2NORM_EPS

DOT_CODES = {"float32": 0, "tfloat32": 1, "bfloat16": 2}  # compute_dtype gene -> kernels' DOT


@dataclass(frozen=True)
class TritonPlan:
    """What the kernels read: chunk size C, V tile, launch shape, dot operands, state layout, fusion."""

    chunk_size: int  # tokens per chunk C (16, 32, 64, 128)
    block_v: int  # V tile of the recurrence/output programs
    num_warps: int
    num_stages: int
    compute_dtype: str  # dot operands: float32 (ieee), tfloat32 or bfloat16; accumulation float32
    state_layout: str  # "kv": state tile [K, BV]; "vk": [BV, K]
    fuse_prepare: bool  # prepare (cumsum, l2norm) inside the intra kernel
    fuse_output: bool  # output inside the recurrence kernel
    preallocate_outputs: bool = False  # o and final_state in buffers kept per shape (valid until the next call)

    def __post_init__(self) -> None:
        if self.compute_dtype not in DOT_CODES:
            raise ValueError(f"compute_dtype {self.compute_dtype!r} not in {sorted(DOT_CODES)}")
        if self.state_layout not in ("kv", "vk"):
            raise ValueError(f"state_layout {self.state_layout!r} not in ['kv', 'vk']")
        if self.chunk_size % 16 or self.block_v < 16:
            raise ValueError(f"chunk_size {self.chunk_size} must be a multiple of 16 and block_v {self.block_v} >= 16")


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU (TRITON_INTERPRET=1, read when kernels are decorated)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def _pow2(n: int) -> int:
    return max(16, 1 << (max(1, n) - 1).bit_length())


class TritonKdaEngine:
    """engine(q, k, v, g, beta, initial_state=None) -> {"o": [B,T,H,V] input dtype, "final_state": [B,H,K,V] float32}.

    Kernels: prepare (unless fused into intra), intra, recurrence (+ output when fused), output."""

    num_threads = None  # GPU engine: the evaluator sets no CPU thread count

    def __init__(self, plan: TritonPlan, kernels=None) -> None:
        """`kernels`: a module with the kernels' names and arguments (a genome's code_triton source);
        None: this package's hand-written kernels."""
        if kernels is None:
            from evo.workloads.kda.triton import kernels  # imports triton; decorates the kernels

        self.plan = plan
        self._k = kernels
        self._outputs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, q, k, v, g, beta, initial_state=None) -> dict:
        p, kn = self.plan, self._k
        if q.device.type != "cuda" and not interpreting():
            raise RuntimeError(f"the Triton engine needs a CUDA device or TRITON_INTERPRET=1, got {q.device}")
        B, T, H, K = q.shape  # q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]
        V, C = v.shape[-1], p.chunk_size
        N = -(-T // C)
        Tp, BH, dev = N * C, B * H, q.device
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        BK, BVF, BV = _pow2(K), _pow2(V), min(p.block_v, _pow2(V))
        dot = DOT_CODES[p.compute_dtype]
        sdot = DOT_CODES["tfloat32"] if p.compute_dtype == "bfloat16" else dot  # products with the fp32 state
        ws_dtype = torch.bfloat16 if p.compute_dtype == "bfloat16" else torch.float32
        launch = {"num_warps": p.num_warps, "num_stages": p.num_stages}
        scale = K**-0.5
        assert L2NORM_EPS == 1e-6  # the kernels write it inline
        if p.fuse_prepare:
            qn = kn_ = Gw = q  # unused pointers
        else:
            qn, kn_, Gw = (torch.empty(BH, Tp, K, dtype=torch.float32, device=dev) for _ in range(3))
            kn.prepare_kernel[(N, BH)](q, k, g, qn, kn_, Gw, T, Tp, scale, H=H, K=K, BT=C, BK=BK, **launch)
        # W, Qg, Kd meet the float32 state: kept float32 (bf16 copies cost ~1e-2 relative error)
        W, Qg, Kd = (torch.empty(BH, Tp, K, dtype=torch.float32, device=dev) for _ in range(3))
        U0 = torch.empty(BH, Tp, V, dtype=torch.float32, device=dev)
        M = torch.empty(BH, Tp, C, dtype=ws_dtype, device=dev)
        gam = torch.empty(BH, N, K, dtype=torch.float32, device=dev)  # exp(G_C) per chunk
        kn.intra_kernel[(N, BH)](q, k, g, v, beta, qn, kn_, Gw, W, U0, M, Qg, Kd, gam, T, Tp, scale,
                                 H=H, K=K, V=V, BT=C, BK=BK, BVF=BVF, SB=min(kn.SUB, C),
                                 FUSED_PREPARE=p.fuse_prepare, DOT=dot, SDOT=sdot, **launch)
        o, ht = self._output_buffers(B, T, H, K, V, q.dtype, dev)  # [B, T, H, V], [B, H, K, V] float32
        h0 = initial_state.float().contiguous() if initial_state is not None else ht
        if p.fuse_output:
            Us = Ss = ht  # unused pointers
        else:
            Us = torch.empty(BH, Tp, V, dtype=torch.float32, device=dev)
            Ss = torch.empty(BH, N, K, V, dtype=torch.float32, device=dev)
        vt = -(-V // BV)
        kn.recurrence_kernel[(vt, BH)](W, U0, Kd, gam, Qg, M, h0, o, ht, Us, Ss, T, Tp, N,
                                       H=H, K=K, V=V, BT=C, BK=BK, BV=BV, HAS_H0=initial_state is not None,
                                       FUSED_OUTPUT=p.fuse_output, STATE_VK=p.state_layout == "vk", DOT=dot,
                                       SDOT=sdot, **launch)
        if not p.fuse_output:
            kn.output_kernel[(vt, N, BH)](Qg, M, Us, Ss, o, T, Tp, N, H=H, K=K, V=V, BT=C, BK=BK, BV=BV,
                                          STATE_VK=p.state_layout == "vk", DOT=dot, SDOT=sdot, **launch)
        return {"o": o, "final_state": ht}

    def _output_buffers(self, B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, dev: torch.device):
        def fresh():
            return (torch.empty(B, T, H, V, dtype=dtype, device=dev),
                    torch.empty(B, H, K, V, dtype=torch.float32, device=dev))

        if not self.plan.preallocate_outputs:
            return fresh()
        key = (B, T, H, K, V, dtype, dev)
        if key not in self._outputs:
            self._outputs[key] = fresh()
        return self._outputs[key]


def plan_from_genome(genome) -> TritonPlan:
    """The Triton plan of a validated genome (engine='triton')."""
    v = genome.values()
    return TritonPlan(
        chunk_size=int(v["chunk_size"]),
        block_v=int(v["block_v"]),
        num_warps=int(v["num_warps"]),
        num_stages=int(v["num_stages"]),
        compute_dtype=str(v["compute_dtype"]),
        state_layout=str(v["state_layout"]),
        fuse_prepare=bool(v["fuse_l2norm_intra"]),
        fuse_output=bool(v["fuse_recurrence_output"]),
        preallocate_outputs=bool(v["preallocate_outputs"]),
    )


def build_triton(genome, kernels=None) -> TritonKdaEngine:
    """The Triton engine of a validated genome (with `kernels` from its code, if it carries any)."""
    return TritonKdaEngine(plan_from_genome(genome), kernels)
