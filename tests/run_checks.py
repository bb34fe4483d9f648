"""Invariants every finished or stopped run directory keeps, wherever it ran (one node or a cluster)."""
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from evo.evidence.journal import read_generations
from evo.core.genome import Genome
from evo.core.records import STATUSES


ROOT = Path(__file__).resolve().parents[1]


def run_evo(*args: str, crash_at: str | None = None, env: dict[str, str] | None = None,
            timeout_s: float = 240) -> subprocess.CompletedProcess:
    """`python -m evo ARGS` in its own session (with EVO_CRASH_AT=crash_at: killed there by SIGKILL);
    whatever it leaves running (Ray's helpers share its process group) is stopped by that group."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", **(env or {})}
    env.pop("EVO_CRASH_AT", None)
    if crash_at:
        env["EVO_CRASH_AT"] = crash_at
    process = subprocess.Popen([sys.executable, "-m", "evo", *args], cwd=ROOT, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(process.args, process.returncode, output)


def journal(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "evidence.jsonl").read_text().splitlines() if line.strip()]


def check_finished_run(run_dir: Path, generations: int, max_evaluations: int) -> tuple[list[dict], dict]:
    """Evidence complete and consistent: one Parquet file per generation, every journaled result in
    exactly one of them, no genome twice, budget kept, one device type, summary agrees. Returns
    (rows, summary)."""
    files = sorted((run_dir / "generations").glob("gen_*.parquet"))
    assert [f.name for f in files] == [f"gen_{g:04d}.parquet" for g in range(generations)]
    rows = read_generations(run_dir).to_pylist()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(rows) == summary["evaluations"] <= max_evaluations
    hashes = [row["genome_hash"] for row in rows]
    assert len(set(hashes)) == len(hashes), "a genome was evaluated twice"
    for row in rows:
        assert Genome.from_json(row["genome"]).hash == row["genome_hash"]
        assert row["status"] in STATUSES and row["agent"] and row["move"]
        assert set(row["parents"]) <= set(hashes)
        if row["status"] == "ok":
            assert math.isfinite(row["latency_ms"]) and row["latency_ms"] > 0 and row["device"]
        else:
            assert row["message"]
    assert len({row["device"] for row in rows if row["device"]}) == 1, "timings from two device types"
    journal = (run_dir / "evidence.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["genome_hash"] for line in journal) == sorted(hashes)
    best = next(r for r in rows if r["genome_hash"] == summary["best_hash"])
    assert summary["best_latency_ms"] == best["latency_ms"]
    if not summary.get("intensification"):  # a single timing decides; else the incumbent, confirmed paired
        assert summary["best_latency_ms"] == min(r["latency_ms"] for r in rows if r["status"] == "ok")
    assert sum(summary["status_counts"].values()) == summary["evaluations"]
    assert summary["lineage"][0]["hash"] == summary["best_hash"]
    return rows, summary


def check_stopped_run(run_dir: Path) -> tuple[list[dict], dict]:
    """A run stopped mid-search: no genome twice in the journal, the summary says stopped and counts
    the journal, and the complete generations' Parquet files and checkpoint hold exactly the journaled
    results of those generations. Returns (journal rows, checkpoint state)."""
    rows = journal(run_dir)
    hashes = [row["genome_hash"] for row in rows]
    assert len(hashes) == len(set(hashes)), "a genome was evaluated twice"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"] is True and summary["evaluations"] == len(hashes)
    state = json.loads((run_dir / "state.json").read_text())
    complete = {row["genome_hash"] for row in rows if row["generation"] < state["generation"]}
    parquet = {row["genome_hash"] for g in range(state["generation"])
               for row in pq.read_table(run_dir / "generations" / f"gen_{g:04d}.parquet").to_pylist()}
    assert parquet == complete == set(state["evaluated"])
    return rows, state
