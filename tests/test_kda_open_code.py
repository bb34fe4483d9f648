"""KDA's open stages: the seed sources are the hand-written stages (equal outputs wherever the stages run),
an edited source changes the engine, and missing or illegal code is refused with the gene named."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from evo.core.code import END_MARK, START_MARK, CodeError, check_source, code_hash, marked_blocks
from evo.core.genome import GenomeError
from evo.workloads import get_workload
from evo.workloads.base import CheckCase, DeviceInfo

pytestmark = pytest.mark.usefixtures("trusted_engine_code")  # the project's own seed sources, built here

W = get_workload("kda")
PRESET = W.presets()["cpu_small"]
DEVICE = DeviceInfo("cpu", "test", threads=2)
SPACE = W.gene_space(PRESET, DEVICE)
STAGES = W.open_stages(PRESET, DEVICE)
SEEDS = {s.gene: s.seed() for s in STAGES}
ALL_SEEDS = {gene: code_hash(source) for gene, source in SEEDS.items()}
SOURCES = {code_hash(source): source for source in SEEDS.values()}
SHAPE = dict(PRESET.shape)  # B=1 T=256 H=2 K=V=32


def run(genes: dict, sources=None, distribution: str = "strong_decay", shape=SHAPE, seed: int = 5) -> dict:
    engine = W.build(SPACE.make(genes), PRESET, DEVICE, sources=sources)
    x = W.make_inputs(CheckCase(distribution, shape, distribution, True), "float32", "cpu", seed)
    return engine(**x)


def assert_same(a: dict, b: dict) -> None:
    for name in ("o", "final_state"):
        assert torch.allclose(a[name], b[name], rtol=1e-6, atol=1e-6), name


def test_open_stages_match_the_gene_space() -> None:
    assert [s.gene for s in STAGES] == ["code_intra", "code_recurrence", "code_output"]
    assert set(SPACE.code_gene_names()) == {s.gene for s in STAGES}
    assert [s.signature() for s in STAGES] == ["def intra(ctx, plan)", "def chunk_step(c, S, plan)",
                                               "def output(ctx, plan)"]


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.gene)
def test_each_seed_is_checked_and_marked(stage) -> None:
    source = SEEDS[stage.gene]
    check_source(source, stage)
    assert "evo" not in source.split('"""', 2)[2]  # no project imports after the docstring
    blocks = marked_blocks(source)
    assert blocks, "the seed marks what may change"
    entry = source.index(f"def {stage.entry}(")
    assert all(not (start <= entry < end) for start, end in blocks), "the entry's def line stays outside the blocks"
    assert source.count(START_MARK) == source.count(END_MARK) == len(blocks)


def test_default_genome_carries_no_code_and_keeps_its_hash() -> None:
    default = SPACE.default()
    assert not set(default.values()) & set(SPACE.code_gene_names())
    assert dataclasses.replace(SPACE, code_genes=()).default().hash == default.hash


VARIANTS = [
    {},
    {"fuse_intra_recurrence": True},
    {"fuse_recurrence_output": True},
    {"fuse_intra_recurrence": True, "fuse_recurrence_output": True, "intermediates": "recompute"},
    {"fuse_l2norm_intra": True, "fuse_gate_l2norm": False, "layout": "time_major", "state_layout": "vk"},
    {"intra_algorithm": "forward_substitution", "chunk_size": 32, "sub_chunk_size": 8},
    {"intra_algorithm": "triangular_solve", "exponent_form": "pairwise", "intermediates": "recompute"},
    {"exponent_form": "factored_chunk", "fuse_intra_recurrence": True, "state_layout": "vk"},
]


@pytest.mark.parametrize("genes", VARIANTS, ids=lambda g: "-".join(f"{k}={v}" for k, v in g.items()) or "default")
def test_seeds_reproduce_the_hand_written_engine(genes: dict) -> None:
    distribution = "standard" if genes.get("exponent_form") == "factored_chunk" else "strong_decay"
    expected = run(genes, distribution=distribution)
    assert_same(run({**genes, **ALL_SEEDS}, SOURCES, distribution), expected)


@pytest.mark.parametrize("gene", sorted(ALL_SEEDS))
def test_each_seed_alone_in_the_fused_loop(gene: str) -> None:
    genes = {"fuse_intra_recurrence": True, "fuse_recurrence_output": True}
    assert_same(run({**genes, gene: ALL_SEEDS[gene]}, SOURCES), run(genes))


