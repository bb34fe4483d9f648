"""Runs every Triton kernel and fused variant under Triton's interpreter and writes their errors
against the float64 reference as JSON: `python -m tests.kda_triton_cases OUT.json`.

A separate process because TRITON_INTERPRET is read when the kernels are decorated: the caller sets it
for that process only, never in the pytest process (whose CPU gene space must not change). Importing
this module (for CASES) neither sets it nor imports triton.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

import torch

from evo.workloads.base import CheckCase
from evo.workloads.kda.baselines import _pairwise_intra
from evo.workloads.kda.inputs import make_inputs
from evo.workloads.kda.reference import l2norm, reference
from evo.workloads.kda.triton.engine import TritonKdaEngine, TritonPlan


@dataclass(frozen=True)
class Case:
    """One engine run: a shape and distribution, and the plan (kernel choices) to run it with."""

    name: str
    shape: dict
    distribution: str
    with_initial_state: bool
    dtype: str
    plan: TritonPlan
    floor_decay: bool = False  # some channels decay at exactly the floor, g = -5 every step


def _plan(C=16, BV=32, dt="float32", layout="kv", fp=False, fo=False, warps=4, stages=2) -> TritonPlan:
    return TritonPlan(C, BV, warps, stages, dt, layout, fp, fo)


def _blocked(C=16, BV=16, dt="float32", fo=False, ws="float32", so="tfloat32", BK=16) -> TritonPlan:
    return TritonPlan(C, BV, 8, 2, dt, "kv", False, fo, kernels="blocked", workspace_dtype=ws, state_operands=so,
                      block_k=BK)


S = {"B": 2, "T": 77, "H": 2, "K": 32, "V": 32}
CASES = (
    Case("separate_kernels_c16_ragged", S, "standard", True, "float32", _plan(16)),
    Case("fused_prepare_and_output_c32_vk", S, "standard", True, "float32", _plan(32, layout="vk", fp=True, fo=True)),
    Case("strong_decay_floor_c64", S, "strong_decay", True, "float32", _plan(64, fp=True), floor_decay=True),
    Case("strong_decay_floor_c128_vtiles", {**S, "T": 200, "V": 64, "B": 1}, "strong_decay", True, "float32",
         _plan(128, BV=16, fo=True, warps=8, stages=3), floor_decay=True),
    Case("t1_no_initial_state", {**S, "T": 1}, "standard", False, "float32", _plan(16, fo=True)),
    Case("t1_c64_vk_separate", {**S, "T": 1, "B": 1}, "standard", True, "float32", _plan(64, layout="vk")),
    Case("heavy_odd_dims_k24_v40", {"B": 1, "T": 45, "H": 3, "K": 24, "V": 40}, "heavy", True, "float32",
         _plan(32, BV=16, fp=True, warps=2, stages=1)),
    Case("bf16_strong_decay_c64", {**S, "K": 64, "V": 64}, "strong_decay", True, "bfloat16",
         _plan(64, BV=64, dt="bfloat16", fp=True, fo=True), floor_decay=True),
    Case("bf16_separate_vk_c32", {**S, "K": 64, "V": 64}, "heavy", True, "bfloat16",
         _plan(32, dt="bfloat16", layout="vk")),
    Case("bf16_inputs_tf32_c16", {**S, "K": 64, "V": 64}, "standard", True, "bfloat16", _plan(16, dt="tfloat32")),
    # the blocked kernels: K and V in two tiles each where block_k=16 < 32
    Case("blocked_bf16_c32_ragged", {**S, "T": 45}, "heavy", True, "bfloat16",
         _blocked(32, dt="bfloat16", ws="bfloat16", so="bfloat16")),
    Case("blocked_tf32_fused_c16", {**S, "B": 1, "H": 1, "T": 40}, "standard", True, "bfloat16",
         _blocked(16, BV=32, dt="tfloat32", fo=True)),
    Case("blocked_t1_no_initial_state_c64", {**S, "T": 1, "B": 1}, "standard", False, "float32", _blocked(64, BK=32)),
    Case("blocked_default_numerics_c64", {**S, "B": 1, "H": 1, "T": 70}, "standard", True, "bfloat16",
         _blocked(64, dt="bfloat16", ws="bfloat16", so="tfloat32", BK=32)),  # as the h200 default genome
    Case("blocked_strong_decay_floor_c64_fused", {**S, "B": 1, "H": 1, "T": 70}, "strong_decay", True, "float32",
         _blocked(64, BV=32, fo=True, BK=32), floor_decay=True),
)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def _elementwise(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max|out - ref| / max|ref|: the evaluator's element-wise bound divides this by tol."""
    out, ref = out.double(), ref.double()
    return float((out - ref).abs().max() / ref.abs().max())


def _inputs(case: Case, seed: int) -> dict:
    inputs = make_inputs(CheckCase(case.name, case.shape, case.distribution, case.with_initial_state),
                         case.dtype, "cpu", seed)
    if case.floor_decay:  # every fourth channel decays at the floor, -5 per step
        g = inputs["g"].clone()
        g[..., ::4] = -5.0
        inputs["g"] = g
    return inputs


