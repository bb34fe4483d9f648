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


def test_illegal_combination_is_explained():
    with pytest.raises(GenomeError, match="illegal combination.*sub_chunk_size=32 must be <= chunk_size=16"):
        toy_space().make({"chunk_size": 16, "sub_chunk_size": 32})
    with pytest.raises(GenomeError, match="fused stages prep and solve"):
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
