"""MLflow down mid-search: a real `mlflow server` on 127.0.0.1 is stopped and restarted while the search runs.

The search (synthetic evaluator, no Ray) must not raise or stall, must warn that MLflow is behind,
and MLflow must end up with everything: every generation's metrics by step, one child run per
generation with its Parquet evidence, both finished, and an empty outbox.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from evaluators.judge.synthetic import SyntheticEvaluator
from evo.cli import main as cli_main
from evo.evidence.journal import DiskEvidence
from evo.core.loop import LocalExecutor, run_search
from evo.evidence.mlflow.outbox import OUTBOX_FILE, STATE_FILE, Outbox
from evo.evidence.mlflow.sink import MlflowSink
from evo.core.search import Search, SearchSettings
from operators.team import LocalTeam
from tests.toy_space import toy_space

MLFLOW = str(Path(sys.executable).with_name("mlflow"))


class MlflowServer:
    """One `mlflow server --workers 1` in its own process group; stopped by killing that group."""

    def __init__(self, root: Path) -> None:
        self.root, self.proc = root, None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.log = open(self.root / "server.log", "a")
        self.proc = subprocess.Popen(
            [MLFLOW, "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts")],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.root / "server.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError(f"mlflow server on {self.uri} did not answer /health within 60 s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.proc:
            self.log.close()
        self.proc = None


@pytest.fixture
def server(tmp_path):
    srv = MlflowServer(tmp_path)
    srv.start()
    yield srv
    srv.stop()


def make_search(generations: int) -> Search:
    settings = SearchSettings(seed=0, generations=generations, offspring=4, max_evaluations=1000)
    space = toy_space()
    return Search(space, settings, LocalTeam(list(settings.agents), space, settings.seed))


class _Generation:
    """MLflow gets each generation after its Parquet file is on disk (as in evo.driver.run)."""

    def __init__(self, sink: MlflowSink, disk: DiskEvidence) -> None:
        self.sink, self.disk = sink, disk

    def on_result(self, evaluated) -> None:
        pass

    def on_generation(self, report, search) -> None:
        self.sink.on_generation(report, search, self.disk.generation_path(report.generation))


class Outage:
    """Sink that stops the server after generation `stop_at` and restarts it after `restart_at`."""

    def __init__(self, server: MlflowServer, stop_at: int, restart_at: int) -> None:
        self.server, self.stop_at, self.restart_at = server, stop_at, restart_at

    def on_result(self, evaluated) -> None:
        pass

    def on_generation(self, report, search) -> None:
        if report.generation == self.stop_at:
            self.server.stop()
        elif report.generation == self.restart_at:
            self.server.start()


def parent_and_children(uri: str, experiment: str):
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1, [r.info.run_name for r in parents]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    return client, parents[0], children


def assert_complete(uri: str, experiment: str, generations: int, run_dir: Path) -> None:
    client, parent, children = parent_and_children(uri, experiment)
    assert parent.info.status == "FINISHED"
    assert parent.data.params["search.generations"] == str(generations)
    for key in ("best_latency_ms", "fraction_valid", "evaluations"):
        steps = sorted(m.step for m in client.get_metric_history(parent.info.run_id, key))
        assert steps == list(range(generations)), f"{key}: steps {steps}"
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {"config.yaml"}
    assert sorted(int(c.data.tags["generation"]) for c in children) == list(range(generations))
    for child in children:
        assert child.info.status == "FINISHED"
        g = int(child.data.tags["generation"])
        assert child.data.metrics["evaluations"] > 0
        assert [a.path for a in client.list_artifacts(child.info.run_id, "evidence")] == [f"evidence/gen_{g:04d}.parquet"]
    assert not (run_dir / OUTBOX_FILE).exists(), (run_dir / OUTBOX_FILE).read_text()


def test_search_survives_mlflow_restart_and_backfills(server, tmp_path, caplog):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("search: {generations: 9}\n")
    generations = 9
    sink = MlflowSink(server.uri, "outage", "outage-run", {"search": {"generations": generations}},
                      tags={"workload": "toy"}, run_dir=run_dir, finish_wait_s=30)
    assert sink.run_id and sink.pending == 0
    disk = DiskEvidence(run_dir)
    outage = Outage(server, stop_at=2, restart_at=5)
    caplog.set_level(logging.WARNING, logger="evo.mlflow")

    started = time.monotonic()
    # The outage sink runs last, so generation 2 is logged before the stop and 5 before the restart.
    run_search(make_search(generations), LocalExecutor(SyntheticEvaluator(failure_rate=0.2)),
               [disk, _Generation(sink, disk), outage])
    disk.close()
    assert sink.finish({"best_latency_ms": 1.0}, run_dir) is True
    elapsed = time.monotonic() - started

    behind = [r.getMessage() for r in caplog.records if "MLflow is behind" in r.getMessage()]
    assert len(behind) == 1 and str(run_dir) in behind[0], behind
    assert any("MLflow caught up" in r.getMessage() for r in caplog.records)
    assert elapsed < 60, f"search with an MLflow outage took {elapsed:.1f} s"
    assert_complete(server.uri, "outage", generations, run_dir)


def test_down_at_the_end_leaves_outbox_and_mlflow_sync_replays_it(server, tmp_path, caplog, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("search: {generations: 3}\n")
    sink = MlflowSink(server.uri, "later", "later-run", {"search": {"generations": 3}},
                      tags={"workload": "toy"}, run_dir=run_dir, finish_wait_s=2)
    disk = DiskEvidence(run_dir)
    outage = Outage(server, stop_at=0, restart_at=-1)
    started = time.monotonic()
    run_search(make_search(3), LocalExecutor(SyntheticEvaluator()), [disk, _Generation(sink, disk), outage])
    disk.close()
    assert sink.finish({}, run_dir) is False
    assert time.monotonic() - started < 20
    assert (run_dir / OUTBOX_FILE).exists() and sink.pending > 0
    assert any("mlflow-sync" in r.getMessage() for r in caplog.records)

    server.start()
    assert cli_main(["mlflow-sync", str(run_dir), "--wait", "10"]) == 0
    assert "MLflow has every operation" in capsys.readouterr().out
    assert_complete(server.uri, "later", 3, run_dir)
    # A second sync has nothing to do and creates nothing.
    assert cli_main(["mlflow-sync", str(run_dir)]) == 0
    _, _, children = parent_and_children(server.uri, "later")
    assert len(children) == 3


def test_replay_after_a_crash_creates_no_duplicates(server, tmp_path, monkeypatch):
    """A crash after writes reached MLflow but before they left the outbox, and before the run ids
    were saved: the replay finds the runs by their key tag and logs nothing twice."""
    run_dir = tmp_path / "run"
    monkeypatch.setattr(Outbox, "_rewrite", lambda self: None)  # the outbox file keeps every op
    sink = MlflowSink(server.uri, "crash", "crash-run", {"a": 1}, tags={}, run_dir=run_dir, finish_wait_s=5)
    disk = DiskEvidence(run_dir)
    run_search(make_search(2), LocalExecutor(SyntheticEvaluator()), [disk, _Generation(sink, disk)])
    disk.close()
    assert sink.finish({}, run_dir)
    monkeypatch.undo()
    state = json.loads((run_dir / STATE_FILE).read_text())
    (run_dir / STATE_FILE).write_text(json.dumps({**state, "runs": {}}))

    outbox = Outbox(run_dir)
    assert len(outbox.ops) > 5
    assert outbox.drain(5) and not (run_dir / OUTBOX_FILE).exists()
    client, parent, children = parent_and_children(server.uri, "crash")
    assert len(children) == 2
    history = client.get_metric_history(parent.info.run_id, "best_latency_ms")
    assert sorted(m.step for m in history) == [0, 1]
