"""`python -m evo bench`: runs with Ray and MLflow unimportable, evaluates genomes and baselines in one
process and writes the table; head-blocked baselines agree with the unblocked ones; fla is optional."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from evo.bench.bench import make_rows, markdown
from evo.core.records import EvalResult
from evo.workloads import get_workload
from evo.workloads.base import CheckCase
from evo.workloads.kda.baselines import chunk_pairwise
from evo.workloads.kda.gpu_baselines import fla_kernels, head_blocked, heads_per_block

ROOT = Path(__file__).resolve().parents[1]
W = get_workload("kda")

BLOCKER = '''
import importlib.abc, sys
class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "mlflow"):
            raise ImportError(f"{name} is blocked: this box has neither ray nor mlflow")
sys.meta_path.insert(0, _Blocked())
'''


def test_bench_runs_without_ray_or_mlflow(tmp_path: Path) -> None:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCKER)
    genomes = tmp_path / "genomes.json"
    genomes.write_text(json.dumps([{"chunk_size": 32}]))
    out = tmp_path / "bench"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = f"{tmp_path / 'site'}{os.pathsep}{ROOT}"
    cmd = [sys.executable, "-m", "evo", "bench", "configs/kda_cpu.yaml", "--genomes", str(genomes),
           "--baselines", "chunk_pairwise_c64", "--out", str(out), "--set", "preset=cpu_small",
           "--set", "evaluator.warmup=0", "--set", "evaluator.repeats=2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "MLflow not installed" in proc.stdout
    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert len(rows) == 2 and {r["source"] for r in rows} == {"genome", "baseline"}
    assert all(r["status"] == "ok" and r["median_ms"] > 0 for r in rows), rows
    assert all(r["reference"] == "chunk_pairwise_c64" for r in rows)
    table = json.loads((out / "table.json").read_text())
    assert table["environment"]["device"].startswith("cpu")
    assert "| engine |" in (out / "table.md").read_text() and "speedup vs chunk_pairwise_c64" in proc.stdout
    # the blocker really blocks: the same interpreter cannot import ray
    probe = subprocess.run([sys.executable, "-c", "import ray"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "blocked" in probe.stderr


def _result(name: str, status: str, ms: float) -> EvalResult:
    return EvalResult(genome_hash=name, status=status, latency_ms=ms, latency_spread_ms=0.1, roofline_floor_ms=1.0)


def test_speedups_are_against_chunk_kda_when_present() -> None:
    entries = [("baseline:fla_chunk_kda", "baseline", None, _result("a", "ok", 3.0)),
               ("baseline:eager", "baseline", None, _result("b", "ok", 2.0)),
               ("g1", "genome", None, _result("c", "ok", 1.5)),
               ("g2", "genome", None, _result("d", "incorrect", math.nan))]
    rows = make_rows(entries, "fla_chunk_kda")
    assert [r.engine for r in rows] == ["g1", "baseline:eager", "baseline:fla_chunk_kda", "g2"]
    assert rows[0].speedup == pytest.approx(2.0) and rows[0].fraction_of_roofline == pytest.approx(1 / 1.5)
    assert math.isnan(rows[-1].speedup) and rows[0].reference == "fla_chunk_kda"
    assert "speedup vs fla_chunk_kda" in markdown(rows, "t") and "| g2 | genome | incorrect | — |" in markdown(rows, "t")
    without = make_rows(entries[1:], "fla_chunk_kda")
    assert without[0].reference == "eager" and without[0].speedup == pytest.approx(2.0 / 1.5)


def test_head_blocks_agree_with_one_pass() -> None:
    inputs = W.make_inputs(CheckCase("x", {"B": 2, "T": 70, "H": 5, "K": 16, "V": 8}, "strong_decay", True),
                           "float32", "cpu", 3)
    whole, blocked = chunk_pairwise(**inputs), head_blocked(chunk_pairwise, block=2)(**inputs)
    torch.testing.assert_close(blocked["o"], whole["o"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(blocked["final_state"], whole["final_state"], rtol=1e-6, atol=1e-6)


def test_h200_pairwise_blocks_fit() -> None:
    hb = heads_per_block(B=1, T=8192, K=128, chunk=64, device="cuda")
    assert 1 <= hb < 96  # the whole preset (96 heads, ~100 GiB of temporaries) does not fit at once
    assert hb * 4 * 128 * 64 * 64 * 128 * 4 <= 8 << 30


def test_fla_baselines_absent_when_not_importable() -> None:
    import importlib.util

    if importlib.util.find_spec("fla") is not None:
        pytest.skip("fla-core is installed here")
    assert fla_kernels() == {}
    names = set(W.baselines(W.presets()["h200"]))
    assert not {"fla_chunk_kda", "fla_fused_recurrent_kda"} & names
    assert {"eager_recurrent", "chunk_pairwise_c64"} <= names


def test_gpu_check_genome_files_are_legal(monkeypatch) -> None:
    """scripts/gpu_check.sh's genomes: legal at h200 on CUDA, and at cpu_small under the interpreter."""
    import importlib.util

    from evo.bench.bench import genomes_from_file
    from evo.workloads.base import DeviceInfo

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    h200 = genomes_from_file(str(ROOT / "configs/bench_h200_genomes.json"),
                             W.gene_space(W.presets()["h200"], DeviceInfo("cuda", "x", 1)))
    assert len({g.hash for g in h200}) == 6 and {g["engine"] for g in h200} == {"triton", "torch"}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu = genomes_from_file(str(ROOT / "configs/bench_cpu_triton_genomes.json"),
                            W.gene_space(W.presets()["cpu_small"], DeviceInfo("cpu", "x", 1)))
    assert len(cpu) == 2 and all(g["engine"] == "triton" for g in cpu)
