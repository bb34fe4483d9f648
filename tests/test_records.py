"""Typed records and their files: one JSONL reader with one torn-line policy, the summary as a dataclass,
proposals' metrics and artifacts, the Parquet schema derived from the records, sinks closed in reverse,
and a run directory written by an earlier version (notes as a JSON string, an older summary.json)
that still loads, resumes and reports. Nothing here starts Ray."""
import dataclasses
import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from evo.core.jsonl import JsonlError, read_jsonl, trim_torn_tail
from evo.core.records import EvalResult, Evaluated, Proposal, split_notes
from evo.driver.config import config_from_dict
from evo.driver.resume import RunDirError, load_run, write_marker
from evo.driver.rundir import finished, verify_generations
from evo.evidence.journal import SCHEMA, DiskEvidence, evaluated_from_row, evidence_row, read_generations
from evo.evidence.lineage import candidate_table, load_lineage
from evo.evidence.sink import FAILED, KILLED, Sink, SinkList
from evo.evidence.summary import Summary
from evo.workloads.base import DeviceInfo
from tests.fake_workload import WORKLOAD

SPACE = WORKLOAD.gene_space(WORKLOAD.presets()["cpu"], DeviceInfo("cpu", "cpu"))

# The evidence columns as evo/evidence/journal.py wrote them by hand before the schema was derived.
OLD_SCHEMA = pa.schema([
    ("generation", pa.int32()), ("index", pa.int32()), ("genome_hash", pa.string()), ("genome", pa.string()),
    ("parents", pa.list_(pa.string())), ("agent", pa.string()), ("move", pa.string()), ("move_kind", pa.string()),
    ("status", pa.string()), ("message", pa.string()), ("error", pa.string()),
    ("latency_ms", pa.float64()), ("latency_spread_ms", pa.float64()), ("max_rel_error", pa.float64()),
    ("build_s", pa.float64()), ("eval_s", pa.float64()), ("device", pa.string()), ("threads", pa.int32()),
    ("evaluator", pa.string()), ("versions", pa.string()), ("roofline_floor_ms", pa.float64()),
    ("notes", pa.string()),
])
SCHEMA_WITH_SERVING = pa.schema([*(f for f in OLD_SCHEMA if f.name != "notes"), ("serving", pa.string()),
                                 ("notes", pa.string())])  # a generation engine's replay figures (JSON)
SCHEMA_WITH_ACCURACY = pa.schema([*(f for f in SCHEMA_WITH_SERVING if f.name != "notes"), ("accuracy", pa.string()),
                                  ("notes", pa.string())])  # its loss against the float64 reference (JSON)
SCHEMA_WITH_FIDELITY = pa.schema([*(f for f in SCHEMA_WITH_ACCURACY if f.name != "notes"), ("fidelity", pa.string()),
                                  ("notes", pa.string())])  # how it was timed: full, or screen (shorter replays)


# An evaluation's loss against the float64 reference as the generation judge records it (EvalResult.accuracy).
LOSS = {"mode": "budget", "budget": {"min_agreement": 0.9, "max_mean_gap": 0.05, "max_gap": 0.3, "tie_window": 0.15,
                                     "tie_alpha": 0.001, "request_alpha": 0.001, "basis": "config"},
        "steps": 208, "requests": 38, "agreement": 0.994, "agreement_ci": [0.991, 0.996], "mean_gap": 0.003,
        "mean_gap_ci": [0.001, 0.005], "max_gap": 0.12, "max_gap_at": "request 5 step 3", "ties": 65, "tie_flips": 10,
        "tie_p": 0.99}


# --- one JSONL reader ----------------------------------------------------------------------------

