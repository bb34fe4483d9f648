"""The Serve app on a real `ray start --head` cluster on 127.0.0.1, deployed with `serve deploy`, over real HTTP.

The cluster is started by this module (`ray start --head --block`) and stopped by terminating that
process. Hot swaps are what a user does: `serve deploy` of a config whose user_config names another
engine, which Serve applies in place through `reconfigure`.
"""
import base64
import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from evo.core.genome import Genome
from evo.serving.codec import decode_tensor, encode_tensor
from evo.serving.loadgen import load_run, post_json
from evo.workloads import get_workload
from evo.workloads.base import CheckCase, DeviceInfo
from tests.waiting import wait_for

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = get_workload("kda")
PRESET = WORKLOAD.presets()["cpu_small"]
ENV = dict(os.environ)  # conftest's: Ray on 127.0.0.1 only, with the session's token (the CLIs send it)
# replicas import the test workloads (tests.adversaries); a secret in their environment for engines to look for
ENV.update(PYTHONPATH=str(Path(__file__).resolve().parents[1]), EVO_TEST_API_TOKEN="evo-test-secret-7f3a")
MAX_REQUEST_BYTES = 4 * 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_run(path: Path, **scheduling) -> Path:
    """A run directory holding a best genome (as a search would leave it)."""
    space = WORKLOAD.gene_space(PRESET, DeviceInfo("cpu", "cpu", 1))
    genome = space.make(scheduling)
    path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps({
        "workload": "kda", "preset": PRESET.name, "best_genome": genome.to_dict(), "best_latency_ms": 1.0,
        "speedups": {"eager_recurrent": 5.0}, "device": "cpu:test", "mlflow_run_id": None}))
    return path


class Server:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.gcs, self.dashboard, self.http = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http}"
        # Its own temp dir: the cluster's session files (and its "current cluster" marker) stay out
        # of /tmp/ray, so nothing later connects to this cluster by accident after it is stopped.
        self.temp_dir = tempfile.mkdtemp(prefix="ray-")
        self.process = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={self.gcs}",
             f"--temp-dir={self.temp_dir}",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard}", "--num-cpus=2",
             "--include-dashboard=true", "--disable-usage-stats"],
            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)

    def deploy(self, engine: str, name: str, **user_config) -> None:
        """`serve deploy` of configs/serve.yaml naming `engine`, with `user_config` changes on top."""
        config = yaml.safe_load((ROOT / "configs" / "serve.yaml").read_text())
        config["http_options"]["port"] = self.http
        config["applications"][0]["deployments"][0]["user_config"].update({
            "engine": engine, "max_batch_size": 8, "batch_wait_timeout_s": 0.02, "max_request_bytes": MAX_REQUEST_BYTES,
            "max_inflight_bytes": 8 * MAX_REQUEST_BYTES, **user_config})
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        deadline = time.monotonic() + 60
        while True:  # the dashboard's REST API takes a few seconds to come up
            done = subprocess.run([str(BIN / "serve"), "deploy", str(path), "--address",
                                   f"http://127.0.0.1:{self.dashboard}"], env=ENV, capture_output=True, text=True)
            if done.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert done.returncode == 0, done.stderr[-2000:]

    def stop(self) -> None:
        # a throwaway cluster with its own temp dir: SIGKILL to the process group this module started (a
        # graceful SIGTERM waits ~30 s for Serve's actors, and nothing of this cluster is kept)
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def get(server: Server, path: str, timeout: float = 10):
    with urllib.request.urlopen(server.url + path, timeout=timeout) as response:
        return response.status, json.loads(response.read())


def post(server: Server, body: bytes):
    return post_json(server.url + "/v1/infer", body)


# What polling the server meets while it starts or swaps: not an answer yet.
SERVER_NOT_READY = (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError)


def engine_hash(server: Server) -> str:
    return get(server, "/v1/engine")[1]["hash"]


def request_body(seed: int, T: int = 50, encoding: str = "data", state: bool = True, distribution="strong_decay"):
    inputs = WORKLOAD.make_inputs(CheckCase("http", {**PRESET.shape, "T": T}, distribution, state), "float32", "cpu", seed)
    body = {"inputs": {k: encode_tensor(v, encoding) for k, v in inputs.items() if v is not None}, "encoding": encoding}
    return inputs, json.dumps(body).encode()


