"""SIGTERM (what `ray job stop` sends) stops a search cleanly: what finished is on disk, MLflow says
KILLED, the run directory is consistent. `evo resume` continues it; a kill -9 mid-generation of that
continuation loses nothing recorded, and a second `evo resume` completes the budget without evaluating
anything twice, each continuation a new MLflow run linked to the one it continues."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import yaml
from mlflow.tracking import MlflowClient

from tests.run_checks import ROOT, check_stopped_run, journal
from tests.test_resume import CONFIG, evo


def test_sigterm_stops_cleanly_and_the_run_resumes_through_a_kill_9(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = {**CONFIG, "genes": {"impl": ["slow_build", "cumsum", "loop", "zeros"]},
              "search": {**CONFIG["search"], "generations": 5, "max_evaluations": 20},  # the space holds 24 genomes
              "mlflow": {"tracking_uri": uri, "experiment": "stop"}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("EVO_CRASH_AT", None)
    process = subprocess.Popen([sys.executable, "-m", "evo", "run", str(tmp_path / "config.yaml"), "--out", str(run_dir)],
                               cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (
                (run_dir / "evidence.jsonl").exists() and len(journal(run_dir)) >= 6):
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert process.returncode == 0, output[-3000:]
    assert "stopped:" in output
    rows, _ = check_stopped_run(run_dir)
    hashes = [r["genome_hash"] for r in rows]
    assert 6 <= len(hashes) < 20
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("stop").experiment_id],
                              filter_string=f"tags.run_dir = '{run_dir.resolve()}'")
    assert [r.info.status for r in runs if "mlflow.parentRunId" not in r.data.tags] == ["KILLED"]

    # one line per finished candidate, as it arrived, and the same lines in the run's run.log
    assert sorted(candidate_hashes(output)) == sorted(h[:12] for h in hashes), output[-3000:]

    # the continuation killed by SIGKILL at its sixth result (the open generation's journaled results count, as
    # the resume replays them: at least three new ones, short of the budget); what it recorded stays
    killed = evo(tmp_path, "resume", str(run_dir), crash_at="evaluate:6")
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:]
    assert "resuming at generation" in killed.stdout
    before = {row["genome_hash"]: row for row in journal(run_dir)}
    assert len(hashes) < len(before) < 20 and [r for r in before.values() if r["genome_hash"] in set(hashes)] == rows

    resumed = evo(tmp_path, "resume", "-q", str(run_dir))  # -q: only the final summary (and warnings)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert not candidate_hashes(resumed.stdout) and "best engine" in resumed.stdout, resumed.stdout[-3000:]
    after = journal(run_dir)
    assert len({r["genome_hash"] for r in after}) == len(after) == 20, "a genome evaluated twice, or budget not kept"
    # what was recorded before the kill is kept as it was, not re-measured
    assert [r for r in after if r["genome_hash"] in before] == list(before.values())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["evaluations"] == 20 and summary["generations"] == 5 and summary["stopped"] is False
    parquet = [pq.read_table(run_dir / "generations" / f"gen_{g:04d}.parquet").to_pylist() for g in range(5)]
    assert sorted(r["genome_hash"] for gen in parquet for r in gen) == sorted(r["genome_hash"] for r in after)
    state = json.loads((run_dir / "state.json").read_text())
    assert state["generation"] == 5 and sorted(state["evaluated"]) == sorted(r["genome_hash"] for r in after)
    agent_tries = sum(t for agent in state["agents"].values() for t, _ in agent["stats"].values())
    assert agent_tries == sum(1 for row in after if row["agent"] != "seed")
    # MLflow: the stopped run stays KILLED; each continuation is a new parent run linked to the one it continues
    parents = client.search_runs([client.get_experiment_by_name("stop").experiment_id],
                                 filter_string=f"tags.run_dir = '{run_dir.resolve()}'",
                                 order_by=["attributes.start_time ASC"])
    parents = [r for r in parents if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 3 and parents[0].info.status == "KILLED" and parents[2].info.status == "FINISHED"
    assert [p.data.tags.get("continues_run_id") for p in parents[1:]] == [p.info.run_id for p in parents[:2]]
    assert summary["mlflow_run_id"] == parents[2].info.run_id
    logged = (run_dir / "run.log").read_text()  # both runs' lines, the quiet one's too
    assert set(candidate_hashes(logged)) == {r["genome_hash"][:12] for r in after} and "best engine" in logged

    # the Python API reads the finished run back: summary, baselines, one row per evaluation
    import evo as api

    result = api.load_run(run_dir)
    frame = result.dataframe()
    assert len(frame) == 20 and sorted(frame["genome_hash"]) == sorted(r["genome_hash"] for r in after)
    assert result.summary.evaluations == 20 and result.best_hash in set(frame["genome_hash"])
    assert set(result.baselines) == {"torch_cumsum"} and result.baselines["torch_cumsum"].ok


def candidate_hashes(text: str) -> list[str]:
    """The genome hash (12 characters) of each per-candidate line (evo.driver.progress.CandidateLines)."""
    return [line.split(" | ")[1] for line in text.splitlines() if re.search(r"(^|: )cand gen ", line)]
