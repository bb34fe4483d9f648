"""The KDA gene space: contract names, defaults, and illegal genomes raising GenomeError."""
from __future__ import annotations

import numpy as np
import pytest

from evo.core.genome import GenomeError
from evo.workloads import get_workload
from evo.workloads.base import DeviceInfo
from evo.workloads.kda.genes import Plan

W = get_workload("kda")
CPU = W.presets()["cpu"]
SPACE = W.gene_space(CPU, DeviceInfo("cpu", "test", threads=2))

CONTRACT = {
    "fusion": {"fuse_gate_l2norm", "fuse_l2norm_intra", "fuse_intra_recurrence", "fuse_recurrence_output",
               "backend_gate", "backend_l2norm", "backend_intra", "backend_recurrence", "backend_output"},
    "scheduling": {"chunk_size", "sub_chunk_size", "intra_algorithm", "exponent_form", "threads"},
    "memory": {"compute_dtype", "layout", "state_layout", "intermediates", "preallocate_outputs"},
}


def test_gene_names_are_the_contract() -> None:
    for domain, names in CONTRACT.items():
        assert {g.name for g in SPACE.in_domain(domain)} == names


def test_device_dependent_values() -> None:
    assert SPACE.gene("threads").values == (1, 2)
    assert SPACE.gene("compute_dtype").values == ("float32",)
    gpu = W.gene_space(W.presets()["h200"], DeviceInfo("cuda", "H200"))
    assert gpu.gene("threads").values == (1,)
    # tfloat32 joins where the Triton engine can run (tests/test_kda_triton.py)
    assert gpu.gene("compute_dtype").values[:2] == ("float32", "bfloat16")


def test_default_is_eager_stable_and_legal() -> None:
    d = SPACE.default().values()
    assert all(d[f"backend_{s}"] == "eager" for s in ("gate", "l2norm", "intra", "recurrence", "output"))
    assert d["exponent_form"] == "factored_subchunk" and d["sub_chunk_size"] <= 16


@pytest.mark.parametrize("gene, value", [("chunk_size", 48), ("layout", "row_major"), ("fuse_l2norm_intra", 1)])
def test_illegal_value_names_the_gene(gene: str, value) -> None:
    with pytest.raises(GenomeError, match=gene):
        SPACE.make({gene: value})


def test_unknown_gene_is_refused() -> None:
    with pytest.raises(GenomeError, match="warp_count"):
        SPACE.make({"warp_count": 4})


def test_fused_stages_need_one_backend() -> None:
    with pytest.raises(GenomeError, match="fuse_intra_recurrence"):
        SPACE.make({"fuse_intra_recurrence": True, "backend_intra": "compile"})
    SPACE.make({"fuse_intra_recurrence": False, "backend_intra": "compile"})  # unfused: legal


@pytest.mark.parametrize("C, c", [(16, 32), (32, 64), (64, 64)])
def test_sub_chunk_must_divide_chunk(C: int, c: int) -> None:
    if c <= C and C % c == 0:
        SPACE.make({"chunk_size": C, "sub_chunk_size": c})
        return
    with pytest.raises(GenomeError, match="sub_chunk_size"):
        SPACE.make({"chunk_size": C, "sub_chunk_size": c})


def test_fusion_groups_follow_the_links() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        plan = Plan.from_genome(SPACE.sample(rng))
        groups = plan.groups()
        assert [s for g, _ in groups for s in g] == ["gate", "l2norm", "intra", "recurrence", "output"]
        assert len(groups) == 5 - sum(plan.fuse)


def test_the_stage_pipeline_generates_the_fusion_genes_as_named() -> None:
    """Journals and configs name these genes: the pipeline keeps their names, values and defaults."""
    from evo.workloads.kda.genes import PIPELINE

    fusion = {g.name: (g.values, g.default) for g in SPACE.in_domain("fusion")}
    assert fusion == {
        "fuse_gate_l2norm": ((True, False), True), "fuse_l2norm_intra": ((False, True), False),
        "fuse_intra_recurrence": ((False, True), False), "fuse_recurrence_output": ((False, True), False),
        **{f"backend_{s}": (("eager", "compile"), "eager") for s in ("gate", "l2norm", "intra", "recurrence", "output")},
    }
    assert SPACE.pipeline is PIPELINE and SPACE.ignored == ()  # one engine here: nothing is ignored
    genome = SPACE.make({"fuse_l2norm_intra": True, "fuse_intra_recurrence": True, "backend_l2norm": "compile",
                         "backend_intra": "compile", "backend_recurrence": "compile", "backend_gate": "compile"})
    assert Plan.from_genome(genome).groups() == PIPELINE.groups(genome.values()) == [
        (("gate", "l2norm", "intra", "recurrence"), "compile"), (("output",), "eager")]
