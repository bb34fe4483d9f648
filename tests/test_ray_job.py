"""The "Run on a cluster" commands of docs/cluster.md, exactly as written, in a copy of the project: a real
`ray start --head` and a real `mlflow server` on 127.0.0.1, a submitted job that succeeds, a second
one stopped mid-run with `ray job stop`, then Ctrl-C (SIGINT to the process group) stops both.

Everything this module starts is stopped through the process groups it created, never by name."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import ray
from mlflow.tracking import MlflowClient

from tests.conftest import start_local_ray
from tests.listeners import exposed, listening, process_tree
from tests.run_checks import check_finished_run, check_stopped_run, journal
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[1]
ACTIVATE = "source .venv/bin/activate"
# Terminal 1 keeps Ray private to this machine (every Ray process on 127.0.0.1) and behind a token.
SECURE = "export RAY_AUTH_MODE=token RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0"
TOKEN = "ray get-auth-token --generate > /dev/null"
TOKEN_PRIVATE = "chmod 600 ~/.ray/auth_token"
HEAD = ("RAY_JOB_STOP_WAIT_TIME_S=60 ray start --head --node-ip-address=127.0.0.1 --dashboard-host=127.0.0.1 "
        "--disable-usage-stats --block")
MLFLOW = ("MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow server --host 127.0.0.1 --port 5000 "
          "--backend-store-uri sqlite:///mlflow-server.db --workers 1")
EXPORT = ("export RAY_AUTH_MODE=token RAY_ADDRESS=http://127.0.0.1:8265 "
          """RUNTIME_ENV='{"env_vars": {"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"}}'""")
SUBMIT = ('ray job submit --working-dir . --runtime-env-json "$RUNTIME_ENV" -- '
          "python -m evo run configs/kda_smoke.yaml --set out_dir=$PWD/runs")
SUBMIT_NO_WAIT = ('ray job submit --no-wait --submission-id kda-cpu-1 --working-dir . --runtime-env-json "$RUNTIME_ENV" -- '
                  "python -m evo run configs/kda_cpu.yaml --set out_dir=$PWD/runs --set preset=cpu_small "
                  "--set baselines=[chunk_pairwise_c64]")
LOGS, STATUS, STOP = "ray job logs --follow kda-cpu-1", "ray job status kda-cpu-1", "ray job stop kda-cpu-1"
TERMINALS = [[ACTIVATE, SECURE, TOKEN, TOKEN_PRIVATE, HEAD], [ACTIVATE, MLFLOW], [ACTIVATE, EXPORT, SUBMIT, SUBMIT_NO_WAIT, LOGS, STATUS, STOP]]
TRACKING = "http://127.0.0.1:5000"
PORTS = {6379: "Ray GCS", 8265: "Ray dashboard and job server", 5000: "MLflow server"}


def cluster_page_commands() -> list[list[str]]:
    """The command lines of each bash block of the cluster page's "Run on a cluster" section."""
    text = (ROOT / "docs" / "cluster.md").read_text()
    section = text.split("# Run on a cluster", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [[line for line in block.splitlines() if line.strip() and not line.startswith("#")] for block in blocks]


class Project:
    """A copy of the project (what a clean clone holds, plus uncommitted work) with .venv pointing at
    the environment running the tests. Commands run in it as in a terminal that ran the prelude."""

    def __init__(self, path: Path, logs: Path) -> None:
        self.path, self.logs = path, logs  # logs stay outside: `--working-dir .` must not change while uploaded
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, check=True).stdout.decode().split("\0")
        for name in filter(None, listed):
            source, target = ROOT / name, path / name
            if source.is_file():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(source.read_bytes())
        (path / ".venv").symlink_to(Path(sys.prefix))
        self.env = {k: v for k, v in os.environ.items() if k not in (
            "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
            "RAY_ADDRESS", "MLFLOW_TRACKING_URI", "VIRTUAL_ENV")}

    def start(self, prelude: list[str], command: str, log: Path) -> subprocess.Popen:
        """A long-running command in its own process group (a terminal of its own)."""
        return terminal(" && ".join([*prelude, command]), self.path, self.env, log)

    def run(self, prelude: list[str], command: str, timeout: float) -> subprocess.CompletedProcess:
        process = self.start(prelude, command, self.logs / "command.log")
        try:
            process.wait(timeout=timeout)
        finally:
            stop_group(process, signal.SIGKILL, 0)
        return subprocess.CompletedProcess(command, process.returncode, (self.logs / "command.log").read_text())


