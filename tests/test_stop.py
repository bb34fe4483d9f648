"""SIGTERM (what `ray job stop` sends) stops a search cleanly: what finished is on disk, MLflow says
KILLED, the run directory is consistent, and `evo resume` completes it without re-evaluating."""
import os
import signal
import subprocess
import sys
import time

import yaml
from mlflow.tracking import MlflowClient

from tests.run_checks import ROOT, check_stopped_run, journal
from tests.test_resume import CONFIG, evo


def test_sigterm_stops_cleanly_and_the_run_resumes(tmp_path):
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

    resumed = evo(tmp_path, "resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    after = journal(run_dir)
    assert len({r["genome_hash"] for r in after}) == len(after) == 20
    assert [r for r in after if r["genome_hash"] in set(hashes)] == rows
