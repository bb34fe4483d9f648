"""Dedupe by what is built: on the KDA gene space where the Triton engine runs (here: the CPU under
Triton's interpreter), genomes that differ only in genes their engine ignores share one hash, a gene
the engine reads still changes it, the declaration matches what each engine's plan reads, and agents
do not propose moves that change only ignored genes."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from evo.core.genome import GeneSpace, Genome
from evo.core.records import OK, EvalResult, Evaluated, Proposal
from evo.workloads import get_workload
from evo.workloads.base import DeviceInfo
from evo.workloads.kda.genes import Plan
from evo.workloads.kda.triton import genes as triton_genes
from evo.workloads.kda.triton.engine import plan_from_genome
from operators.base import Parent
from operators.fusion import FusionAgent
from operators.memory_layout import MemoryLayoutAgent
from operators.scheduling import SchedulingAgent

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

W = get_workload("kda")
CPU = W.presets()["cpu"]
TORCH_ONLY = {"backend_gate", "backend_l2norm", "backend_intra", "backend_recurrence", "backend_output",
              "sub_chunk_size", "intra_algorithm", "exponent_form", "threads", "layout", "intermediates"}
TRITON_ONLY = {"block_v", "num_warps", "num_stages", "triton_kernels", "workspace_dtype", "state_operands", "block_k",
               "output_backend"}
BLOCKED_IGNORES = {"fuse_l2norm_intra", "state_layout", "state_operands"}  # the default (blocked) kernels, fp32 compute


@pytest.fixture
def space(monkeypatch) -> GeneSpace:
    """The Triton gene space on the CPU: the interpreter makes the Triton engine a genome choice."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    space = W.gene_space(CPU, DeviceInfo("cpu", "test", threads=4))
    assert space.gene("engine").values == ("triton", "torch")
    return space


def _other(space: GeneSpace, genome: Genome, gene: str):
    """A legal value of `gene` other than the genome's (None if the gene has one value)."""
    current = genome[gene]
    for value in space.gene(gene).values:
        if value != current and space.is_legal(genome.with_genes(**{gene: value})):
            return value
    return None


def test_the_declaration_names_the_torch_only_and_triton_only_genes(space) -> None:
    assert space.ignored_genes(space.make({"engine": "triton"}).values()) == TORCH_ONLY | BLOCKED_IGNORES
    assert space.ignored_genes(space.make({"engine": "torch"}).values()) == TRITON_ONLY


def test_genomes_differing_only_in_ignored_genes_share_one_hash(space) -> None:
    a = space.make({"engine": "triton", "chunk_size": 32})
    b = space.make({"engine": "triton", "chunk_size": 32, "backend_intra": "compile", "backend_output": "compile",
                    "sub_chunk_size": 8, "intra_algorithm": "triangular_solve", "exponent_form": "pairwise",
                    "threads": 1, "layout": "time_major", "intermediates": "recompute"})
    assert a.hash == b.hash and a == b
    assert b["layout"] == space.gene("layout").default  # ignored genes take their defaults
    torch_a = space.make({"engine": "torch", "layout": "time_major"})
    torch_b = space.make({"engine": "torch", "layout": "time_major", "block_v": 16, "num_warps": 8, "num_stages": 3})
    assert torch_a.hash == torch_b.hash
    # a non-canonical genome (e.g. from an older journal) validates to the canonical one, not an error
    raw = a.with_genes(backend_intra="compile", threads=2)
    assert raw.hash != a.hash and space.validate(raw).hash == a.hash == space.canonical(raw).hash


def test_a_gene_the_engine_reads_still_changes_the_hash(space) -> None:
    for engine, ignored in (("triton", TORCH_ONLY | BLOCKED_IGNORES), ("torch", TRITON_ONLY)):
        base = space.make({"engine": engine, "chunk_size": 32})
        read = [g.name for g in space.genes if g.name not in ignored and g.name != "engine"]
        changed = 0
        for gene in read:
            value = _other(space, base, gene)
            if value is not None:
                assert space.make({**base.values(), gene: value}).hash != base.hash, (engine, gene)
                changed += 1
        assert changed >= 4, (engine, read)
    triton = space.make({"engine": "triton"})
    assert space.make({**triton.values(), "engine": "torch"}).hash != triton.hash