def test_seeds_on_a_compiled_loop_step(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    # The compiled step traces the state update and output from the loaded sources. (Intra compiled
    # into the loop works the same way but takes minutes to compile here.)
    genes = {"fuse_recurrence_output": True, "backend_recurrence": "compile", "backend_output": "compile",
             "chunk_size": 16, "sub_chunk_size": 8}
    shape = {"B": 1, "T": 40, "H": 1, "K": 8, "V": 8}
    eager = {**genes, "backend_recurrence": "eager", "backend_output": "eager"}
    assert_same(run({**genes, **ALL_SEEDS}, SOURCES, shape=shape), run(eager, shape=shape))


def _edit_block(source: str, old: str, new: str) -> str:
    """Replace `old` by `new` inside the source's last marked block (what an agent's edit may touch)."""
    start, end = marked_blocks(source)[-1]
    assert old in source[start:end]
    return source[:start] + source[start:end].replace(old, new) + source[end:]


@pytest.mark.parametrize("fuse", [False, True], ids=["batched", "in_loop"])
def test_an_edited_source_changes_the_engine(fuse: bool) -> None:
    edited = _edit_block(SEEDS["code_output"], 'return {"O": inter', 'return {"O": 2 * inter')
    genes = {"fuse_recurrence_output": fuse}
    base = run(genes)
    out = run({**genes, "code_output": code_hash(edited)}, {code_hash(edited): edited})
    assert not torch.allclose(out["o"], base["o"])
    assert torch.equal(out["final_state"], base["final_state"])  # only the output stage changed


def test_missing_source_is_a_code_error_naming_the_gene() -> None:
    genome = SPACE.make({"code_recurrence": ALL_SEEDS["code_recurrence"]})
    with pytest.raises(CodeError, match="code_recurrence"):
        W.build(genome, PRESET, DEVICE)
    with pytest.raises(CodeError, match="code_recurrence"):
        W.build(genome, PRESET, DEVICE, sources={ALL_SEEDS["code_intra"]: SEEDS["code_intra"]})


def test_disallowed_source_is_a_code_error_naming_the_gene() -> None:
    bad = SEEDS["code_output"].replace("import torch\n", "import torch\nimport os\n", 1)
    with pytest.raises(CodeError, match="code_output.*'os'"):
        W.build(SPACE.make({"code_output": code_hash(bad)}), PRESET, DEVICE, sources={code_hash(bad): bad})


def test_validate_refuses_a_value_that_is_no_hash() -> None:
    with pytest.raises(GenomeError, match="code_intra"):
        SPACE.make({"code_intra": "intra.py"})
    with pytest.raises(GenomeError, match="code_output"):
        SPACE.validate(SPACE.default().with_domain("fusion", {**SPACE.default().domain("fusion"), "code_output": 7}))


def test_code_genes_need_the_torch_engine() -> None:
    # a CUDA device with triton installed: the space has the engine gene (its default is triton)
    pytest.importorskip("triton")
    gpu = W.gene_space(W.presets()["h200"], DeviceInfo("cuda", "H200"))
    with pytest.raises(GenomeError, match="code_intra is code of the torch engine, got engine='triton'"):
        gpu.make({"engine": "triton", "code_intra": ALL_SEEDS["code_intra"]})
    gpu.make({"engine": "torch", "compute_dtype": "float32", "code_intra": ALL_SEEDS["code_intra"]})
    assert "code_triton" in gpu.code_gene_names()  # the kernels are open where the Triton engine runs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_seeds_reproduce_the_torch_engine_on_cuda() -> None:
    preset, device = W.presets()["h200"], DeviceInfo("cuda", "gpu")
    space = W.gene_space(preset, device)
    x = W.make_inputs(CheckCase("s", {"B": 1, "T": 300, "H": 4, "K": 64, "V": 64}, "strong_decay", True),
                      "bfloat16", "cuda", 3)
    torch_engine = {"engine": "torch"} if any(g.name == "engine" for g in space.genes) else {}  # with triton
    for genes in (torch_engine, {**torch_engine, "fuse_intra_recurrence": True, "fuse_recurrence_output": True}):
        expected = W.build(space.make(genes), preset, device)(**x)
        assert_same(W.build(space.make({**genes, **ALL_SEEDS}), preset, device, sources=SOURCES)(**x), expected)
