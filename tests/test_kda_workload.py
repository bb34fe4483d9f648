"""The KDA workload as the evaluators see it: protocol, check cases, baselines, roofline."""
from __future__ import annotations

import pytest
import torch

from evo.workloads import get_workload
from evo.workloads.base import CheckCase, DeviceInfo, MachineRates

W = get_workload("kda")
SMALL = W.presets()["cpu_small"]
DEVICE = DeviceInfo("cpu", "test", threads=2)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def test_protocol_surface() -> None:
    assert W.name == "kda"
    assert W.input_names == ("q", "k", "v", "g", "beta", "initial_state")
    assert W.output_names == ("o", "final_state")
    assert set(W.presets()) >= {"cpu", "cpu_small", "h200"}
    h200 = W.presets()["h200"]
    assert (h200.dtype, h200.device, h200.shape["T"], h200.shape["H"]) == ("bfloat16", "cuda", 8192, 96)


def test_check_cases_are_a_cheap_first_stage_then_the_preset() -> None:
    cpu = W.presets()["cpu"]
    stage1, stage2 = W.check_cases(cpu)
    assert all(c.shape["T"] in (77, 1) for c in stage1)
    assert {"standard", "strong_decay"} <= {c.distribution for c in stage1}
    assert {"standard", "strong_decay", "heavy"} <= {c.distribution for c in stage2}
    Ts = {c.shape["T"] for c in stage2}
    assert {1024, 1024 - 17, 4096} <= Ts


def test_reference_cost_of_all_cpu_cases_is_small() -> None:
    # The float64 recurrence costs ~T steps of [B*H, K, V] work: all cpu cases take ~0.7 s here (each
    # timed call adds one preset-size reference more). Counted, not timed, so a loaded machine cannot
    # make this flaky.
    steps = sum(c.shape["T"] for stage in W.check_cases(W.presets()["cpu"]) for c in stage)
    state_work = sum(c.shape["T"] * c.shape["B"] * c.shape["H"] for stage in W.check_cases(W.presets()["cpu"]) for c in stage)
    assert steps <= 12_000 and state_work <= 40_000  # today 10609 steps, 35805 token-heads (B=8 and H+1 cases)


@pytest.mark.parametrize("name", ["eager_recurrent", "chunk_pairwise_c64", "fla_naive_chunk"])
@pytest.mark.parametrize("distribution", ["standard", "strong_decay", "heavy"])
def test_baselines_are_correct_on_the_small_preset(name: str, distribution: str) -> None:
    builders = W.baselines(SMALL)
    assert "chunk_pairwise_c64_compiled" in builders  # same function, torch.compile'd: timed by the bench
    if name not in builders:
        pytest.skip(f"{name} not available here (optional fla-core)")
    engine = builders[name](DEVICE)
    for T in (SMALL.shape["T"], 77):
        x = W.make_inputs(CheckCase(distribution, {**SMALL.shape, "T": T}, distribution, True), "float32", "cpu", T)
        ref, out = W.reference(x), engine(**x)
        assert rel(out["o"], ref["o"]) < 1e-5 and rel(out["final_state"], ref["final_state"]) < 1e-5


def test_roofline_counts_flops_and_bytes() -> None:
    rates = MachineRates(flops_per_s=145e9, bytes_per_s=4e9)
    cpu = W.roofline(W.presets()["cpu"], rates)
    B, T, H, K, V = 1, 1024, 4, 64, 64
    assert cpu.bytes == 4 * (B * T * H * (3 * K + V + 1 + V) + 2 * B * H * K * V)
    assert cpu.flops > B * H * T * 6 * K * V  # at least the three state products per token
    assert cpu.floor_ms == pytest.approx(1e3 * max(cpu.flops / 145e9, cpu.bytes / 4e9))
    big = W.roofline(W.presets()["h200"], rates)
    assert big.flops > 100 * cpu.flops


def test_label_names_the_engine_and_its_hash() -> None:
    genome = W.gene_space(SMALL, DEVICE).default()
    label = W.label(genome)
    assert label.startswith(f"{genome['engine'] if 'engine' in genome.values() else 'torch'} {genome.hash[:8]} (")
    assert f"C={genome['chunk_size']}" in label
