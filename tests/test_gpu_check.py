"""The GPU check fits its budget and always reports: run on CPU (the dry run) with a budget too small
for its engines, it still writes the table, lists what it did not reach, and puts a failing test in
the table's header instead of stopping."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from evo.workloads.kda.gpu_baselines import missing_baselines

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 40.0


def test_a_tiny_budget_still_writes_the_table_with_not_reached_rows(tmp_path):
    failing = tmp_path / "test_fails.py"
    failing.write_text("def test_fails():\n    assert 1 == 2\n")
    out = tmp_path / "out"
    start = time.monotonic()
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run", "--budget-s",
                          str(BUDGET_S), "--out", str(out), "--tests", f"{failing} --rootdir {tmp_path}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=BUDGET_S + 60)
    wall = time.monotonic() - start
    table = (out / "table.md").read_text()
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]  # the failing test, nothing else
    assert wall < BUDGET_S + 20, f"{wall:.0f} s for a {BUDGET_S:.0f} s budget"
    assert "- tests: FAILED" in table and "1 failed" in table
    assert "preflight device: skipped (no CUDA)" in table
    rows = json.loads((out / "table.json").read_text())["rows"]
    assert len(rows) == 4  # the two dry-run genomes and two baselines, each reported once
    assert any(r["status"] == "not reached" for r in rows), rows
    assert table.count("| not reached |") == sum(r["status"] == "not reached" for r in rows)
    assert "gpu check: FAILED: tests" in run.stdout


def test_a_named_baseline_that_cannot_load_is_named_with_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla.ops.kda", None)  # as if fla-core lacked a dependency
    missing = missing_baselines(["fla_chunk_kda", "chunk_pairwise_c64", "nope"], ["chunk_pairwise_c64"])
    assert set(missing) == {"fla_chunk_kda", "nope"}
    assert missing["fla_chunk_kda"].startswith("fla.ops.kda does not import: ")
    assert "available here: ['chunk_pairwise_c64']" in missing["nope"]