def test_the_declaration_matches_what_each_engine_reads(space) -> None:
    """Raw genomes (not canonicalised): an ignored gene leaves the engine's plan as it is, every other
    gene with a second legal value changes it. A wrongly declared gene would merge different engines."""
    rng = np.random.default_rng(0)
    plans = {"triton": lambda g: (plan_from_genome(g), g["cuda_graph"] if "cuda_graph" in g.values() else None),
             "torch": Plan.from_genome}
    samples = [space.sample(rng) for _ in range(40)]
    for engine, plan in plans.items():
        bases = [g for g in samples if g["engine"] == engine][:6]
        assert len(bases) == 6
        for base in bases:
            ignored = space.ignored_genes(base.values())
            for gene in space.genes:
                if gene.name == "engine":
                    continue
                value = _other(space, base, gene.name)
                if value is None:
                    continue
                moved = base.with_genes(**{gene.name: value})
                if gene.name in ignored:
                    assert plan(moved) == plan(base), (engine, gene.name)
                else:
                    assert plan(moved) != plan(base), (engine, gene.name)
            if engine == "triton":  # not read by the Triton engine, but pinned by a constraint: no rule needed
                assert _other(space, base, "fuse_gate_l2norm") is None
                assert _other(space, base, "fuse_intra_recurrence") is None


def test_canonical_genomes_stay_legal_and_defaults_do_not_move(space) -> None:
    rng = np.random.default_rng(1)
    for _ in range(40):
        genome = space.sample(rng)
        assert space.canonical(genome) == genome and space.is_legal(genome)
    default = space.default()
    assert space.canonical(default).hash == default.hash
    assert space.restrict({"engine": ["torch"]}).default()["block_v"] == space.gene("block_v").default
    narrowed = space.restrict({"backend_intra": ["compile"]})
    assert narrowed.ignored == space.ignored and narrowed.pipeline == space.pipeline
    assert narrowed.make({"engine": "triton", "backend_intra": "compile"})["backend_intra"] == "compile"


def test_agents_do_not_propose_moves_of_ignored_genes_only(space) -> None:
    parent = space.make({"engine": "triton", "chunk_size": 32})
    ignored = space.ignored_genes(parent.values())
    scheduling = SchedulingAgent(space, seed=0)
    memory = MemoryLayoutAgent(space, seed=0)
    fusion = FusionAgent(space, seed=0)
    assert not set(scheduling.move_kinds(parent)) & ignored
    assert not set(memory.move_kinds(parent)) & ignored
    assert "backend" not in fusion.move_kinds(parent) and "fuse" in fusion.move_kinds(parent)
    assert "backend" in fusion.move_kinds(space.make({"engine": "torch"}))
    for agent in (scheduling, memory, fusion):
        proposals = agent.propose([Parent(parent, 1.0)], 30, generation=1)
        assert proposals
        for p in proposals:
            assert space.validate(p.genome).hash == p.genome.hash  # canonical
            changed = {g for g, v in p.genome.values().items() if parent.values().get(g) != v}
            assert changed - ignored, (agent.name, p.move)
    # a move that changes only ignored genes gives the parent back: not a child
    values = {**parent.domain("fusion"), "backend_intra": "compile", "backend_gate": "compile"}
    assert fusion.legal(parent, values) is None
    # nor from a parent of an older journal, written before those genes were declared ignored
    old = parent.with_genes(backend_output="compile")
    assert fusion.legal(old, {**old.domain("fusion"), "backend_intra": "compile"}) is None
    assert fusion.legal(old, {**old.domain("fusion"), "fuse_recurrence_output": True}) is not None


def test_a_resumed_journal_row_keeps_its_recorded_hash(space) -> None:
    """A non-canonical genome of an old journal is adopted under the hash it was recorded with."""
    from evo.core.search import Search, SearchSettings
    from operators.team import LocalTeam

    old = space.make({"engine": "triton"}).with_genes(layout="time_major")
    row = Evaluated(Proposal(Genome.from_json(old.to_json()), (), "seed", "default genome", 0, move_kind="seed"),
                    EvalResult(old.hash, OK, latency_ms=1.0, latency_spread_ms=0.0, device="synthetic", threads=1))
    settings = SearchSettings(seed=0, generations=3, offspring=4, max_evaluations=20)
    search = Search(space, settings, LocalTeam(list(settings.agents), space, settings.seed))
    search.restore([row], 1)
    assert old.hash in search.known and search.evaluations == 1
    for proposal in search.ask():
        assert space.validate(proposal.genome).hash == proposal.hash
