"""Baseline engines, all float32 compute: what the best genome has to beat (and be as correct as)."""
from __future__ import annotations

import importlib
from typing import Callable

import torch
import torch.nn.functional as F

from evo.workloads.base import DeviceInfo, Engine, Preset
from evo.workloads.kda.gpu_baselines import fla_engine, fla_kernels, head_blocked
from evo.workloads.kda.reference import l2norm, recurrent_kda


def chunk_pairwise(q, k, v, g, beta, initial_state=None, chunk_size: int = 64, dtype=torch.float32,
                   intra=None, step=None) -> dict:
    """The chunked form straight from the math, pairwise exp differences [C, C, K] inside a chunk.
    Independent of the engine's stage code; in float64 it cross-checks the reference.
    `intra` and `step` replace the two parts (e.g. by their torch.compile'd versions)."""
    B, T, H, K = q.shape
    V, C = v.shape[-1], chunk_size
    pad = -T % C

    def chunks(x):  # [B, T, H, *D] -> [B, H, N, C, *D]
        x = F.pad(x.to(dtype), (0, 0) * (x.dim() - 2) + (0, pad))
        return x.transpose(1, 2).unflatten(2, (-1, C))

    q, k = chunks(l2norm(q.to(dtype)) * K**-0.5), chunks(l2norm(k.to(dtype)))
    W, U0, M, Qg, Kd, gammaC = (intra or _pairwise_intra)(q, k, chunks(v), chunks(g), chunks(beta))
    S = initial_state.to(dtype) if initial_state is not None else q.new_zeros(B, H, K, V)
    outs = []
    for n in range(W.shape[2]):
        o_n, S = (step or _chunk_step)(S, W[:, :, n], U0[:, :, n], M[:, :, n], Qg[:, :, n], Kd[:, :, n], gammaC[:, :, n])
        outs.append(o_n)
    o = torch.stack(outs, 2).flatten(2, 3).transpose(1, 2)[:, :T]
    return {"o": o, "final_state": S}


def _pairwise_intra(q, k, v, g, beta):
    """Everything that does not depend on the chunk's start state, for all chunks at once."""
    C, dtype = q.shape[-2], q.dtype
    G = g.cumsum(-2)  # [B, H, N, C, K]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~causal[:, :, None], float("-inf"))
    E = diff.exp()  # [B, H, N, C(t), C(i), K] = exp(G_t - G_i) for i <= t
    A = torch.einsum("bhntk,bhnik,bhntik->bhnti", k, k, E).tril(-1) * beta[..., None]
    M = torch.einsum("bhntk,bhnik,bhntik->bhnti", q, k, E)
    L = A + torch.eye(C, dtype=dtype, device=q.device)
    W = torch.linalg.solve_triangular(L, beta[..., None] * k * G.exp(), upper=False)
    U0 = torch.linalg.solve_triangular(L, beta[..., None] * v, upper=False)
    gC = G[..., -1, :]  # [B, H, N, K]
    return W, U0, M, q * G.exp(), k * (gC[..., None, :] - G).exp(), gC.exp()


def _chunk_step(S, W, U0, M, Qg, Kd, gammaC):
    """One chunk of the state recurrence: output of the chunk and the next start state."""
    U = U0 - W @ S
    return Qg @ S + M @ U, gammaC[..., None] * S + Kd.transpose(-1, -2) @ U


def _compiled_chunk_pairwise():
    """torch.compile (default mode) of the pairwise chunked form: its vectorised intra-chunk pass and
    its per-chunk step are compiled; the loop over chunks stays in Python, since compiling the whole
    function would unroll that loop for every sequence length (minutes of compile per shape).
    dynamic=True: one graph serves every checked length instead of a recompile per shape."""
    intra, step = torch.compile(_pairwise_intra, dynamic=True), torch.compile(_chunk_step, dynamic=True)
    return lambda q, k, v, g, beta, initial_state=None: chunk_pairwise(q, k, v, g, beta, initial_state,
                                                                      intra=intra, step=step)


class _Baseline:
    def __init__(self, fn: Callable[..., dict], device: DeviceInfo) -> None:
        self.fn = fn
        self.num_threads = device.threads if device.kind == "cpu" else None

    def __call__(self, q, k, v, g, beta, initial_state=None) -> dict:
        out = self.fn(q, k, v, g, beta, initial_state)
        return {"o": out["o"].to(q.dtype).contiguous(), "final_state": out["final_state"].float().contiguous()}


def _eager_recurrent(q, k, v, g, beta, initial_state=None) -> dict:
    return recurrent_kda({"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state}, torch.float32)


def _fla_naive_chunk(q, k, v, g, beta, initial_state=None) -> dict:
    naive = importlib.import_module("fla.ops.kda.naive")
    T, C = q.shape[1], 64
    pad = -T % C  # naive_chunk_kda needs T % chunk_size == 0; zero tokens with g=0, beta=0 are no-ops
    padt = lambda x: F.pad(x.float(), (0, 0) * (x.dim() - 2) + (0, pad))  # noqa: E731
    o, S = naive.naive_chunk_kda(
        padt(l2norm(q.float())), padt(l2norm(k.float())), padt(v), padt(g), padt(beta),
        scale=q.shape[-1] ** -0.5, initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=True, chunk_size=C,
    )
    return {"o": o[:, :T], "final_state": S}


def _fla_available() -> bool:
    try:
        importlib.import_module("fla.ops.kda.naive")
    except Exception:  # fla-core is optional and needs triton importable
        return False
    return True


def baselines(preset: Preset) -> dict[str, Callable[[DeviceInfo], Engine]]:
    """Name -> builder(DeviceInfo) -> engine, for each baseline available here."""
    out: dict[str, Callable[[DeviceInfo], Engine]] = {
        "eager_recurrent": lambda d: _Baseline(_eager_recurrent, d),
        # heads in blocks: at the h200 preset the pairwise [.., C, C, K] temporaries need ~20 GiB at once
        "chunk_pairwise_c64": lambda d: _Baseline(head_blocked(chunk_pairwise), d),
        "chunk_pairwise_c64_compiled": lambda d: _Baseline(head_blocked(_compiled_chunk_pairwise()), d),
    }
    if _fla_available():
        out["fla_naive_chunk"] = lambda d: _Baseline(_fla_naive_chunk, d)
    if preset.device == "cuda":  # fla's Triton kernels need a GPU
        for name, kernel in fla_kernels().items():
            out[name] = lambda d, kernel=kernel: _Baseline(fla_engine(kernel), d)
    return out
