"""The float64 oracle agrees with an independently written chunked form (also float64)."""
from __future__ import annotations

import pytest
import torch

from evo.workloads.base import CheckCase
from evo.workloads.kda.baselines import chunk_pairwise
from evo.workloads.kda.inputs import make_inputs
from evo.workloads.kda.reference import reference

SHAPE = {"B": 2, "T": 100, "H": 2, "K": 16, "V": 24}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("distribution", ["standard", "strong_decay", "heavy"])
@pytest.mark.parametrize("T, chunk", [(100, 32), (64, 64), (1, 16), (130, 64)])
def test_reference_matches_chunked_float64(distribution: str, T: int, chunk: int) -> None:
    x = make_inputs(CheckCase("c", {**SHAPE, "T": T}, distribution, True), "float32", "cpu", seed=T)
    ref = reference(x)
    chunked = chunk_pairwise(**x, chunk_size=chunk, dtype=torch.float64)
    assert ref["o"].dtype == torch.float64 and ref["o"].shape == (2, T, 2, 24)
    assert ref["final_state"].shape == (2, 2, 16, 24)
    assert rel(chunked["o"], ref["o"]) < 1e-12
    assert rel(chunked["final_state"], ref["final_state"]) < 1e-12


def test_reference_without_initial_state_starts_from_zeros() -> None:
    x = make_inputs(CheckCase("c", SHAPE, "standard", True), "float32", "cpu", seed=0)
    zeros = {**x, "initial_state": torch.zeros_like(x["initial_state"])}
    absent = {n: t for n, t in x.items() if n != "initial_state"}
    assert torch.equal(reference(zeros)["o"], reference(absent)["o"])


def test_make_inputs_is_seeded_and_strong_decay_reaches_the_bound() -> None:
    case = CheckCase("c", {**SHAPE, "T": 512}, "strong_decay", True)
    a, b = make_inputs(case, "float32", "cpu", 5), make_inputs(case, "float32", "cpu", 5)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert a["g"].min() >= -5 and a["g"].min() < -4.9 and (a["g"] <= 0).all()
    assert ((a["beta"] > 0) & (a["beta"] < 1)).all()
    assert a["initial_state"].dtype == torch.float32
