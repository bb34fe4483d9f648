"""Engines built from sampled genomes match the float64 oracle; the exponent forms fail where
they should and only there."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from evo.core.genome import GenomeError
from evo.workloads import get_workload
from evo.workloads.base import CheckCase, DeviceInfo

W = get_workload("kda")
CPU = W.presets()["cpu"]
DEVICE = DeviceInfo("cpu", "test", threads=2)
SPACE = W.gene_space(CPU, DEVICE)
SHAPE = {"B": 2, "T": 150, "H": 2, "K": 32, "V": 32}  # T is no multiple of any chunk size
TOL = 1e-5
SEEDS = {"standard": 11, "strong_decay": 12, "heavy": 13}
EAGER = {f"backend_{s}": "eager" for s in ("gate", "l2norm", "intra", "recurrence", "output")}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def errors(genes: dict, distribution: str, shape=SHAPE, seed: int = 0, initial_state: bool = True):
    engine = W.build(SPACE.make(genes), CPU, DEVICE)
    x = W.make_inputs(CheckCase(distribution, shape, distribution, initial_state), "float32", "cpu", seed)
    ref, out = W.reference(x), engine(**x)
    assert out["o"].shape == x["v"].shape and out["o"].dtype == x["v"].dtype
    assert out["final_state"].dtype == torch.float32
    return rel(out["o"], ref["o"]), rel(out["final_state"], ref["final_state"])


def sampled_genomes(n: int) -> list[dict]:
    rng = np.random.default_rng(2026)
    return [{**SPACE.sample(rng).values(), **EAGER} for _ in range(n)]


def is_expected_failure(genes: dict, distribution: str) -> bool:
    """Under strong decay factored_chunk overflows, and so do factored_subchunk's diagonal blocks
    at c = 64 (mid-block offset: exp(5 * 32) > float32 max). That failure is what the genes are for."""
    if distribution != "strong_decay":
        return False
    form, c = genes["exponent_form"], min(genes["sub_chunk_size"], genes["chunk_size"])
    return form == "factored_chunk" or (form == "factored_subchunk" and c >= 64)


@pytest.mark.parametrize("distribution", ["standard", "strong_decay", "heavy"])
@pytest.mark.parametrize("genes", sampled_genomes(12), ids=lambda g: f"C{g['chunk_size']}-{g['exponent_form']}-{g['intra_algorithm']}")
def test_sampled_genomes_match_reference(genes: dict, distribution: str) -> None:
    if is_expected_failure(genes, distribution):
        pytest.xfail(f"{genes['exponent_form']} c={genes['sub_chunk_size']} overflows under strong decay (expected)")
    e_o, e_s = errors(genes, distribution, seed=SEEDS[distribution])
    assert e_o < TOL and e_s < TOL, (genes, e_o, e_s)


@pytest.mark.parametrize("genes", [
    {}, {"fuse_intra_recurrence": True}, {"fuse_recurrence_output": True},
    {"fuse_intra_recurrence": True, "fuse_recurrence_output": True, "intermediates": "recompute"},
    {"fuse_l2norm_intra": True, "fuse_gate_l2norm": False}, {"layout": "time_major", "state_layout": "vk"},
    {"intra_algorithm": "forward_substitution", "chunk_size": 16}, {"intra_algorithm": "triangular_solve"},
    {"exponent_form": "pairwise", "chunk_size": 32}, {"preallocate_outputs": True},
])
def test_each_structural_gene_is_correct(genes: dict) -> None:
    e_o, e_s = errors(genes, "strong_decay", seed=3)
    assert e_o < TOL and e_s < TOL


@pytest.mark.parametrize("T", [1, 16, 64, 65])
def test_tails_and_missing_initial_state(T: int) -> None:
    e_o, e_s = errors({}, "standard", {**SHAPE, "T": T}, initial_state=False)
    assert e_o < TOL and e_s < TOL


def test_initial_state_none_means_zeros() -> None:
    engine = W.build(SPACE.default(), CPU, DEVICE)
    x = W.make_inputs(CheckCase("s", SHAPE, "standard", False), "float32", "cpu", 1)
    a = engine(**x)
    b = engine(**x, initial_state=None)
    c = engine(**x, initial_state=torch.zeros(2, 2, 32, 32))
    assert torch.equal(a["o"], b["o"]) and torch.allclose(a["o"], c["o"])


def test_preallocated_outputs_are_fresh_each_call() -> None:
    engine = W.build(SPACE.make({"preallocate_outputs": True}), CPU, DEVICE)
    for seed in (1, 2):
        x = W.make_inputs(CheckCase("s", SHAPE, "heavy", True), "float32", "cpu", seed)
        ref = W.reference(x)
        out = engine(**x)
        assert rel(out["o"], ref["o"]) < TOL and rel(out["final_state"], ref["final_state"]) < TOL


STRONG_LONG = {"B": 1, "T": 256, "H": 2, "K": 32, "V": 32}


@pytest.mark.parametrize("sub", [8, 16, 32])
def test_factored_subchunk_is_stable_under_strong_decay_at_c128(sub: int) -> None:
    e_o, e_s = errors({"chunk_size": 128, "sub_chunk_size": sub}, "strong_decay", STRONG_LONG, seed=7)
    assert e_o < TOL and e_s < TOL


def test_factored_chunk_overflows_under_strong_decay_at_c128() -> None:
    """Why exponent_form exists: exp(-G) passes float32's range once G < -88 inside a chunk."""
    e_o, e_s = errors({"chunk_size": 128, "exponent_form": "factored_chunk"}, "strong_decay", STRONG_LONG, seed=7)
    assert not (e_o < TOL and e_s < TOL)
    ok_o, ok_s = errors({"chunk_size": 128, "exponent_form": "factored_chunk"}, "standard", STRONG_LONG, seed=7)
    assert ok_o < TOL and ok_s < TOL  # mild decay: the fast form is fine


