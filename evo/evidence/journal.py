"""Evidence on disk: every result as it lands, one Parquet file per generation, a checkpoint, a summary.

Run directory layout:
  config.yaml                 the resolved config
  evidence.jsonl              one line per result (and when it arrived), appended and fsynced as each arrives
  generations/gen_0000.parquet one row per candidate of the generation (written before it is reported)
  baselines.json              each baseline's result
  state.json                  search state after the last complete generation (agent statistics, RNG)
  best_genome.json            the best genome so far (at the end: the summary's, after the final race)
  summary.json                best genome, latencies, speedups (with their paired intervals), evaluations, count per status
  retimings.jsonl             one line per paired re-timing (intensification, the final one against the
                              baselines, the race against the registered @champion), appended and fsynced;
                              retimings/gen_0000.parquet per generation
  code/<hash>.py              engine sources named by genomes' code genes (evo.core.code.CodeStore)
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from evo.core.faults import crash_point
from evo.core.jsonl import append_line, read_jsonl, trim_torn_tail
from evo.core.records import EvalResult, Evaluated, Proposal, null_for_nan, split_notes
from evo.core.retiming import PairedTiming
from evo.core.genome import Genome
from evo.core.search import GenerationReport, Search
from evo.evidence.sink import FINISHED, Sink

JOURNAL_FILE = "evidence.jsonl"
RETIMINGS_FILE = "retimings.jsonl"
BEST_GENOME_FILE = "best_genome.json"

# The evidence's columns: a proposal's (named once here, in the order files have always had), then every
# EvalResult field but the genome hash in the record's order, then the proposing agent's notes (its
# `metrics` and `artifacts` as one JSON object; a code agent: prompt artifact, tokens, cost).
PROPOSAL_COLUMNS: tuple[tuple[str, pa.DataType], ...] = (
    ("generation", pa.int32()), ("index", pa.int32()), ("genome_hash", pa.string()), ("genome", pa.string()),
    ("parents", pa.list_(pa.string())), ("agent", pa.string()), ("move", pa.string()), ("move_kind", pa.string()))
_ARROW_TYPES = {"str": pa.string(), "float": pa.float64(), "int": pa.int32()}  # dicts are stored as JSON text
_RESULT_TYPES: dict[str, str] = {f.name: f.type for f in dataclasses.fields(EvalResult) if f.name != "genome_hash"}
RESULT_FIELDS: tuple[str, ...] = tuple(_RESULT_TYPES)
JSON_FIELDS: frozenset[str] = frozenset(name for name, kind in _RESULT_TYPES.items() if kind.startswith("dict"))
SCHEMA = pa.schema([
    *PROPOSAL_COLUMNS,
    *((name, _ARROW_TYPES.get(kind, pa.string())) for name, kind in _RESULT_TYPES.items()),
    ("notes", pa.string()),
])


def evidence_row(item: Evaluated) -> dict[str, Any]:
    """One row of evidence (journal line and Parquet row), with exactly the columns of `SCHEMA`."""
    p, r = item.proposal, item.result
    row: dict[str, Any] = {"generation": p.generation, "index": p.index, "genome_hash": p.hash,
                           "genome": p.genome.to_json(), "parents": list(p.parents), "agent": p.agent,
                           "move": p.move, "move_kind": p.move_kind}
    for name in RESULT_FIELDS:
        value = getattr(r, name)
        row[name] = json.dumps(value, sort_keys=True) if name in JSON_FIELDS else value
    row["notes"] = p.notes_json()
    return row


# A paired re-timing's columns (evo.core.retiming.PairedTiming), its telemetry as JSON text.
RETIMING_SCHEMA = pa.schema([
    ("generation", pa.int32()), ("reason", pa.string()), ("a", pa.string()), ("b", pa.string()),
    ("verdict", pa.string()), ("ratio", pa.float64()), ("low", pa.float64()), ("high", pa.float64()),
    ("min_effect", pa.float64()), ("samples_a_ms", pa.list_(pa.float64())), ("samples_b_ms", pa.list_(pa.float64())),
    ("message", pa.string()), ("wall_s", pa.float64()), ("evaluator", pa.string()), ("device", pa.string()),
    ("telemetry", pa.string()),
])


def retiming_row(timing: PairedTiming) -> dict[str, Any]:
    row = {**timing.to_dict(), "telemetry": json.dumps(timing.telemetry, sort_keys=True)}
    return {name: (list(row[name]) if isinstance(row[name], tuple) else row[name]) for name in RETIMING_SCHEMA.names}


def append_retimings(run_dir: Path, timings: list[PairedTiming]) -> None:
    """Append re-timings to the run's retimings.jsonl (each line fsynced)."""
    if not timings:
        return
    with open(Path(run_dir) / RETIMINGS_FILE, "a") as f:
        for timing in timings:
            append_line(f, null_for_nan({**timing.to_dict(), "recorded_at": time.time()}))


