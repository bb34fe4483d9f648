"""Evidence on disk: every result as it lands, one Parquet file per generation, a checkpoint, a summary.

Run directory layout:
  config.yaml                 the resolved config
  evidence.jsonl              one line per result (and when it arrived), appended and fsynced as each arrives
  generations/gen_0000.parquet one row per candidate of the generation (written before it is reported)
  baselines.json              each baseline's result
  state.json                  search state after the last complete generation (agent statistics, RNG)
  best_genome.json            the best genome so far
  summary.json                best genome, latencies, speedups, evaluations, count per status
  code/<hash>.py              engine sources named by genomes' code genes (evo.core.code.CodeStore)
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from evo.core.faults import crash_point
from evo.core.records import EvalResult, Evaluated, Proposal
from evo.core.genome import Genome
from evo.core.search import GenerationReport, Search

SCHEMA = pa.schema([
    ("generation", pa.int32()), ("index", pa.int32()), ("genome_hash", pa.string()), ("genome", pa.string()),
    ("parents", pa.list_(pa.string())), ("agent", pa.string()), ("move", pa.string()), ("move_kind", pa.string()),
    ("status", pa.string()), ("message", pa.string()), ("error", pa.string()),
    ("latency_ms", pa.float64()), ("latency_spread_ms", pa.float64()), ("max_rel_error", pa.float64()),
    ("build_s", pa.float64()), ("eval_s", pa.float64()), ("device", pa.string()), ("threads", pa.int32()),
    ("evaluator", pa.string()), ("versions", pa.string()), ("roofline_floor_ms", pa.float64()),
    ("notes", pa.string()),  # the proposing agent's JSON notes (code agent: prompt artifact, tokens, cost)
])


def evidence_row(item: Evaluated) -> dict[str, Any]:
    p, r = item.proposal, item.result
    return {
        "generation": p.generation, "index": p.index, "genome_hash": p.hash, "genome": p.genome.to_json(),
        "parents": list(p.parents), "agent": p.agent, "move": p.move, "move_kind": p.move_kind,
        "status": r.status, "message": r.message, "error": r.error, "latency_ms": r.latency_ms,
        "latency_spread_ms": r.latency_spread_ms, "max_rel_error": r.max_rel_error, "build_s": r.build_s,
        "eval_s": r.eval_s, "device": r.device, "threads": r.threads, "evaluator": r.evaluator,
        "versions": json.dumps(r.versions, sort_keys=True), "roofline_floor_ms": r.roofline_floor_ms,
        "notes": p.notes,
    }


def write_json(path: Path, data: Any) -> None:
    """Write atomically (temp file, fsync, rename) so a reader never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(_finite(data), f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _finite(data: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(v) for v in data]
    return data


class DiskEvidence:
    """Sink writing the journal per result and the Parquet file and checkpoint per generation."""

    def __init__(self, run_dir: Path, journaled: set[str] = frozenset()) -> None:
        self.run_dir = Path(run_dir)
        (self.run_dir / "generations").mkdir(parents=True, exist_ok=True)
        self._journal = open(self.run_dir / "evidence.jsonl", "a")
        self._journaled = set(journaled)  # results already in the journal (a resumed run replays them)

    def on_result(self, evaluated: Evaluated) -> None:
        if evaluated.proposal.hash in self._journaled:
            return
        self._journaled.add(evaluated.proposal.hash)
        row = {**evidence_row(evaluated), "recorded_at": time.time()}  # when it arrived: best-so-far over wall time
        self._journal.write(json.dumps(_finite(row), sort_keys=True) + "\n")
        self._journal.flush()
        os.fsync(self._journal.fileno())

    def on_generation(self, report: GenerationReport, search: Search) -> None:
        path = self.generation_path(report.generation)
        rows = [evidence_row(e) for e in report.evaluated]
        tmp = path.with_suffix(".parquet.tmp")
        pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), tmp)
        os.replace(tmp, path)
        crash_point("evidence")
        write_json(self.run_dir / "state.json", search.state())
        if report.best is not None:
            write_json(self.run_dir / "best_genome.json", report.best.proposal.genome.to_dict())

    def generation_path(self, generation: int) -> Path:
        return self.run_dir / "generations" / f"gen_{generation:04d}.parquet"

    def close(self) -> None:
        self._journal.close()


def evaluated_from_row(row: dict[str, Any]) -> Evaluated:
    """The inverse of `evidence_row`: every EvalResult field the row has (JSON nulls back to NaN)."""
    proposal = Proposal(genome=Genome.from_json(row["genome"]), parents=tuple(row["parents"]), agent=row["agent"],
                        move=row["move"], generation=row["generation"], move_kind=row["move_kind"], index=row["index"],
                        notes=row.get("notes") or "")
    values = {f.name: row[f.name] for f in dataclasses.fields(EvalResult) if f.name in row}
    values["versions"] = json.loads(values.get("versions") or "{}")
    return Evaluated(proposal, EvalResult.from_dict(values))


def write_baselines(run_dir: Path, baselines: dict[str, EvalResult]) -> None:
    write_json(Path(run_dir) / "baselines.json", {name: r.to_dict() for name, r in baselines.items()})


def read_generations(run_dir: Path) -> pa.Table:
    """All generations' evidence as one table."""
    files = sorted((Path(run_dir) / "generations").glob("gen_*.parquet"))
    return pa.concat_tables([pq.read_table(f) for f in files]) if files else SCHEMA.empty_table()