def test_sub_chunk_64_overflows_under_strong_decay() -> None:
    """Diagonal blocks use a mid-block offset: factors reach exp(5 * c/2); c=64 passes exp(88)."""
    e_o, e_s = errors({"chunk_size": 128, "sub_chunk_size": 64}, "strong_decay", STRONG_LONG, seed=7)
    assert not (e_o < TOL and e_s < TOL)


def test_build_validates_first() -> None:
    genome = SPACE.default().with_genes(chunk_size=48)
    with pytest.raises(GenomeError, match="chunk_size"):
        W.build(genome, CPU, DEVICE)


def test_engine_carries_threads_and_works_for_other_shapes() -> None:
    engine = W.build(SPACE.make({"threads": 1}), CPU, DEVICE)
    assert engine.num_threads == 1
    x = W.make_inputs(CheckCase("s", {"B": 3, "T": 40, "H": 3, "K": 8, "V": 12}, "standard", True), "float32", "cpu", 0)
    ref, out = W.reference(x), engine(**x)
    assert rel(out["o"], ref["o"]) < TOL


def test_one_tiny_compiled_genome(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    # The compiled chunk-loop step (recurrence with the output fused into it) and a compiled
    # gate+l2norm group. (A compiled intra group is correct too but takes ~100 s to build here.)
    genes = {"fuse_gate_l2norm": True, "backend_gate": "compile", "backend_l2norm": "compile",
             "fuse_recurrence_output": True, "backend_recurrence": "compile", "backend_output": "compile",
             "chunk_size": 16, "sub_chunk_size": 8}
    shape = {"B": 1, "T": 40, "H": 1, "K": 8, "V": 8}
    e_o, e_s = errors(genes, "strong_decay", shape, seed=1)
    assert e_o < TOL and e_s < TOL


def test_an_honest_engine_passes_where_q_and_k_are_nearly_orthogonal() -> None:
    """One token from a zero state with |cos(q, k)| = 1e-4: o = beta (q.k) v cancels ~1e4-fold below its
    terms, so a float32 dot product is ~1e-3 off o relatively (judged incorrect by a bound on o alone,
    about 1 honest evaluation in 700 did so); measured against the size of o's terms it passes, and an
    engine 1e-3 off those terms still fails."""
    from evaluators.judge.check import compare_outputs, expected_dtypes

    gen = torch.Generator().manual_seed(7)
    x = W.make_inputs(CheckCase("c", {"B": 1, "T": 1, "H": 1, "K": 32, "V": 32}, "standard", False), "float32",
                      "cpu", 7)
    q, k = x["q"].double(), torch.randn(x["k"].shape, generator=gen, dtype=torch.float64)
    unit = q / q.norm()
    k = k - (k * unit).sum() * unit + 1e-4 * k.norm() * unit  # cos(q, k) = 1e-4
    x = {**x, "k": k.float()}
    engine = W.build(SPACE.make({}), CPU, DEVICE)
    out, dtypes = engine(**x), expected_dtypes(W, CPU)
    reference_only, scales = W.reference(x), W.reference_and_scales(CPU, x)[1]
    assert "norm-wise relative error" in compare_outputs(out, reference_only, dtypes, TOL, 10.0)[0]
    problem, rel = compare_outputs(out, reference_only, dtypes, TOL, 10.0, scales)
    assert problem == "" and rel < 1e-6
    off = {**out, "o": (reference_only["o"] + 1e-3 * scales["o"]).float()}
    assert "of its terms" in compare_outputs(off, reference_only, dtypes, TOL, 10.0, scales)[0]