def assert_matches_reference(inputs, response):
    reference = WORKLOAD.reference(inputs)
    for name, expected in reference.items():
        got = decode_tensor(response["outputs"][name], name)
        error = ((got.double() - expected).norm() / expected.norm()).item()
        assert torch.isfinite(got).all() and error < 1e-5, (name, error)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    server = Server(tmp)
    try:
        server.deploy("default:kda/cpu_small", "initial")
        wait_for(lambda: get(server, "/healthz")[0] == 200, 180, "the first engine to be verified and ready", SERVER_NOT_READY)
        yield server
    finally:
        server.stop()


def test_served_outputs_match_the_float64_reference(server):
    for seed, encoding, state in ((1, "data", True), (2, "b64", False), (3, "b64", True)):
        inputs, body = request_body(seed, T=37 + seed, encoding=encoding, state=state)
        status, response = post(server, body)
        assert status == 200, response
        assert_matches_reference(inputs, response)
    status, info = get(server, "/v1/engine")
    assert info["workload"] == "kda" and info["preset"] == "cpu_small"
    assert info["verification"]["max_rel_error"] < 1e-5
    assert info["hash"] == Genome.from_dict(info["genome"]).hash
    assert next(iter(info)) == "claim" and info["claim"] is None  # a default genome: nothing measured to claim
    assert {"latency_ms_single_timing", "speedups_single_timing", "device", "mlflow_run_id", "last_swap"} <= set(info)
    status, response = post(server, json.dumps(info["example_request"]).encode())  # the example it offers works
    assert status == 200 and set(response["outputs"]) == {"o", "final_state"}, response


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_curl_evo_serve_prints_is_answered(server):
    from evo.serving.serve_cli import curl_for

    command = curl_for("kda", "cpu_small", server.url)
    done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120)
    response = json.loads(done.stdout)
    assert done.returncode == 0 and set(response["outputs"]) == {"o", "final_state"}, done.stdout[:500]


def _mutate(body: bytes, change) -> bytes:
    data = json.loads(body)
    change(data)
    return json.dumps(data).encode()


BAD_REQUESTS = {
    "unknown tensor": (lambda d: d["inputs"].update(z=d["inputs"]["q"]), 422, "inputs.z"),
    "missing tensor": (lambda d: d["inputs"].pop("v"), 422, "inputs.v"),
    "wrong shape": (lambda d: d["inputs"]["q"].update(shape=[1, 50, 2, 7]), 422, "inputs.q"),
    "wrong dtype": (lambda d: d["inputs"]["q"].update(dtype="int8"), 422, "inputs.q.dtype"),
    "nan": (lambda d: d["inputs"]["v"].update(b64=base64.b64encode(
        torch.full((1, 50, 2, 32), float("nan")).numpy().tobytes()).decode()), 422, "inputs.v"),
    "malformed base64": (lambda d: d["inputs"]["q"].update(b64="@@not base64@@"), 422, "inputs.q.b64"),
}


@pytest.mark.parametrize("kind", sorted(BAD_REQUESTS))
def test_bad_requests_get_4xx_naming_the_field_and_the_replica_stays_healthy(server, kind):
    change, status, field = BAD_REQUESTS[kind]
    inputs, body = request_body(10, encoding="b64")
    code, response = post(server, _mutate(body, change))
    assert code == status, response
    assert response["error"]["field"].startswith(field) and response["error"]["message"]
    good_inputs, good = request_body(11)
    code, response = post(server, good)
    assert code == 200
    assert_matches_reference(good_inputs, response)


def test_requests_beyond_the_verified_domain_get_422_naming_the_bound(server):
    """Serve refuses what the cascade never verified (test_serving_domain.py walks every bound)."""
    T_max = WORKLOAD.domain(PRESET).axes["T"].hi
    _, body = request_body(12, encoding="b64")
    longer = _mutate(body, lambda d: d["inputs"]["q"].update(shape=[1, T_max + 1, 2, 32]))
    below_floor = _mutate(body, lambda d: d["inputs"]["g"].update(b64=base64.b64encode(
        torch.full((1, 50, 2, 32), -5.5).numpy().tobytes()).decode()))
    for raw, field, words in ((longer, "inputs.q.shape", f"(T) is {T_max + 1}"), (below_floor, "inputs.g", "[-5, 0]")):
        code, response = post(server, raw)
        assert code == 422 and response["error"]["field"].startswith(field), response
        assert words in response["error"]["message"], response
    assert get(server, "/healthz")[0] == 200


def test_malformed_json_and_oversized_payloads(server):
    code, response = post(server, b'{"inputs": {"q": ')
    assert code == 400 and response["error"]["field"] == "body"
    # Refused on its Content-Length, before the body is read (test_an_oversized_content_length_... below)
    head = (f"POST /v1/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {MAX_REQUEST_BYTES + 10}\r\n\r\n").encode()
    code, _, response = raw_http(server, head, b" " * 1024)
    assert code == 413 and response["error"]["field"] == "body", response
    assert get(server, "/healthz")[0] == 200


