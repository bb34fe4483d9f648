"""The Triton KDA engine: a plan of kernel choices (genes) and the launches that follow from it."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from evo.workloads.kda.definition import L2NORM_EPS

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
    kernels: str = "classic"  # "classic": prepare/intra/recurrence/output as first written; "blocked": the
    # blocked intra (16-row blocks, K tiles), K-split recurrence and parallel output, Qg never stored
    workspace_dtype: str = "float32"  # blocked: dtype of W, Kd, U0, U and the chunk states in memory
    state_operands: str = "tfloat32"  # blocked with bf16 compute: operands of the products with the state
    block_k: int = 64  # blocked: K (and V) tile of intra and output
    output_backend: str = "triton"  # blocked, output not fused: "triton" or "cuda" (CUDA C via CuPy, on CUDA)

    def __post_init__(self) -> None:
        if self.compute_dtype not in DOT_CODES:
            raise ValueError(f"compute_dtype {self.compute_dtype!r} not in {sorted(DOT_CODES)}")
        if self.state_layout not in ("kv", "vk"):
            raise ValueError(f"state_layout {self.state_layout!r} not in ['kv', 'vk']")
        if self.kernels not in ("classic", "blocked"):
            raise ValueError(f"kernels {self.kernels!r} not in ['blocked', 'classic']")
        if self.workspace_dtype not in ("float32", "bfloat16") or self.state_operands not in ("tfloat32", "bfloat16"):
            raise ValueError(f"workspace_dtype {self.workspace_dtype!r} not in ['bfloat16', 'float32'] or"
                             f" state_operands {self.state_operands!r} not in ['bfloat16', 'tfloat32']")
        if self.output_backend not in ("triton", "cuda"):
            raise ValueError(f"output_backend {self.output_backend!r} not in ['cuda', 'triton']")
        if self.chunk_size % 16 or self.block_v < 16 or self.block_k < 16:
            raise ValueError(f"chunk_size {self.chunk_size} must be a multiple of 16, block_v {self.block_v} and"
                             f" block_k {self.block_k} >= 16")


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU (TRITON_INTERPRET=1, read when kernels are decorated)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def _pow2(n: int) -> int:
    return max(16, 1 << (max(1, n) - 1).bit_length())


class TritonKdaEngine:
    """engine(q, k, v, g, beta, initial_state=None) -> {"o": [B,T,H,V] input dtype, "final_state": [B,H,K,V] float32}.

    Classic kernels: prepare (unless fused into intra), intra, recurrence (+ output when fused), output;
    blocked: intra_blocked, recurrence_blocked (+ output when fused), output_blocked (or its CUDA C twin)."""

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
        if p.kernels == "blocked":
            return self._blocked(q, k, v, g, beta, initial_state, dot, launch)
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

    def _blocked(self, q, k, v, g, beta, initial_state, dot: int, launch: dict) -> dict:
        """The blocked kernels: intra (W, Kd, U0, M, gam), the recurrence (+ output when fused), output."""
        p, kn = self.plan, self._k
        B, T, H, K = q.shape
        V, C = v.shape[-1], p.chunk_size
        N = -(-T // C)
        Tp, BH, dev = N * C, B * H, q.device
        BK, BVF, BV = _pow2(K), _pow2(V), min(p.block_v, _pow2(V))
        BKT, BVT, BKH = min(p.block_k, BK), min(p.block_k, BVF), max(16, BK // 2)
        sdot = DOT_CODES[p.state_operands] if p.compute_dtype == "bfloat16" else dot
        ws = getattr(torch, p.workspace_dtype)
        W, Kd = (torch.empty(BH, Tp, K, dtype=ws, device=dev) for _ in range(2))
        U0 = torch.empty(BH, Tp, V, dtype=ws, device=dev)
        M = torch.empty(BH, Tp, C, dtype=torch.bfloat16 if p.compute_dtype == "bfloat16" else torch.float32, device=dev)
        gam = torch.empty(BH, N, K, dtype=torch.float32, device=dev)  # exp(G_C) per chunk
        scale = K**-0.5
        kn.intra_blocked_kernel[(N, BH)](q, k, g, v, beta, W, U0, M, Kd, gam, T, Tp, scale, H=H, K=K, V=V, BT=C,
                                         BKT=BKT, BVT=BVT, DOT=dot, SDOT=sdot, **launch)
        o, ht = self._output_buffers(B, T, H, K, V, q.dtype, dev)
        h0 = initial_state.float().contiguous() if initial_state is not None else ht
        if p.fuse_output:
            Us = Ss = ht  # unused pointers
        else:
            Us = torch.empty(BH, Tp, V, dtype=ws, device=dev)
            Ss = torch.empty(BH, N, K, V, dtype=ws, device=dev)  # each chunk's start state
        vt = -(-V // BV)
        kn.recurrence_blocked_kernel[(vt, BH)](W, U0, Kd, gam, q, g, M, h0, o, ht, Us, Ss, T, Tp, N, scale, H=H, K=K,
                                               V=V, BT=C, BKH=BKH, BV=BV, HAS_H0=initial_state is not None,
                                               FUSED_OUTPUT=p.fuse_output, DOT=dot, SDOT=sdot, **launch)
        if not p.fuse_output and p.output_backend == "cuda" and dev.type == "cuda":
            from evo.workloads.kda.triton.cuda_output import CudaOutput

            CudaOutput()(q, g, M, Us, Ss, o, T, Tp, N, scale, H, C)
        elif not p.fuse_output:  # also where the CUDA output cannot run: recording on meta tensors
            kn.output_blocked_kernel[(N, BH)](q, g, M, Us, Ss, o, T, Tp, N, scale, H=H, K=K, V=V, BT=C, BKT=BKT,
                                                  BV=BV, DOT=dot, SDOT=sdot, **launch)
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
    """The Triton plan of a validated genome (engine='triton'); a gene the chosen kernels do not read
    (see `genes.ignored`) keeps the plan's default, so one plan per engine built."""
    v = genome.values()
    blocked = v.get("triton_kernels", "classic") == "blocked"
    fused = bool(v["fuse_recurrence_output"])
    return TritonPlan(
        chunk_size=int(v["chunk_size"]),
        block_v=int(v["block_v"]),
        num_warps=int(v["num_warps"]),
        num_stages=int(v["num_stages"]),
        compute_dtype=str(v["compute_dtype"]),
        state_layout="kv" if blocked else str(v["state_layout"]),
        fuse_prepare=False if blocked else bool(v["fuse_l2norm_intra"]),
        fuse_output=fused,
        preallocate_outputs=bool(v["preallocate_outputs"]),
        kernels="blocked" if blocked else "classic",
        workspace_dtype=str(v.get("workspace_dtype", "float32")) if blocked else "float32",
        state_operands=(str(v.get("state_operands", "tfloat32"))
                        if blocked and v["compute_dtype"] == "bfloat16" else "tfloat32"),
        block_k=int(v.get("block_k", 64)) if blocked else 64,
        output_backend=str(v.get("output_backend", "triton")) if blocked and not fused else "triton",
    )


def build_triton(genome, kernels=None) -> TritonKdaEngine:
    """The Triton engine of a validated genome (with `kernels` from its code, if it carries any)."""
    return TritonKdaEngine(plan_from_genome(genome), kernels)
