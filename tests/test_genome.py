import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from evo.core.genome import Genome, GenomeError
from tests.toy_space import toy_space


def test_json_round_trip_keeps_identity():
    space = toy_space()
    for seed in range(20):
        genome = space.sample(np.random.default_rng(seed))
        again = Genome.from_json(genome.to_json())
        assert again == genome and again.hash == genome.hash
        assert json.loads(genome.to_json())["workload"] == "toy"


def test_gene_order_does_not_change_hash():
    a = Genome.from_dict({"workload": "w", "fusion": {"x": 1, "y": 2}})
    b = Genome.from_dict({"workload": "w", "fusion": {"y": 2, "x": 1}})
    assert a.hash == b.hash and a.to_json() == b.to_json()
    assert Genome.from_dict({"workload": "w", "fusion": {"x": 1, "y": 3}}).hash != a.hash


def test_hash_is_stable_across_processes():
    genome = toy_space().default()
    code = ("from tests.toy_space import toy_space; print(toy_space().default().hash)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""},
                         cwd=str(Path(__file__).resolve().parents[1]))
    assert out.stdout.strip() == genome.hash


def test_illegal_value_names_gene_value_and_allowed():
    with pytest.raises(GenomeError, match=r"'chunk_size'.*illegal value 48.*\[16, 32, 64, 128\]"):
        toy_space().make({"chunk_size": 48})


def test_bool_is_not_int():
    with pytest.raises(GenomeError, match="store"):
        toy_space().make({"store": 1})


def test_unknown_gene_is_named():
    with pytest.raises(GenomeError, match="unknown genes \\['warp_count'\\]"):
        toy_space().make({"warp_count": 4})
    genome = toy_space().default().to_dict()
    genome["memory"]["bogus"] = 1
    with pytest.raises(GenomeError, match="'bogus'"):
        toy_space().validate(Genome.from_dict(genome))


def test_missing_gene_and_wrong_workload():
    data = toy_space().default().to_dict()
    del data["scheduling"]["algorithm"]
    with pytest.raises(GenomeError, match="'algorithm' missing"):
        toy_space().validate(Genome.from_dict(data))
    with pytest.raises(GenomeError, match="workload 'other'"):
        toy_space().validate(Genome.from_dict({**toy_space().default().to_dict(), "workload": "other"}))


def test_a_genome_stored_before_a_gene_was_added_builds_with_its_default():
    """A registered champion or a run's best stored before its workload gained genes: `completed` gives each
    missing gene its default (the engine as it was), and leaves an unknown gene for validate to refuse."""
    space = toy_space()
    data = space.default().to_dict()
    old = data["scheduling"].pop("algorithm")
    stored = Genome.from_dict(data)
    assert space.validate(space.completed(stored)).values()["algorithm"] == old
    assert space.completed(space.default()) == space.default()
    data["memory"]["bogus"] = 1
    with pytest.raises(GenomeError, match="'bogus'"):
        space.validate(space.completed(Genome.from_dict(data)))


def test_illegal_combination_is_explained():
    with pytest.raises(GenomeError, match="illegal combination.*sub_chunk_size=32 must be <= chunk_size=16"):
        toy_space().make({"chunk_size": 16, "sub_chunk_size": 32})
    with pytest.raises(GenomeError, match="fuse_prep_solve=True joins stages 'prep' and 'solve'"):
        toy_space().make({"fuse_prep_solve": True, "backend_solve": "compile"})


def test_malformed_json_and_keys():
    with pytest.raises(GenomeError, match="not valid JSON"):
        Genome.from_json("{nope")
    with pytest.raises(GenomeError, match="unknown genome keys"):
        Genome.from_dict({"workload": "w", "speed": {}})


def test_samples_are_legal_and_reproducible():
    space = toy_space()
    a = [space.sample(np.random.default_rng(7)).hash for _ in range(3)]
    b = [space.sample(np.random.default_rng(7)).hash for _ in range(3)]
    assert a == b
    for seed in range(50):
        assert space.is_legal(space.sample(np.random.default_rng(seed)))


def test_with_genes_keeps_domains():
    genome = toy_space().default().with_genes(chunk_size=32, layout="time_major")
    assert genome.domain("scheduling")["chunk_size"] == 32
    assert genome.domain("memory")["layout"] == "time_major"
    with pytest.raises(GenomeError):
        genome.with_genes(nothing=1)


def _space_with_rule():
    """The toy space where `algorithm` and `store` do nothing under time_major (a stand-in for one engine
    ignoring another's genes)."""
    import dataclasses

    from evo.core.genome import Ignored

    rule = Ignored(("algorithm", "store"), lambda v: v.get("layout") == "time_major", "time_major reads neither")
    return dataclasses.replace(toy_space(), ignored=(rule,))


def test_ignored_genes_take_their_defaults_so_one_engine_has_one_hash():
    space = _space_with_rule()
    a = space.make({"layout": "time_major", "algorithm": "c", "store": False})
    assert a == space.make({"layout": "time_major"}) and a["algorithm"] == "a" and a["store"] is True
    # the genes still count where the rule does not hold, and a gene the rule does not name always counts
    assert space.make({"algorithm": "c"}).hash != space.default().hash
    assert space.make({"layout": "time_major", "chunk_size": 32}).hash != a.hash
    assert space.default() == toy_space().default()  # defaults are canonical: their hash does not move
    raw = a.with_genes(algorithm="b")  # e.g. a journal row written before the rule existed
    assert raw.hash != a.hash and space.validate(raw) == a == space.canonical(raw) and space.is_legal(raw)
    rng = np.random.default_rng(3)
    for _ in range(30):
        genome = space.sample(rng)
        assert space.canonical(genome) == genome
    narrowed = space.restrict({"store": [False]})
    assert narrowed.ignored == space.ignored
    assert narrowed.make({"layout": "time_major"})["store"] is False  # the narrowed default


def test_rules_and_pipelines_name_declared_genes():
    import dataclasses

    from evo.core.genome import Ignored, StagePipeline

    with pytest.raises(ValueError, match=r"names genes \['warp_count'\]"):
        dataclasses.replace(toy_space(), ignored=(Ignored(("warp_count",), lambda v: True, "never"),))
    with pytest.raises(ValueError, match="backend_post"):
        dataclasses.replace(toy_space(), pipeline=StagePipeline(("prep", "solve", "out", "post"), ("eager",)))
    with pytest.raises(ValueError, match="3 entries"):
        StagePipeline(("a", "b"), ("eager",), fused=(True, False, True))


def test_stage_pipeline_generates_genes_constraint_and_groups():
    from evo.core.genome import StagePipeline

    pipeline = StagePipeline(("a", "b", "c"), ("x", "y"), fused=(True, False))
    assert [g.name for g in pipeline.genes()] == ["fuse_a_b", "fuse_b_c", "backend_a", "backend_b", "backend_c"]
    assert [(g.values, g.default) for g in pipeline.fuse_genes()] == [((True, False), True), ((False, True), False)]
    assert {g.default for g in pipeline.backend_genes()} == {"x"}
    values = {"fuse_a_b": True, "fuse_b_c": False, "backend_a": "y", "backend_b": "y", "backend_c": "x"}
    assert pipeline.groups(values) == [(("a", "b"), "y"), (("c",), "x")]
    assert pipeline.partition((False, True)) == [("a",), ("b", "c")]
    assert pipeline.constraint().violation(values) is None
    assert "fuse_a_b=True joins stages 'a' and 'b'" in pipeline.constraint().violation({**values, "backend_b": "x"})
