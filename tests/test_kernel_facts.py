"""Compile facts and the time model (`python -m evo kernels`, `Workload.kernel_facts`) and the search's
pre-screen that reads the model. The compile test runs ptxas for sm_90 (no GPU) in a subprocess."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evaluators.judge.synthetic import SyntheticEvaluator
from evo.core.loop import LocalExecutor, run_search
from evo.core.search import Search, SearchSettings
from evo.workloads import get_workload
from evo.workloads.base import DeviceInfo, Workload
from operators.team import LocalTeam
from tests.toy_space import toy_space

ROOT = Path(__file__).resolve().parents[1]
W = get_workload("kda")
H200 = W.presets()["h200"]
CUDA = DeviceInfo("cuda", "sm90", 1)
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
GB = 1e9


def _modelled(genes: dict) -> tuple[float, float]:
    genome = W.gene_space(H200, CUDA).make({"engine": "triton", **genes})
    facts = W.kernel_facts(genome, H200, CUDA, compile=False)
    return sum(f.hbm_bytes for f in facts), sum(f.model_ms for f in facts)


@needs_triton
def test_the_model_ranks_the_blocked_kernels_under_the_classic_ones() -> None:
    """The classic default moves ~10.6 GB at h200 (float32 workspaces, W and Kd read per V tile), its fused
    form ~5.8 GB; the blocked default <= 6 GB and the best bench genome <= 4 GB."""
    classic = {"triton_kernels": "classic", "num_stages": 1, "num_warps": 4, "block_v": 64}
    classic_bytes, classic_ms = _modelled(classic)
    assert 10.0 * GB < classic_bytes < 11.0 * GB
    assert 5.5 * GB < _modelled({**classic, "fuse_recurrence_output": True, "fuse_l2norm_intra": True})[0] < 6.0 * GB
    blocked_bytes, blocked_ms = _modelled({})
    assert blocked_bytes <= 6.0 * GB and blocked_ms < classic_ms
    bench = json.loads((ROOT / "configs" / "bench_h200_genomes.json").read_text())
    best = min(_modelled({k: v for k, v in g.items() if k != "engine"})[0] for g in bench if g["engine"] == "triton")
    assert best <= 4.0 * GB


def test_workloads_without_kernels_say_so() -> None:
    assert Workload.kernel_facts(W, W.gene_space(H200, CUDA).default(), H200, CUDA) is None  # the base default
    torch_genome = W.gene_space(H200, CUDA).make({"engine": "torch"})
    assert W.kernel_facts(torch_genome, H200, CUDA, compile=False) == ()


@needs_triton
def test_kernels_command_compiles_the_default_genome_spill_free(tmp_path: Path) -> None:
    """`python -m evo kernels CONFIG --json` compiles the default genome's kernels for sm_90 with ptxas:
    no kernel spills, each fits a block's shared memory (~60 s on 2 busy cores)."""
    from evo.workloads.kda.triton import compiled
    from evo.workloads.kda.triton.genes import SHARED_MEMORY_BYTES

    if not compiled.available():
        pytest.skip("this Triton has no ASTSource/CUDABackend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "evo", "kernels", "configs/kda_h200.yaml", "--json"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (entry,) = json.loads(proc.stdout)
    assert entry["genome"] == W.gene_space(H200, CUDA).default().values()
    names = [k["name"] for k in entry["kernels"]]
    assert names == ["intra_blocked_kernel", "recurrence_blocked_kernel", "output_blocked_kernel"]
    for k in entry["kernels"]:
        assert set(k) >= {"name", "registers", "spill_bytes", "shared_bytes", "grid", "hbm_bytes", "model_ms"}
        assert k["spill_bytes"] == 0 and 0 < k["registers"] <= 255, k
        assert 0 < k["shared_bytes"] <= SHARED_MEMORY_BYTES and k["model_ms"] > 0, k
    assert entry["hbm_bytes"] == pytest.approx(sum(k["hbm_bytes"] for k in entry["kernels"]))
    assert entry["hbm_bytes"] <= 6.0 * GB


# ---- the search's pre-screen ----------------------------------------------------------------------
def _search(factor: float, predict, budget: int = 24) -> tuple[Search, SyntheticEvaluator]:
    settings = SearchSettings(seed=3, generations=6, offspring=6, max_evaluations=budget, prescreen_factor=factor)
    space = toy_space()
    search = Search(space, settings, LocalTeam(list(settings.agents), space, settings.seed), predict=predict)
    evaluator = SyntheticEvaluator()
    run_search(search, LocalExecutor(evaluator), [])
    return search, evaluator


def test_prescreen_skips_genomes_modelled_far_slower_and_keeps_the_budget() -> None:
    slow = lambda genome: 100.0 if genome.values()["algorithm"] == "c" else 1.0  # noqa: E731
    search, evaluator = _search(2.0, slow)
    assert search.prescreened and set(search.prescreened.values()) == {100.0}
    assert not set(search.prescreened) & set(search.known)  # skipped, never evaluated
    assert len(evaluator.calls) == search.evaluations <= 24
    best = search.best()
    if slow(best.proposal.genome) == 1.0:  # a fast best bounds the rest: after generation 0 no slow genome ran
        late = [e for e in search.known.values() if e.proposal.generation > 0]
        assert all(slow(e.proposal.genome) == 1.0 for e in late)


def test_prescreen_is_off_by_default() -> None:
    calls = []
    search, _ = _search(0.0, lambda genome: calls.append(genome) or 1.0, budget=8)
    assert not calls and not search.prescreened
    with pytest.raises(ValueError, match="prescreen_factor must be 0 .off. or >= 1, got 0.5"):
        SearchSettings(prescreen_factor=0.5)
