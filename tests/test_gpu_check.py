"""The GPU check fits its budget and always reports: run on CPU (the dry run) with a budget too small
for its engines, it still writes the table, lists what it did not reach, and puts a failing test in
the table's header instead of stopping. Its isolation probes (`evaluators.sandbox.isolation_probe`) find what a
candidate left for the next one, and their rows fail on every breach a GPU could report."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from evaluators.sandbox import isolation_probe as probes
from evaluators.sandbox import jail
from evo.workloads.kda.gpu_baselines import missing_baselines

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 40.0
MiB = 1 << 20
needs_jail = pytest.mark.skipif(bool(jail.unavailable()), reason=f"no jail here: {jail.unavailable()}")


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
    assert "preflight arena bounds: skipped (no CUDA)" in table
    assert "preflight candidate files: " + ("ok" if not jail.unavailable() else "skipped") in table
    rows = json.loads((out / "table.json").read_text())["rows"]
    assert len(rows) == 7  # the two dry-run genomes, two baselines and kimi_linear's three rows, each reported once
    assert any(r["status"] == "not reached" for r in rows), rows
    assert table.count("| not reached |") == sum(r["status"] == "not reached" for r in rows)
    assert "gpu check: FAILED: tests" in run.stdout


def test_a_named_baseline_that_cannot_load_is_named_with_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla.ops.kda", None)  # as if fla-core lacked a dependency
    missing = missing_baselines(["fla_chunk_kda", "chunk_pairwise_c64", "nope"], ["chunk_pairwise_c64"])
    assert set(missing) == {"fla_chunk_kda", "nope"}
    assert missing["fla_chunk_kda"].startswith("fla.ops.kda does not import: ")
    assert "available here: ['chunk_pairwise_c64']" in missing["nope"]


@needs_jail
def test_a_candidate_finds_nothing_the_previous_one_left():
    findings = probes.run_probes("cpu", "strict")
    assert probes.files_row(findings)[1] == "ok", findings
    assert probes.arena_row(findings, cuda=False)[1] == "skipped (no CUDA)"


def test_without_the_jail_the_next_candidate_and_the_judge_find_the_markers():
    """The probe is real: unconfined, what the first candidate leaves is there for the next and the judge."""
    findings = probes.run_probes("cpu", "none")
    _, status, detail = probes.files_row(findings)
    assert status == "FAIL", findings
    for where in ("tmp", "shm", "sysv"):
        assert f"the next candidate's {where}" in detail and f"the judge's {where}" in detail


GOOD = probes.Findings(left={"tmp": True, "shm": True, "sysv": True}, seen={"tmp": False, "shm": False, "sysv": False},
                       judge_seen={"tmp": False, "shm": False, "sysv": False},
                       bounds={"pointer": 0x7F0000000000, "size": 4 * MiB, "range": [0x7F0000000000, 4 * MiB],
                               "map_larger": "CUDA_ERROR_INVALID_VALUE"},
                       read_past="AcceleratorError: CUDA error: an illegal memory access was encountered")


def test_the_arena_row_fails_on_every_breach_a_gpu_could_report():
    assert probes.arena_row(GOOD, cuda=True)[1] == "ok"
    bounds = GOOD.bounds
    breaches = {
        "range": replace(GOOD, bounds={**bounds, "range": [0x7F0000000000, 6 * MiB]}),
        "map_larger": replace(GOOD, bounds={**bounds, "map_larger": "allowed"}),
        "unchecked": replace(GOOD, bounds={**bounds, "map_larger": "CudaError: cuMemRetainAllocationHandle failed"}),
        "read_past": replace(GOOD, read_past="read 2097152 bytes past the arena (sum 0)", read_past_returned=True),
        "no probe": replace(GOOD, bounds=None, error="probe engine process: died: exit code 1"),
    }
    for name, findings in breaches.items():
        assert probes.arena_row(findings, cuda=True)[1] == "FAIL", name


def test_the_files_row_fails_on_every_breach_and_on_a_vacuous_probe():
    assert probes.files_row(GOOD)[1] == "ok"
    assert probes.files_row(replace(GOOD, seen={**GOOD.seen, "shm": True}))[1] == "FAIL"
    assert probes.files_row(replace(GOOD, judge_seen={**GOOD.judge_seen, "sysv": True}))[1] == "FAIL"
    assert probes.files_row(replace(GOOD, left={**GOOD.left, "tmp": "PermissionError: ..."}))[1] == "FAIL"
    assert probes.files_row(GOOD, strict=False)[1].startswith("skipped")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@needs_jail
def test_a_jailed_cuda_candidate_reaches_nothing_beyond_its_arena_and_files():
    findings = probes.run_probes("cuda", "strict")
    rows = probes.rows(findings, cuda=True, strict=True)
    assert [status for _, status, _ in rows] == ["ok", "ok"], rows