def run_engine(case: Case, seed: int) -> dict:
    inputs = _inputs(case, seed)
    start = time.perf_counter()
    out = TritonKdaEngine(case.plan)(**inputs)
    seconds = time.perf_counter() - start
    ref = reference(inputs)
    return {"o": _rel(out["o"], ref["o"]), "final_state": _rel(out["final_state"], ref["final_state"]),
            "o_elementwise": _elementwise(out["o"], ref["o"]),
            "state_elementwise": _elementwise(out["final_state"], ref["final_state"]),
            "o_dtype": str(out["o"].dtype).removeprefix("torch."), "state_dtype": str(out["final_state"].dtype).removeprefix("torch."),
            "finite": bool(torch.isfinite(out["o"].float()).all() and torch.isfinite(out["final_state"]).all()),
            "seconds": seconds}


def run_stage_kernels(seed: int) -> dict:
    """prepare_kernel and intra_kernel (unfused and with prepare folded in) against float64 stages."""
    from evo.workloads.kda.triton import kernels
    shape = {"B": 2, "T": 50, "H": 2, "K": 32, "V": 32}
    case = Case("stages", shape, "strong_decay", True, "float32", _plan(32))
    x = _inputs(Case("stages", shape, "strong_decay", True, "float32", _plan(32), floor_decay=True), seed)
    B, T, H, K, V, C = shape["B"], shape["T"], shape["H"], shape["K"], shape["V"], case.plan.chunk_size
    N = -(-T // C)
    Tp, BH = N * C, B * H
    ws = lambda D: torch.full((BH, Tp, D), float("nan"))  # noqa: E731  NaN: unwritten entries fail
    qn, kn, Gw = ws(K), ws(K), ws(K)
    kernels.prepare_kernel[(N, BH)](x["q"], x["k"], x["g"], qn, kn, Gw, T, Tp, K**-0.5, H=H, K=K, BT=C, BK=K)

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [B, T, H, *D] -> float64 [B*H, Tp, *D], zero-padded
        t = torch.nn.functional.pad(t.double(), (0, 0) * (t.dim() - 2) + (0, Tp - T))
        return t.transpose(1, 2).reshape(BH, Tp, *t.shape[3:])

    G = chunked(x["g"]).unflatten(1, (N, C)).cumsum(2).flatten(1, 2)
    errors = {"prepare_q": _rel(qn, chunked(l2norm(x["q"].double()) * K**-0.5)),
              "prepare_k": _rel(kn, chunked(l2norm(x["k"].double()))), "prepare_G": _rel(Gw, G)}
    # float64 intra from the baseline's independent pairwise form: [B, H, N, C, *]
    c64 = lambda t: chunked(t).reshape(B, H, N, C, *t.shape[3:])  # noqa: E731
    ref = _pairwise_intra(c64(l2norm(x["q"].double()) * K**-0.5), c64(l2norm(x["k"].double())), c64(x["v"]),
                          c64(x["g"]), c64(x["beta"]))
    ref = dict(zip(("W", "U0", "M", "Qg", "Kd", "gam"), (r.reshape(BH, -1, r.shape[-1]) for r in ref)))
    for fused in (False, True):
        out = {"W": ws(K), "U0": ws(V), "M": ws(C), "Qg": ws(K), "Kd": ws(K), "gam": torch.full((BH, N, K), float("nan"))}
        kernels.intra_kernel[(N, BH)](x["q"], x["k"], x["g"], x["v"], x["beta"], qn, kn, Gw, out["W"], out["U0"],
                                      out["M"], out["Qg"], out["Kd"], out["gam"], T, Tp, K**-0.5, H=H, K=K, V=V,
                                      BT=C, BK=K, BVF=V, SB=kernels.SUB, FUSED_PREPARE=fused, DOT=0, SDOT=0)
        tag = "intra_fused_prepare" if fused else "intra"
        errors.update({f"{tag}_{name}": _rel(out[name], ref[name].reshape(out[name].shape)) for name in out})
    out = {"W": ws(K), "U0": ws(V), "M": ws(C), "Kd": ws(K), "gam": torch.full((BH, N, K), float("nan"))}
    kernels.intra_blocked_kernel[(N, BH)](x["q"], x["k"], x["g"], x["v"], x["beta"], out["W"], out["U0"], out["M"],
                                          out["Kd"], out["gam"], T, Tp, K**-0.5, H=H, K=K, V=V, BT=C, BKT=16, BVT=16,
                                          DOT=0, SDOT=0)
    errors.update({f"intra_blocked_{name}": _rel(out[name], ref[name].reshape(out[name].shape)) for name in out})
    return errors


def main(path: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 in the environment (read when the kernels are decorated)")
    results = {"engines": {c.name: {**run_engine(c, seed=i), "dtype": c.dtype} for i, c in enumerate(CASES)},
               "stages": run_stage_kernels(seed=100)}
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