def test_a_torn_last_line_is_skipped_and_any_other_damage_is_named(tmp_path):
    path = tmp_path / "log.jsonl"
    assert read_jsonl(path) == []
    path.write_text('{"a": 1}\n\n{"b": 2}\n{"c": ')  # a crash mid-append leaves the last line without newline
    assert read_jsonl(path) == [{"a": 1}, {"b": 2}]
    path.write_text('{"a": 1}\n{"b": \n{"c": 3}\n')
    with pytest.raises(JsonlError, match=r"log.jsonl:2 is corrupt"):
        read_jsonl(path)
    path.write_text('{"a": 1}\n{"b": \n')  # a whole line (it has its newline) that is damaged is not torn
    with pytest.raises(JsonlError, match=r"log.jsonl:2 is corrupt"):
        read_jsonl(path)
    path.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(JsonlError, match=r"log.jsonl:2 is corrupt \(a JSON list"):
        read_jsonl(path)


def test_appending_after_a_torn_line_starts_a_fresh_line(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"a": 1}\n{"b": 2')
    assert trim_torn_tail(path) and path.read_text() == '{"a": 1}\n'
    assert not trim_torn_tail(path) and not trim_torn_tail(tmp_path / "missing.jsonl")
    # the journal, reopened by a resumed run after a kill mid-append, stays readable to the end
    items = evaluated(3)
    disk = DiskEvidence(tmp_path)
    disk.on_result(items[0])
    disk.close()
    journal = tmp_path / "evidence.jsonl"
    journal.write_text(journal.read_text() + '{"generation": 0, "ind')
    disk = DiskEvidence(tmp_path)
    for item in items[1:]:
        disk.on_result(item)
    disk.close()
    assert [evaluated_from_row(r).proposal.hash for r in read_jsonl(journal)] == [e.proposal.hash for e in items]


def test_the_mlflow_outbox_reads_its_file_with_the_same_reader(tmp_path):
    from evo.evidence.mlflow.outbox import OUTBOX_FILE, Outbox

    (tmp_path / OUTBOX_FILE).write_text('{"op": "terminate", "run": "x/parent"}\n{"op": "ba')
    outbox = Outbox(tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}", "e")
    assert outbox.ops == [{"op": "terminate", "run": "x/parent"}]
    outbox.add({"op": "terminate", "run": "y/parent"})
    assert read_jsonl(tmp_path / OUTBOX_FILE) == [{"op": "terminate", "run": "x/parent"},
                                                  {"op": "terminate", "run": "y/parent"}]
    (tmp_path / OUTBOX_FILE).write_text('{"op": \n{"op": "terminate", "run": "x/parent"}\n')
    with pytest.raises(JsonlError, match=f"{OUTBOX_FILE}:1 is corrupt"):
        Outbox(tmp_path)


# --- records ---------------------------------------------------------------------------------------

def evaluated(n: int, generation: int = 0, **proposal) -> list[Evaluated]:
    genomes = [SPACE.make({"impl": impl, "threads": t}) for impl in ("cumsum", "loop", "zeros") for t in (0, 1, 2)]
    out = []
    for i, genome in enumerate(genomes[:n]):
        p = Proposal(genome, (), "seed", "seed", generation, index=i, **proposal)
        out.append(Evaluated(p, EvalResult(p.hash, "ok", latency_ms=1.0 + i, device="cpu", versions={"torch": "2"})))
    return out


def test_the_parquet_schema_is_derived_from_the_records_and_matches_the_files_already_written(tmp_path):
    assert SCHEMA.equals(SCHEMA_WITH_FIDELITY)
    generations = tmp_path / "generations"
    generations.mkdir()
    pq.write_table(OLD_SCHEMA.empty_table(), generations / "gen_0000.parquet")  # written before `serving`
    pq.write_table(SCHEMA_WITH_SERVING.empty_table(), generations / "gen_0001.parquet")  # before `accuracy`
    pq.write_table(SCHEMA_WITH_ACCURACY.empty_table(), generations / "gen_0003.parquet")  # before `fidelity`
    lossy = dataclasses.replace(evaluated(1)[0], result=dataclasses.replace(evaluated(1)[0].result, accuracy=LOSS))
    pq.write_table(pa.Table.from_pylist([evidence_row(lossy)], schema=SCHEMA), generations / "gen_0002.parquet")
    row, = read_generations(tmp_path).to_pylist()
    assert evaluated_from_row(row).result.accuracy == LOSS  # the loss is stored and read back whole
    assert evaluated_from_row({**row, "fidelity": None}).result.fidelity == "full"  # an older row: the whole trace
    item, = evaluated(1, metrics={"tokens_in": 12, "cost_usd": 0.5}, artifacts={"prompt": "agent/p.json"})
    row = evidence_row(item)
    assert list(row) == SCHEMA.names
    assert json.loads(row["notes"]) == {"tokens_in": 12, "cost_usd": 0.5, "prompt": "agent/p.json"}
    assert evaluated_from_row(row) == item
    assert evidence_row(evaluated(1)[0])["notes"] == ""  # no agent notes: the empty string, as always


def test_notes_split_into_metrics_and_artifacts():
    assert split_notes('{"calls": 2, "cost_usd": 0.1, "prompt": "a.json", "stage": "s"}') == \
        ({"calls": 2, "cost_usd": 0.1}, {"prompt": "a.json", "stage": "s"})
    assert split_notes("") == ({}, {}) and split_notes(None) == ({}, {}) and split_notes("{not json") == ({}, {})


def test_the_summary_round_trips_and_reads_older_files():
    full = Summary(workload="w", preset="cpu", best_hash="abc", best_genome={"fusion": {}}, best_latency_ms=2.0,
                   speedups={"eager": 3.0}, evaluations=4, stopped=True, best_sources={"h": "src"})
    back = Summary.from_dict(json.loads(json.dumps(full.to_dict()).replace("NaN", "null")))
    assert back.to_dict().keys() == full.to_dict().keys() and back.best_sources == {"h": "src"}
    assert back.stopped and math.isnan(back.best_latency_spread_ms) and back.found
    old = Summary.from_dict({"workload": "w", "preset": "cpu", "best_hash": None, "best_genome": None,
                             "best_latency_ms": None, "evaluations": 3, "an_unknown_key": 1})
    assert not old.found and math.isnan(old.best_latency_ms) and old.best_sources == {} and not old.stopped
    with pytest.raises(ValueError, match="a summary is a JSON object, got list"):
        Summary.from_dict([])


# --- sinks -----------------------------------------------------------------------------------------

def test_sinks_close_in_reverse_order_even_when_one_fails():
    closed = []

    class Recorder(Sink):
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def close(self, summary=None, status="FINISHED"):
            closed.append((self.name, status, summary))
            if self.fail:
                raise RuntimeError("boom")

    with pytest.raises(KeyError):
        with SinkList([Recorder("disk"), Recorder("mlflow", fail=True), Recorder("lineage")]):
            raise KeyError("the run failed")
    assert closed == [("lineage", FAILED, None), ("mlflow", FAILED, None), ("disk", FAILED, None)]
    closed.clear()
    summary = Summary(workload="w")
    with SinkList([Recorder("a"), Recorder("b")]) as sinks:
        Recorder("a").on_result(None)  # the base's hooks do nothing
        sinks.end(summary, KILLED)
    assert closed == [("b", KILLED, summary), ("a", KILLED, summary)]


# --- a run directory of an earlier version ---------------------------------------------------------

def old_run_dir(path):
    """A run directory as the version before typed records wrote it: notes a JSON string in the journal and
    Parquet, Parquet in the old hand-written schema, a summary.json without the keys added since."""
    config = config_from_dict({"workload": "tests.fake_workload", "preset": "cpu"})
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(config.to_dict()))
    write_marker(path, config)
    genomes = [SPACE.make({"impl": "cumsum", "threads": t}) for t in (0, 1)]
    notes = json.dumps({"calls": 1, "tokens_in": 100, "tokens_out": 20, "cost_usd": 0.25, "repairs": 0,
                        "prompt": "agent/0001.json", "stage": "impl", "code_hash": "c0ffee", "model": "m"})
    rows = []
    for i, genome in enumerate(genomes):
        rows.append({"generation": 0, "index": i, "genome_hash": genome.hash, "genome": genome.to_json(),
                     "parents": [genomes[0].hash] if i else [], "agent": "code" if i else "seed",
                     "move": "edit" if i else "seed", "move_kind": "edit:impl" if i else "", "status": "ok",
                     "message": "", "error": "", "latency_ms": 2.0 - i * 0.5, "latency_spread_ms": 0.1,
                     "max_rel_error": 1e-7, "build_s": 0.01, "eval_s": 0.2, "device": "cpu:test", "threads": 1,
                     "evaluator": "evaluator-0", "versions": json.dumps({"torch": "2.5"}),
                     "roofline_floor_ms": None, "notes": notes if i else "", "recorded_at": 1_700_000_000.0 + i})
    (path / "evidence.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    (path / "generations").mkdir()
    parquet_rows = [{k: v for k, v in r.items() if k != "recorded_at"} for r in rows]
    pq.write_table(pa.Table.from_pylist(parquet_rows, schema=OLD_SCHEMA), path / "generations" / "gen_0000.parquet")
    (path / "state.json").write_text(json.dumps({"generation": 1}))
    (path / "summary.json").write_text(json.dumps({  # as an early version wrote it: no stopped, sources, ...
        "workload": "tests.fake_workload", "preset": "cpu", "best_hash": genomes[1].hash,
        "best_genome": genomes[1].to_dict(), "best_latency_ms": 1.5, "best_latency_spread_ms": 0.1,
        "best_max_rel_error": 1e-7, "device": "cpu:test", "threads": 1, "baselines": {}, "best_baseline": None,
        "best_baseline_latency_ms": None, "speedup_vs_best_baseline": None, "speedups": {}, "roofline": None,
        "lineage": [], "evaluations": 2, "generations": 1, "status_counts": {"ok": 2}, "wall_s": 3.0,
        "mlflow_run_id": None}))
    return genomes


def test_a_run_directory_of_an_earlier_version_still_loads(tmp_path):
    genomes = old_run_dir(tmp_path / "run")
    saved = load_run(tmp_path / "run")
    seed, child = saved.journal
    assert seed.proposal.metrics == {} and seed.proposal.artifacts == {}
    assert child.proposal.metrics == {"calls": 1, "tokens_in": 100, "tokens_out": 20, "cost_usd": 0.25, "repairs": 0}
    assert child.proposal.artifacts == {"prompt": "agent/0001.json", "stage": "impl", "code_hash": "c0ffee",
                                        "model": "m"}
    assert child.result.versions == {"torch": "2.5"} and math.isnan(child.result.roofline_floor_ms)
    assert verify_generations(saved) == []  # the old Parquet file agrees with the journal: nothing rebuilt
    done = finished(tmp_path / "run")
    assert isinstance(done, Summary) and done.best_hash == genomes[1].hash and done.best_sources == {}
    # written back, the notes are what they were; old and new Parquet files read as one table
    assert json.loads(evidence_row(child)["notes"]) == json.loads(saved.journal[1].proposal.notes_json())
    pq.write_table(pa.Table.from_pylist([evidence_row(e) for e in saved.journal], schema=SCHEMA),
                   tmp_path / "run" / "generations" / "gen_0001.parquet")
    assert read_generations(tmp_path / "run").num_rows == 4
    lineage = load_lineage(tmp_path / "run")
    assert lineage.best == genomes[1].hash and lineage.summary.evaluations == 2
    row = candidate_table([child], {seed.proposal.hash: seed})[0]
    assert row["code_hash"] == "c0ffee" and row["tokens"] == 120 and row["cost_usd"] == 0.25
    assert row["prompt"] == "agent/0001.json" and row["code_diff"] == f"diffs/{child.proposal.hash}.diff"


def test_a_corrupt_journal_line_names_the_file_and_line(tmp_path):
    old_run_dir(tmp_path / "run")
    journal = tmp_path / "run" / "evidence.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text(lines[0][:40] + "\n" + lines[1])
    with pytest.raises(RunDirError, match=r"evidence.jsonl:1 is corrupt"):
        load_run(tmp_path / "run")
    journal.write_text(lines[0] + lines[1][:40])  # torn by a kill: that result was never reported
    assert len(load_run(tmp_path / "run").journal) == 1
