"""A llama run's engine served as `docs/llama.md` shows it: `python -m evo serve RUN_DIR` with no flags
(its own local Ray, real HTTP; one start for the module): token ids in, logits equal to the float64
reference or greedy tokens out, requests outside the verified domain refused naming the field, N=0,
requests merged along B up to the largest verified B (the default max_batch_size), the claim first in
/v1/engine, Ctrl-C without Ray's warnings; and a deployment that fails prints its cause in one line."""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from evo.serving.codec import decode_tensor, encode_tensor
from evo.workloads import get_workload
from evo.workloads.base import CheckCase, DeviceInfo
from tests.listeners import exposed, listening, process_tree, user_shell
from tests.test_serving import ENV, ROOT, SERVER_NOT_READY, free_port, get, post, write_run
from tests.waiting import wait_for

pytestmark = pytest.mark.slow  # `evo serve` twice, each with its own local Ray and Serve (~1-2 min each at load 5)

W = get_workload("llama")
PRESET = W.presets()["cpu_small"]
V = PRESET.shape["V"]
DOMAIN = W.domain(PRESET)
B_MAX, P_MAX, N_MAX = (DOMAIN.axes[a].hi for a in ("B", "P", "N"))


PAIRED = {"hf_sdpa": 2.04, "eager_ours": 1.66}  # what the run's final paired re-timing found
CI = {"hf_sdpa": [1.92, 2.40], "eager_ours": [1.52, 1.92]}


def write_llama_run(path: Path) -> Path:
    """A run directory of a `llama` search (cpu_small) as `evo run` leaves it: summary.json with the best
    genome, single timings and the paired re-timing's speedups with their intervals."""
    genome = W.gene_space(PRESET, DeviceInfo("cpu", "cpu", 1)).default()
    path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps({
        "workload": "llama", "preset": PRESET.name, "best_genome": genome.to_dict(), "best_latency_ms": 3.5,
        "speedups": {"hf_sdpa": 2.3, "eager_ours": 1.7}, "speedup_paired": PAIRED, "speedup_ci": CI,
        "device": "cpu:test", "mlflow_run_id": None}))
    return path


class EvoServe:
    """`python -m evo serve SOURCE --port PORT` as a user types it (no other flag), from a user's shell: its own
    local Ray."""

    def __init__(self, tmp: Path, source: str | Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"evo-serve-{self.port}.log"
        with self.log.open("w") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "evo", "serve", str(source), "--port", str(self.port)],
                                            cwd=ROOT, env=user_shell(ENV), stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def output(self) -> str:
        return self.log.read_text()

    def interrupt(self, timeout: float = 120) -> int:
        """Ctrl-C, as a terminal sends it; the exit status."""
        os.kill(self.process.pid, signal.SIGINT)
        return self.process.wait(timeout)

    def stop(self) -> None:
        if self.process.poll() is None:  # the process group this test started, and nothing else
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-llama")
    server = EvoServe(tmp, write_llama_run(tmp / "llama-cpu_small-20261202-000000"))
    try:
        wait_for(lambda: server.process.poll() is not None or get(server, "/healthz")[0] == 200, 400,
                 "the llama engine to be verified and ready", SERVER_NOT_READY)
        # Serve answers before `evo serve` prints how to call it: wait for that line too (a loaded machine)
        wait_for(lambda: server.process.poll() is not None or "try it:" in server.output(), 120,
                 "evo serve to print that it is serving")
        assert server.process.poll() is None, server.output()[-3000:]
        yield server
    finally:
        server.stop()


def tokens(seed: int, B: int = 1, P: int = 7, N: int = 5, distribution: str = "uniform") -> dict:
    return W.make_inputs(CheckCase("http", {**PRESET.shape, "B": B, "P": P, "N": N}, distribution), "float32", "cpu", seed)


def body(inputs: dict, encoding: str = "data", **options) -> bytes:
    return json.dumps({"inputs": {k: encode_tensor(v, encoding) for k, v in inputs.items()}, "encoding": encoding,
                       **options}).encode()


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def served_logits(server, inputs: dict, encoding: str = "data") -> torch.Tensor:
    code, response = post(server, body(inputs, encoding))
    assert code == 200, response
    return decode_tensor(response["outputs"]["logits"], "logits")