def read_retimings(run_dir: Path, before_generation: int | None = None) -> list[PairedTiming]:
    """The run's re-timings in the order they were recorded (those of generations before
    `before_generation` only, when given; the final ones have generation -1 and are left out then)."""
    path = Path(run_dir) / RETIMINGS_FILE
    if not path.exists():
        return []
    timings = [PairedTiming.from_dict(row) for row in read_jsonl(path)]
    if before_generation is None:
        return timings
    return [t for t in timings if 0 <= t.generation < before_generation]


def keep_retimings(run_dir: Path, before_generation: int) -> None:
    """Drop the re-timings of generations from `before_generation` on (an interrupted generation's: a
    resumed run times them again), atomically."""
    path = Path(run_dir) / RETIMINGS_FILE
    if not path.exists():
        return
    kept = [row for row in read_jsonl(path) if 0 <= int(row.get("generation", -1)) < before_generation]
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w") as f:
        for row in kept:
            append_line(f, row)
    os.replace(tmp, path)


def write_json(path: Path, data: Any) -> None:
    """Write atomically (temp file, fsync, rename) so a reader never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(null_for_nan(data), f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)



class DiskEvidence(Sink):
    """Sink writing the journal per result and the Parquet file and checkpoint per generation."""

    def __init__(self, run_dir: Path, journaled: set[str] = frozenset(), resumed_at: int | None = None) -> None:
        self.run_dir = Path(run_dir)
        (self.run_dir / "generations").mkdir(parents=True, exist_ok=True)
        trim_torn_tail(self.run_dir / JOURNAL_FILE)  # a line cut by a crash: the next one must not glue onto it
        trim_torn_tail(self.run_dir / RETIMINGS_FILE)
        if resumed_at is not None:  # the interrupted generation's re-timings are run again
            keep_retimings(self.run_dir, resumed_at)
        self._journal = open(self.run_dir / JOURNAL_FILE, "a")
        self._journaled = set(journaled)  # results already in the journal (a resumed run replays them)

    def on_result(self, evaluated: Evaluated) -> None:
        if evaluated.proposal.hash in self._journaled:
            return
        self._journaled.add(evaluated.proposal.hash)
        row = {**evidence_row(evaluated), "recorded_at": time.time()}  # when it arrived: best-so-far over wall time
        append_line(self._journal, null_for_nan(row))

    def on_generation(self, report: GenerationReport, search: Search) -> None:
        path = self.generation_path(report.generation)
        rows = [evidence_row(e) for e in report.evaluated]
        tmp = path.with_suffix(".parquet.tmp")
        pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), tmp)
        os.replace(tmp, path)
        if report.retimings:
            append_retimings(self.run_dir, list(report.retimings))
            retimed = self.run_dir / "retimings" / f"gen_{report.generation:04d}.parquet"
            retimed.parent.mkdir(exist_ok=True)
            rows = [retiming_row(t) for t in report.retimings]
            pq.write_table(pa.Table.from_pylist(rows, schema=RETIMING_SCHEMA), retimed.with_suffix(".parquet.tmp"))
            os.replace(retimed.with_suffix(".parquet.tmp"), retimed)
        crash_point("evidence")
        write_json(self.run_dir / "state.json", search.state())
        if report.best is not None:
            write_json(self.run_dir / BEST_GENOME_FILE, report.best.proposal.genome.to_dict())

    def generation_path(self, generation: int) -> Path:
        return self.run_dir / "generations" / f"gen_{generation:04d}.parquet"

    def close(self, summary=None, status: str = FINISHED) -> None:
        self._journal.close()


def evaluated_from_row(row: dict[str, Any]) -> Evaluated:
    """The inverse of `evidence_row`: every EvalResult field the row has (JSON nulls back to NaN), the
    notes split back into metrics and artifacts. Rows of older versions (fewer columns) read too."""
    metrics, artifacts = split_notes(row.get("notes"))
    proposal = Proposal(genome=Genome.from_json(row["genome"]), parents=tuple(row["parents"]), agent=row["agent"],
                        move=row["move"], generation=row["generation"], move_kind=row["move_kind"], index=row["index"],
                        metrics=metrics, artifacts=artifacts)
    values = {f.name: row[f.name] for f in dataclasses.fields(EvalResult) if f.name in row}
    if values.get("fidelity") is None:  # a row written before results said how they were timed: the whole trace
        values.pop("fidelity", None)
    for name in JSON_FIELDS & set(values):
        values[name] = json.loads(values[name] or "{}")
    return Evaluated(proposal, EvalResult.from_dict(values))


def write_baselines(run_dir: Path, baselines: dict[str, EvalResult]) -> None:
    write_json(Path(run_dir) / "baselines.json", {name: r.to_dict() for name, r in baselines.items()})


def read_generations(run_dir: Path) -> pa.Table:
    """All generations' evidence as one table (files of an older version, with fewer columns, read with nulls)."""
    files = sorted((Path(run_dir) / "generations").glob("gen_*.parquet"))
    return pa.concat_tables([pq.read_table(f) for f in files], promote_options="default") if files \
        else SCHEMA.empty_table()
