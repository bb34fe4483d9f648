"""A run directory belongs to one run: bad configs and bad --out are one-line errors that leave nothing
behind, a finished run is not resumed, and resume checks every generation's Parquet file against the
journal (rebuilding a damaged one, or naming it). In-process CLI calls: nothing here starts Ray."""
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from evo.cli import main
from evo.driver.config import config_from_dict
from evo.evidence.journal import SCHEMA, evidence_row
from evo.core.records import EvalResult, Evaluated, Proposal
from evo.driver.resume import RunDirError, load_run, write_marker
from evo.driver.rundir import verify_generations
from evo.workloads.base import DeviceInfo
from tests.fake_workload import WORKLOAD

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "configs" / "kda_smoke.yaml")

BAD = {
    "unparsable --set": ["--set", "search.generations=["],
    "unknown preset": ["--set", "preset=gpu"],
    "unknown workload": ["--set", "workload=nope"],
    "unknown baseline": ["--set", "baselines=[nope]"],
    "illegal gene value": ["--set", "genes.backend_intra=[nope]"],
    "negative wall time": ["--set", "search.max_wall_s=-1"],
}


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_bad_config_is_one_line_exit_2_and_leaves_no_run_directory(tmp_path, capsys, kind):
    out = tmp_path / "run"
    assert main(["run", SMOKE, "--out", str(out), *BAD[kind]]) == 2
    one_line_error(capsys)
    assert not out.exists()


def test_out_refuses_a_file_another_run_and_a_non_empty_directory(tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    other = tmp_path / "other-run"
    other.mkdir()
    write_marker(other, config_from_dict({}))
    (other / "evidence.jsonl").write_text("")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "data.csv").write_text("1,2")
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    for target, words in ((a_file, "existing file"), (other, "python -m evo resume"), (busy, "not empty")):
        assert main(["run", SMOKE, "--out", str(target)]) == 2
        assert words in one_line_error(capsys)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before  # nothing touched


def test_mlflow_sync_on_an_empty_directory_or_a_file(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for target, words in ((tmp_path / "empty", "not a run directory"), (tmp_path / "file", "is a file")):
        assert main(["mlflow-sync", str(target)]) == 2
        assert words in one_line_error(capsys)


def make_run(path: Path, generations: int, per_generation: int = 2, finished: bool = False,
             db: Path | None = None) -> list[Evaluated]:
    """A run directory as a search leaves it after `generations` complete generations (fake workload)."""
    space = WORKLOAD.gene_space(WORKLOAD.presets()["cpu"], DeviceInfo("cpu", "cpu"))
    genomes = iter(space.make({"impl": impl, "threads": t}) for impl in ("cumsum", "loop", "zeros") for t in (0, 1, 2))
    config = config_from_dict({"workload": "tests.fake_workload", "preset": "cpu",
                               "mlflow": {"tracking_uri": f"sqlite:///{db}" if db else None}})
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(config.to_dict()))
    write_marker(path, config)
    journal = []
    for g in range(generations):
        proposals = [Proposal(next(genomes), (), "seed", "seed", g, index=i) for i in range(per_generation)]
        items = [Evaluated(p, EvalResult(p.hash, "ok", latency_ms=1.0 + p.index, device="cpu")) for p in proposals]
        (path / "generations").mkdir(exist_ok=True)
        pq.write_table(pa.Table.from_pylist([evidence_row(e) for e in items], schema=SCHEMA),
                       path / "generations" / f"gen_{g:04d}.parquet")
        journal += items
    (path / "evidence.jsonl").write_text("".join(json.dumps(evidence_row(e)) + "\n" for e in journal))
    (path / "state.json").write_text(json.dumps({"generation": generations}))
    if finished:
        (path / "summary.json").write_text(json.dumps({"stopped": False, "best_hash": journal[0].proposal.hash,
                                                       "evaluations": len(journal)}))
    return journal


def test_resume_of_a_finished_run_says_so_and_changes_nothing(tmp_path):
    run_dir, db = tmp_path / "run", tmp_path / "mlflow.db"
    make_run(run_dir, 2, finished=True, db=db)
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    done = subprocess.run([sys.executable, "-m", "evo", "resume", str(run_dir)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "finished run" in done.stdout, done.stdout + done.stderr
    assert "run directory:" not in done.stdout  # no search started: no Ray
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before
    assert not db.exists()  # no MLflow run, no model version


def test_resume_rebuilds_a_damaged_parquet_file_from_the_journal(tmp_path):
    run_dir = tmp_path / "run"
    journal = make_run(run_dir, 3)
    damaged = run_dir / "generations" / "gen_0001.parquet"
    damaged.write_bytes(damaged.read_bytes()[:50])  # truncated
    (run_dir / "generations" / "gen_0002.parquet").unlink()
    lines = verify_generations(load_run(run_dir))
    assert len(lines) == 2 and "gen_0001.parquet is unreadable" in lines[0] and "is missing" in lines[1], lines
    for g in range(3):
        table = pq.read_table(run_dir / "generations" / f"gen_{g:04d}.parquet")
        expected = [e.proposal.hash for e in journal if e.proposal.generation == g]
        assert table.column("genome_hash").to_pylist() == expected
    assert verify_generations(load_run(run_dir)) == []  # now consistent


def test_resume_names_a_parquet_file_it_cannot_rebuild(tmp_path, capsys):
    run_dir = tmp_path / "run"
    make_run(run_dir, 2)
    lines = (run_dir / "evidence.jsonl").read_text().splitlines()
    (run_dir / "evidence.jsonl").write_text("\n".join(lines[:2]) + "\n")  # generation 1's results are gone
    (run_dir / "generations" / "gen_0001.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(RunDirError, match="gen_0001.parquet is unreadable"):
        verify_generations(load_run(run_dir))
    assert main(["resume", str(run_dir)]) == 2
    assert "gen_0001.parquet" in one_line_error(capsys)