def test_served_logits_and_greedy_tokens_match_the_float64_reference(server):
    for seed, encoding, axes in ((1, "data", {}), (2, "b64", {"B": 2, "P": 1, "N": 1}),
                                 (3, "b64", {"P": P_MAX, "N": N_MAX}), (4, "data", {"B": B_MAX, "N": 0})):
        inputs = tokens(seed, **axes)
        ref = W.reference_for(PRESET, inputs)["logits"]
        got = served_logits(server, inputs, encoding)
        assert got.dtype == torch.float32 and got.shape == ref.shape, (axes, got.shape)  # N=0: [B, 1, V]
        assert rel(got, ref) < 1e-5, axes
    inputs = tokens(5, B=2, P=9, N=6, distribution="extremes")
    code, response = post(server, body(inputs, reduce="argmax"))
    assert code == 200, response
    greedy = decode_tensor(response["outputs"]["logits"], "logits")
    ref = W.reference_for(PRESET, inputs)["logits"]
    top2 = ref.topk(2, -1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-4  # no near tie the float32 engine may break the other way
    assert greedy.dtype == torch.int64 and greedy.shape == (2, 7) and clear.sum() >= 10
    assert torch.equal(greedy[clear], ref.argmax(-1)[clear])
    info = get(server, "/v1/engine")[1]
    assert info["workload"] == "llama" and info["preset"] == "cpu_small" and info["verification"]["max_rel_error"] < 1e-5
    code, response = post(server, json.dumps(info["example_request"]).encode())  # the example it offers works
    assert code == 200 and response["outputs"]["logits"]["shape"][-1] == V, response


def _with(inputs: dict, **changes: dict) -> bytes:
    """The request of `inputs` with fields of named tensors replaced, e.g. prompt={"data": [...]}."""
    data = json.loads(body(inputs))
    for name, fields in changes.items():
        data["inputs"][name].update(fields)
    return json.dumps(data).encode()


def test_requests_outside_the_vocabulary_or_the_verified_lengths_get_422_naming_the_field(server):
    inputs = tokens(20)
    prompt = inputs["prompt"].flatten().tolist()
    bad = {
        "id = V": (_with(inputs, prompt={"data": prompt[:-1] + [V]}), "inputs.prompt.data", f"[0, {V - 1}]"),
        "id < 0": (_with(inputs, continuation={"data": [-1] * 5}), "inputs.continuation.data", "below the minimum 0"),
        "float id": (_with(inputs, prompt={"data": [float(t) for t in prompt]}), "inputs.prompt.data", "not an integer"),
        "P too long": (body(tokens(21, P=P_MAX + 1)), "inputs.prompt.shape", f"(P) is {P_MAX + 1}"),
        "N too long": (body(tokens(22, N=N_MAX + 1)), "inputs.continuation.shape", f"(N) is {N_MAX + 1}"),
        "B too large": (body(tokens(23, B=B_MAX + 1)), "inputs.prompt.shape", f"(B) is {B_MAX + 1}"),
        "empty prompt": (_with(inputs, prompt={"shape": [1, 0], "data": []}), "inputs.prompt.shape", "(P) is 0"),
    }
    for kind, (raw, field, words) in bad.items():
        code, response = post(server, raw)
        assert 400 <= code < 500 and response["error"]["field"].startswith(field), (kind, response)
        assert words in response["error"]["message"], (kind, response)
    assert get(server, "/healthz")[0] == 200
    assert rel(served_logits(server, inputs), W.reference_for(PRESET, inputs)["logits"]) < 1e-5


def test_concurrent_requests_are_merged_along_B_up_to_the_verified_batch(server):
    before = get(server, "/v1/engine")[1]["stats"]
    requests = [tokens(100 + i, B=1 + i % 2, P=11, N=4) for i in range(8)]  # 12 rows: at least 3 calls of <= 4
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda inputs: post(server, body(inputs, "b64")), requests))
    for inputs, (code, response) in zip(requests, replies):
        assert code == 200, response
        got = decode_tensor(response["outputs"]["logits"], "logits")
        assert rel(got, W.reference_for(PRESET, inputs)["logits"]) < 1e-5
    after = get(server, "/v1/engine")[1]["stats"]
    assert after["requests"] - before["requests"] == 8
    calls = after["engine_calls"] - before["engine_calls"]
    assert 3 <= calls < 8, f"{calls} engine calls for 8 requests of 12 rows (B <= {B_MAX} a call)"


def test_engine_states_the_paired_claim_first_and_labels_single_timings(server):
    info = get(server, "/v1/engine")[1]
    assert next(iter(info)) == "claim", list(info)[:3]
    assert info["claim"] == {"speedup": 2.04, "low": 1.92, "high": 2.4, "vs": "hf_sdpa", "paired": True,
                             "text": "2.04x [1.92, 2.40] vs hf_sdpa (paired re-timing, 95% interval)"}
    assert info["latency_ms_single_timing"] == 3.5 and "latency_ms" not in info
    assert info["speedups_single_timing"]["hf_sdpa"] == 2.3 and info["speedup_ci"] == CI
    assert info["batching"]["max_batch_size"] == B_MAX  # no --max-batch-size: the largest verified B
    assert "2.04x [1.92, 2.40] vs hf_sdpa" in server.output()  # the terminal leads with the claim too


def test_evo_serve_listens_on_loopback_only(server):
    """Its own Ray and Serve's HTTP proxy: every listener on 127.0.0.1, from a user's shell (no Ray settings)."""
    processes = process_tree(server.process.pid)
    found = listening(processes)
    assert any(port == server.port for _, _, _, port in found), found  # Serve's HTTP proxy is one of them
    assert exposed(processes) == [], found


def test_ctrl_c_stops_evo_serve_without_rays_warnings(server):  # last: it stops the module's server
    before = server.output()
    assert "serving engine" in before and "try it:" in before
    assert server.interrupt() == 0, server.output()[-3000:]
    after = server.output()[len(before):]  # what Ctrl-C printed
    for noise in ("retries remaining", "(raylet)", "Traceback", "WARNING", "ERROR"):
        assert noise not in after, after[-3000:]


def test_a_deployment_that_fails_prints_its_cause_in_one_line(tmp_path):
    # Factored exponents over a whole 128-token chunk overflow under strong decay: it fails verification in
    # the replica (after the command line accepted it), once: Serve does not try it again (a second draw of inputs).
    broken = write_run(tmp_path / "run-broken", chunk_size=128, exponent_form="factored_chunk", sub_chunk_size=16)
    process = EvoServe(tmp_path, broken)
    try:
        code = process.process.wait(400)
    finally:
        process.stop()
    errors = [line for line in process.output().splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1, process.output()[-3000:]
    assert "failed to deploy: EngineRejected: engine" in errors[0] and "failed its verification" in errors[0], errors
    assert "non-finite" in errors[0] and "Deploying application" not in process.output()
    from evo.serving.app import EngineServer

    assert EngineServer._deployment_config.max_constructor_retry_count == 1  # one verification, no second draw
