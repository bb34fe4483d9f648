"""kill -9 of the driver at several points, then `python -m evo resume`: nothing is evaluated twice,
nothing recorded is lost, the run completes its budget. Plus clear errors for unusable run directories."""
import json
import signal
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from evo.driver.resume import RunDirError, load_run
from tests.run_checks import journal, run_evo

CONFIG = {
    "workload": "tests.fake_workload", "preset": "cpu", "name": "crash", "baselines": ["torch_cumsum"],
    "genes": {"impl": ["cumsum", "loop", "zeros", "nan", "noisy", "slow_build"]},
    "search": {"seed": 3, "generations": 4, "offspring": 4, "max_evaluations": 16,
               "population": {"size": 4, "elite": 1, "tournament": 2}},
    "evaluators": {"count": 2, "threads": 1},
    "evaluator": {"warmup": 1, "repeats": 3, "eval_timeout_s": 60},
}


def evo(tmp: Path, *args: str, crash_at: str | None = None) -> subprocess.CompletedProcess:
    return run_evo(*args, crash_at=crash_at)


# a kill mid-generation, with MLflow (a kill between a result and its Parquet file, evidence:N, is
# tests/test_code_search.py's; a stop by SIGTERM, tests/test_stop.py's)
@pytest.mark.parametrize("crash_at, with_mlflow", [("evaluate:6", True)])
def test_resume_after_kill_9_evaluates_nothing_twice(tmp_path, crash_at, with_mlflow):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = {**CONFIG, "mlflow": {"tracking_uri": uri, "experiment": "crash", "enabled": with_mlflow}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"
    killed = evo(tmp_path, "run", str(tmp_path / "config.yaml"), "--out", str(run_dir), crash_at=crash_at)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:]
    before = {row["genome_hash"]: row for row in journal(run_dir)}
    assert 0 < len(before) < 16 and not (run_dir / "summary.json").exists()

    resumed = evo(tmp_path, "resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "resuming at generation" in resumed.stdout
    after = journal(run_dir)
    hashes = [row["genome_hash"] for row in after]
    assert len(hashes) == len(set(hashes)) == 16, "a genome was evaluated twice or the budget was not kept"
    for row in after:  # what was recorded before the kill is kept as it was, not re-measured
        if row["genome_hash"] in before:
            assert row == before[row["genome_hash"]]
    parquet = [pq.read_table(run_dir / "generations" / f"gen_{g:04d}.parquet").to_pylist() for g in range(4)]
    assert sorted(r["genome_hash"] for gen in parquet for r in gen) == sorted(hashes)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["evaluations"] == 16 and summary["generations"] == 4
    state = json.loads((run_dir / "state.json").read_text())
    assert state["generation"] == 4 and sorted(state["evaluated"]) == sorted(hashes)
    agent_tries = sum(t for agent in state["agents"].values() for t, _ in agent["stats"].values())
    assert agent_tries == sum(1 for row in after if row["agent"] != "seed")
    if with_mlflow:  # the interrupted parent run stays; a linked continuation run finishes the search
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name("crash")
        parents = client.search_runs([experiment.experiment_id], filter_string="tags.run_dir != ''",
                                     order_by=["attributes.start_time ASC"])
        parents = [r for r in parents if "mlflow.parentRunId" not in r.data.tags]
        assert len(parents) == 2
        assert parents[1].data.tags["continues_run_id"] == parents[0].info.run_id
        assert parents[1].info.status == "FINISHED" and summary["mlflow_run_id"] == parents[1].info.run_id


def test_unusable_run_directories_get_clear_errors(tmp_path):
    with pytest.raises(RunDirError, match="not a directory"):
        load_run(tmp_path / "missing")
    with pytest.raises(RunDirError, match="run.json .*missing"):
        load_run(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(RunDirError, match="run format 99"):
        load_run(tmp_path)
    (tmp_path / "run.json").write_text("{not json")
    with pytest.raises(RunDirError, match="corrupt"):
        load_run(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"format": 1}))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"search": {"generatoins": 2}}))
    with pytest.raises(RunDirError, match="config.yaml is corrupt.*generatoins"):
        load_run(tmp_path)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    (tmp_path / "evidence.jsonl").write_text('{"broken": \n{"also": "broken"}\n')
    with pytest.raises(RunDirError, match="evidence.jsonl:1 is corrupt"):
        load_run(tmp_path)
    result = evo(tmp_path, "resume", str(tmp_path))
    assert result.returncode == 2 and "cannot resume" in result.stdout


def test_a_run_is_never_resumed_on_another_device_type(tmp_path):
    from evo.core.genome import Genome
    from evo.core.records import EvalResult, Evaluated, Proposal
    from evo.driver.resume import SavedRun, check_device
    from tests import fake_workload

    genome = Genome.from_json(fake_workload.genome_json("cumsum"))
    timed = Evaluated(Proposal(genome, (), "seed", "m", 0), EvalResult(genome.hash, "ok", latency_ms=1.0,
                                                                         device="cuda:NVIDIA H200"))
    failed = Evaluated(Proposal(genome, (), "seed", "m", 0), EvalResult(genome.hash, "timeout"))  # no device
    saved = SavedRun(tmp_path, None, None, (timed, failed))
    check_device(saved, "cuda:NVIDIA H200")
    with pytest.raises(RunDirError, match=r"timed on \['cuda:NVIDIA H200'\].*'cpu:AMD EPYC'"):
        check_device(saved, "cpu:AMD EPYC")