def test_concurrent_requests_are_batched(server):
    before = get(server, "/v1/engine")[1]["stats"]
    bodies = [request_body(100 + i, T=64) for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda ib: post(server, ib[1]), bodies))
    for (inputs, _), (code, response) in zip(bodies, replies):
        assert code == 200
        assert_matches_reference(inputs, response)
    after = get(server, "/v1/engine")[1]["stats"]
    served = after["requests"] - before["requests"]
    assert served == 16
    assert after["engine_calls"] - before["engine_calls"] < served, "no two requests shared an engine call"


class Clients:
    """8 threads sending requests until stopped; every failure is kept."""

    def __init__(self, server: Server, count: int = 8) -> None:
        self.server, self.stop = server, threading.Event()
        self.ok, self.failures, self.latencies = 0, [], []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(count)]

    def _loop(self, index: int) -> None:
        inputs, body = request_body(1000 + index, T=40)
        reference = WORKLOAD.reference(inputs)["o"]
        while not self.stop.is_set():
            started = time.perf_counter()
            try:
                code, response = post(self.server, body)
                error = None if code == 200 else f"HTTP {code}: {response}"
                if error is None:
                    got = decode_tensor(response["outputs"]["o"], "o").double()
                    if not ((got - reference).norm() / reference.norm()).item() < 1e-5:
                        error = "wrong answer"
            except Exception as exc:  # connection errors count as failures too
                error = repr(exc)
            with self.lock:
                self.latencies.append(time.perf_counter() - started)
                if error:
                    self.failures.append(error)
                else:
                    self.ok += 1

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for thread in self.threads:
            thread.join()


def test_hot_swap_under_load_drops_nothing(server):
    old = engine_hash(server)
    run = write_run(server.tmp / "run-swap", chunk_size=32, sub_chunk_size=16, intra_algorithm="triangular_solve")
    with Clients(server) as clients:
        time.sleep(1.0)
        server.deploy(str(run), "swap")
        new = wait_for(lambda: (h := engine_hash(server)) != old and h, 120, "the swapped engine", SERVER_NOT_READY)
        served_before = clients.ok
        wait_for(lambda: clients.ok > served_before + 16, 60, "requests on the new engine", SERVER_NOT_READY)
    assert clients.failures == []
    assert clients.ok > 30
    info = get(server, "/v1/engine")[1]
    assert info["hash"] == new and info["last_swap"]["ok"] is True and info["last_swap"]["from"] == old


def test_swap_to_a_broken_engine_is_refused_and_the_old_one_keeps_answering(server):
    old = engine_hash(server)
    # Factored exponents over a whole 128-token chunk overflow under strong decay: it fails verification.
    broken = write_run(server.tmp / "run-broken", chunk_size=128, exponent_form="factored_chunk", sub_chunk_size=16)
    with Clients(server, count=2) as clients:
        server.deploy(str(broken), "broken")
        swap = wait_for(lambda: (s := get(server, "/v1/engine")[1]["last_swap"]) and s["source"] == str(broken) and s,
                        120, "the refused swap to be reported", SERVER_NOT_READY)
    assert swap["ok"] is False and "failed its verification" in swap["error"] and swap["kept"] == old
    assert clients.failures == [] and clients.ok > 0
    assert engine_hash(server) == old and get(server, "/healthz")[0] == 200
    inputs, body = request_body(77)
    code, response = post(server, body)
    assert code == 200
    assert_matches_reference(inputs, response)


def test_load_run_reports_p50_p99_and_no_errors(server):
    bodies = [request_body(5000 + i, T=64)[1] for i in range(8)]
    report = load_run(server.url, bodies, clients=8, requests=200)
    print("load run:", report)
    assert report.requests == 200 and report.errors == 0, report.first_error
    assert 0 < report.p50_ms <= report.p99_ms


def serve_status(server: Server) -> str:
    done = subprocess.run([str(BIN / "serve"), "status", "--address", f"http://127.0.0.1:{server.dashboard}"],
                          env=ENV, capture_output=True, text=True, timeout=60)
    return done.stdout + done.stderr


# Bad hot swaps: (user_config changes, words the refusal must contain). A broken engine is above.
BAD_SWAPS = {
    "wrong type": ({"max_batch_size": "eight"}, "max_batch_size"),
    "unknown key": ({"max_batch_sise": 16}, "max_batch_sise"),
    "bad engine": ({"engine": "/nonexistent/run-dir"}, "/nonexistent/run-dir"),
}