def terminal(line: str, cwd: Path, env: dict, log: Path) -> subprocess.Popen:
    """`bash -c line` as a terminal runs it: its own process group, and Ctrl-C (SIGINT) handled by default
    even when pytest was started with SIGINT ignored (e.g. `pytest &` from a script), which every
    process would otherwise inherit."""
    return subprocess.Popen(["bash", "-c", line], cwd=cwd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def live_members(pgid: int) -> list[int]:
    """Pids of the group's processes that are not zombies (from /proc/PID/stat: state, ppid, pgrp)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                state, _, group = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
            except OSError:  # exited meanwhile
                continue
            if int(group) == pgid and state != "Z":
                found.append(int(entry.name))
    return found


def stop_group(process: subprocess.Popen, sig: int, grace_s: float) -> bool:
    """Send `sig` to the process group `process` leads; True if the group is gone within grace_s.
    Whatever is left is then killed."""
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while live_members(process.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    clean = not live_members(process.pid)
    for pid in live_members(process.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    return clean


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status == 200


def http_answers(url: str) -> bool:
    """The server is up: any HTTP answer, 401 of a request without Ray's token included."""
    try:
        return http_ok(url)
    except urllib.error.HTTPError as error:
        return error.code == 401


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Terminals 1 and 2: the Ray head and the MLflow server, started in a copy of the project."""
    was_local = ray.is_initialized()
    if was_local:  # nothing of ours may hold the ports the cluster page's commands use
        ray.shutdown()
    for port, what in PORTS.items():
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                pytest.fail(f"port {port} ({what}) is already in use on 127.0.0.1: stop what holds it")
    project = Project(tmp_path_factory.mktemp("project"), tmp_path_factory.mktemp("terminals"))
    head = project.start(TERMINALS[0][:-1], HEAD, project.logs / "head.log")
    store = project.start(TERMINALS[1][:1], MLFLOW, project.logs / "mlflow.log")
    project.head, project.store = head, store
    try:
        wait_for(lambda: http_answers("http://127.0.0.1:8265/api/version"), 90, "the Ray job server", OSError)
        wait_for(lambda: http_ok(f"{TRACKING}/health"), 90, "the MLflow server", OSError)
        # the job server answers before its agent has registered ("No available agent to submit job")
        wait_for(lambda: project.run(terminal_3(), "ray job submit --no-wait -- true", timeout=60).returncode == 0,
                 180, "the Ray job agent", (subprocess.TimeoutExpired,))
        yield project
    finally:
        for process in (head, store):
            stop_group(process, signal.SIGKILL, 10)  # leftovers, if the Ctrl-C test did not stop them
        if was_local:
            start_local_ray()


def terminal_3() -> list[str]:
    return TERMINALS[2][:2]


def test_the_cluster_page_shows_exactly_the_commands_run_here():
    assert cluster_page_commands() == TERMINALS


def test_a_submitted_search_succeeds_with_its_evidence_and_mlflow_runs(cluster):
    done = cluster.run(terminal_3(), SUBMIT, timeout=420)
    assert done.returncode == 0 and "succeeded" in done.stdout, done.stdout[-3000:]
    [run_dir] = sorted((cluster.path / "runs").glob("kda-smoke-*"))
    rows, summary = check_finished_run(run_dir, generations=3, max_evaluations=12)
    assert summary["stopped"] is False and summary["registered_model"]
    client = MlflowClient(tracking_uri=TRACKING)
    parent = client.get_run(summary["mlflow_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["run_dir"] == str(run_dir)
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(int(c.data.tags["generation"]) for c in children) == [0, 1, 2]
    name, version = summary["registered_model"].removeprefix("models:/").split("/")
    assert client.get_model_version(name, version).run_id == parent.info.run_id


def test_ray_job_stop_leaves_a_consistent_run_marked_killed(cluster):
    submitted = cluster.run(terminal_3(), SUBMIT_NO_WAIT, timeout=120)
    assert submitted.returncode == 0, submitted.stdout[-3000:]
    logs_path = cluster.logs / "follow.log"
    logs = cluster.start(terminal_3(), LOGS, logs_path)
    try:
        # Stop it inside generation 1: generation 0 complete (Parquet, checkpoint, MLflow child), 1 partial.
        run_dir = wait_for(lambda: next((d for d in (cluster.path / "runs").glob("kda-cpu-*")
                                         if (d / "state.json").exists() and len(journal(d)) >= 9), None),
                           480, "generation 0 and a result of generation 1 of the kda-cpu job",
                           (OSError, ValueError))  # not written yet; a journal line half written
        status = cluster.run(terminal_3(), STATUS, timeout=60)
        assert "running" in status.stdout.lower(), status.stdout[-2000:]
        stopped = cluster.run(terminal_3(), STOP, timeout=120)
        assert stopped.returncode == 0, stopped.stdout[-3000:]
        logs.wait(timeout=120)  # --follow ends with the job
    finally:
        stop_group(logs, signal.SIGKILL, 0)
    assert "stopped:" in logs_path.read_text(), logs_path.read_text()[-3000:]
    assert "stopped" in cluster.run(terminal_3(), STATUS, timeout=60).stdout.lower()

    rows, state = check_stopped_run(run_dir)
    assert 9 <= len(rows) < 80 and state["generation"] >= 1
    summary = json.loads((run_dir / "summary.json").read_text())
    client = MlflowClient(tracking_uri=TRACKING)
    parent = client.get_run(summary["mlflow_run_id"])
    assert parent.info.status == "KILLED"
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(int(c.data.tags["generation"]) for c in children) == list(range(state["generation"]))
    assert all(c.info.status == "FINISHED" for c in children)  # each complete generation, as on disk


def test_terminals_take_ctrl_c_even_when_pytest_ignores_it(tmp_path):
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in `pytest &` from a script
    try:
        process = terminal("sleep 120", tmp_path, dict(os.environ), tmp_path / "sleep.log")
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        assert stop_group(process, signal.SIGINT, 30), "a terminal ignored Ctrl-C"
    finally:
        stop_group(process, signal.SIGKILL, 0)


def test_the_cluster_listens_on_loopback_only_and_wants_the_token(cluster):
    processes = process_tree(cluster.head.pid)
    found = listening(processes)
    assert {name for _, name, _, _ in found} >= {"gcs_server", "raylet"}, found
    assert exposed(processes) == [], found
    with pytest.raises(urllib.error.HTTPError) as refused:  # the job API without the token
        urllib.request.urlopen("http://127.0.0.1:8265/api/jobs/", timeout=10)
    assert refused.value.code == 401


def test_ctrl_c_stops_the_mlflow_server_and_the_cluster(cluster):
    assert stop_group(cluster.store, signal.SIGINT, 60), "mlflow server outlived Ctrl-C"
    assert stop_group(cluster.head, signal.SIGINT, 60), "the Ray head outlived Ctrl-C"
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", 8265)) != 0

