"""A llama engine served by the real Serve app (a `ray start` head, `serve deploy`, real HTTP; one start
for the module): token ids in, logits equal to the float64 reference or greedy tokens out, requests
outside the verified domain refused naming the field, N=0, and requests merged along B up to the
largest verified B."""
from __future__ import annotations

import concurrent.futures
import json

import pytest
import torch

from evo.serving.codec import decode_tensor, encode_tensor
from evo.workloads import get_workload
from evo.workloads.base import CheckCase
from tests.test_serving import SERVER_NOT_READY, Server, get, post
from tests.waiting import wait_for

pytestmark = pytest.mark.slow  # a `ray start` head and a Serve deploy (~85 s at load 13, most of it startup)

W = get_workload("llama")
PRESET = W.presets()["cpu_small"]
V = PRESET.shape["V"]
DOMAIN = W.domain(PRESET)
B_MAX, P_MAX, N_MAX = (DOMAIN.axes[a].hi for a in ("B", "P", "N"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("serve-llama"))
    try:  # batches of the largest verified B (a larger max_batch_size is refused)
        server.deploy("default:llama/cpu_small", "llama", max_batch_size=B_MAX)
        wait_for(lambda: get(server, "/healthz")[0] == 200, 300, "the llama engine to be verified and ready",
                 SERVER_NOT_READY)
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