def test_bad_swaps_are_refused_and_serving_never_stops(server):
    """8 clients during each kind of bad `serve deploy`: not one failed request, the old engine and
    options keep serving, the refusal is reported under last_swap, the app stays RUNNING."""
    old = get(server, "/v1/engine")[1]
    with Clients(server) as clients:
        for kind, (change, word) in BAD_SWAPS.items():
            before = time.time()
            config = {"engine": "default:kda/cpu_small", **change}
            server.deploy(config.pop("engine"), kind.replace(" ", "-"), **config)
            swap = wait_for(lambda: (s := get(server, "/v1/engine")[1]["last_swap"]) and s["at"] >= before - 1 and s,
                            120, f"the {kind} swap to be refused", SERVER_NOT_READY)
            assert swap["ok"] is False and word in swap["error"] and swap["kept"] == old["hash"], (kind, swap)
            served = clients.ok
            wait_for(lambda: clients.ok > served + 8, 60, f"requests after the {kind} swap", SERVER_NOT_READY)
    assert clients.failures == [], clients.failures[:3]
    info = get(server, "/v1/engine")[1]
    assert info["hash"] == old["hash"] and info["batching"] == old["batching"] and info["limits"] == old["limits"]
    status = serve_status(server)
    assert "RUNNING" in status and "DEPLOY_FAILED" not in status, status[-2000:]
    server.deploy("default:kda/cpu_small", "initial-again")  # a good config is taken as before


def raw_http(server: Server, head: bytes, body: bytes = b"", timeout: float = 30) -> tuple[int, dict, dict]:
    """Send exactly these bytes; (status, headers, JSON body) of the reply."""
    with socket.create_connection(("127.0.0.1", server.http), timeout=timeout) as sock:
        sock.sendall(head + body)
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < _length(reply):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    header, _, payload = reply.partition(b"\r\n\r\n")
    lines = header.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(payload or b"{}")


def _length(reply: bytes) -> int:
    for line in reply.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 62


def test_an_oversized_content_length_is_refused_before_the_body_is_sent(server):
    head = (f"POST /v1/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {50 * MAX_REQUEST_BYTES}\r\n\r\n").encode()
    status, _, reply = raw_http(server, head, b'{"inputs": ')  # the rest of the body never comes
    assert status == 413 and reply["error"]["field"] == "body" and "Content-Length" in reply["error"]["message"]


def test_a_streamed_body_is_cut_at_the_limit(server):
    connection = __import__("http.client").client.HTTPConnection("127.0.0.1", server.http, timeout=60)
    chunks = (b" " * (1 << 20) for _ in range(MAX_REQUEST_BYTES // (1 << 20) + 2))  # no Content-Length
    connection.request("POST", "/v1/infer", body=chunks, headers={"Content-Type": "application/json"},
                       encode_chunked=True)
    response = connection.getresponse()
    reply = json.loads(response.read())
    connection.close()
    assert response.status == 413 and reply["error"]["field"] == "body", reply
    assert get(server, "/healthz")[0] == 200


def test_requests_beyond_the_inflight_budget_get_503_with_retry_after(server):
    """With no time to wait for room (max_queue_wait_s: 0), a request that would pass the budget is refused."""
    server.deploy("default:kda/cpu_small", "tight", max_inflight_bytes=MAX_REQUEST_BYTES, max_queue_wait_s=0)
    wait_for(lambda: get(server, "/v1/engine")[1]["limits"]["max_inflight_bytes"] == MAX_REQUEST_BYTES, 60,
             "the tighter in-flight budget", SERVER_NOT_READY)
    _, body = request_body(7, T=600)  # ~3 MB of JSON numbers: two at once pass the 4 MB budget
    assert MAX_REQUEST_BYTES / 2 < len(body) < MAX_REQUEST_BYTES
    head = (f"POST /v1/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    replies = []
    try:
        for _ in range(10):  # rounds of 8 at once until two overlap (the first round, in practice)
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                replies += list(pool.map(lambda _: raw_http(server, head, body, timeout=120), range(8)))
            if any(status == 503 for status, _, _ in replies):
                break
    finally:
        server.deploy("default:kda/cpu_small", "initial-again")
    busy = [(h, r) for status, h, r in replies if status == 503]
    assert busy and all(status in (200, 503) for status, _, _ in replies), [s for s, _, _ in replies]
    assert all(h.get("retry-after") == "1" and r["error"]["status"] == 503 and "max_inflight_bytes" in
               r["error"]["message"] for h, r in busy)
    assert sum(status == 200 for status, _, _ in replies) >= 1


@pytest.mark.parametrize("method, path, status, field", [
    ("GET", "/nope", 404, "path"), ("GET", "/v1/infer", 405, "method"), ("POST", "/healthz", 405, "method"),
    ("DELETE", "/v1/engine", 405, "method")])
def test_unknown_routes_and_wrong_methods_get_the_error_object(server, method, path, status, field):
    request = urllib.request.Request(server.url + path, method=method, data=b"{}" if method == "POST" else None)
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=30)
    reply = json.loads(error.value.read())
    assert error.value.code == status and set(reply) == {"error"}, reply
    assert reply["error"]["field"] == field and reply["error"]["status"] == status and reply["error"]["message"]


def test_the_cluster_and_serve_listen_on_loopback_only_or_behind_the_token(server):
    from tests.listeners import exposed, listening, process_tree

    processes = process_tree(server.process.pid)
    found = listening(processes)
    assert any(port == server.http for _, _, _, port in found), found  # Serve's proxy is among them
    assert exposed(processes) == [], found


# ---------------------------------------------------------------- the engine runs in the jail (issue 28)
def write_attack_run(path: Path, attack: str) -> Path:
    """A run directory whose best engine is the honest KDA engine with `tests.adversaries`' `attack`."""
    from tests import adversaries

    space = adversaries.WORKLOAD.gene_space(PRESET, DeviceInfo("cpu", "cpu", 1))
    genome = space.make({**space.default().values(), "attack": attack})
    path.mkdir(parents=True, exist_ok=True)
    (path / "summary.json").write_text(json.dumps({
        "workload": "tests.adversaries", "preset": PRESET.name, "best_genome": genome.to_dict(),
        "best_latency_ms": 1.0, "speedups": {}, "device": "cpu:test", "mlflow_run_id": None}))
    return path


def serve_attack(server: Server, attack: str, **user_config) -> str:
    """Deploy the engine with `attack` and wait until it serves; its hash."""
    run = write_attack_run(server.tmp / f"run-{attack}", attack)
    server.deploy(str(run), attack, **user_config)
    want = Genome.from_dict(json.loads((run / "summary.json").read_text())["best_genome"]).hash
    return wait_for(lambda: engine_hash(server) == want and want, 180, f"the {attack} engine to serve", SERVER_NOT_READY)


def test_an_engine_honest_only_in_the_jail_answers_honestly(server):
    """Serve builds, verifies and calls the engine in the judge's jail: an engine that is right only as
    `nobody` is right in every answer (run in the replica as root, it would answer wrongly)."""
    serve_attack(server, "honest_in_jail")
    info = get(server, "/v1/engine")[1]
    assert info["sandbox"] == "strict" and "strict sandbox" in info["verification"]["message"]
    for seed in (21, 22):
        inputs, body = request_body(seed)
        status, response = post(server, body)
        assert status == 200, response
        assert_matches_reference(inputs, response)


def test_the_engine_reaches_neither_the_replica_nor_the_project(server):
    """At build the engine looks for the secret in every /proc/*/environ and its own, reads the project's
    tests and configs and writes into the project; any success would make its answers wrong. The same
    probe run here, unconfined, succeeds (so it is not a probe that does nothing)."""
    from tests import adversaries

    serve_attack(server, "reach_replica")
    inputs, body = request_body(31)
    status, response = post(server, body)
    assert status == 200, response
    assert_matches_reference(inputs, response)
    assert adversaries._reach_replica(adversaries.WORKLOAD)


def test_an_engine_that_turns_wrong_is_taken_out_of_service(server):
    """Every call re-scored: an engine honest while it is verified and for its first calls, wrong later,
    is caught by the live re-scoring and replaced by the engine it had replaced."""
    from tests import adversaries

    before = serve_attack(server, "honest_in_jail")
    bad = serve_attack(server, "wrong_after_calls", rescore_fraction=1.0)
    assert bad != before
    T = adversaries.MARKER_T

    def caught():
        post(server, request_body(41, T=T)[1])
        return get(server, "/v1/engine")[1]["hash"] == before

    wait_for(caught, 120, "live re-scoring to take the engine out of service", SERVER_NOT_READY)
    info = get(server, "/v1/engine")[1]
    assert info["rescoring"]["failed"] >= 1 and info["rescoring"]["fraction"] == 1.0, info["rescoring"]
    assert "answered a served call wrongly" in info["last_swap"]["reason"] and info["last_swap"]["from"] == bad
    inputs, body = request_body(42, T=T)
    status, response = post(server, body)
    assert status == 200 and get(server, "/healthz")[0] == 200
    assert_matches_reference(inputs, response)
