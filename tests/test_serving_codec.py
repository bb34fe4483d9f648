"""The Serve endpoint's tensor codec: round trips, and one RequestError per kind of bad request."""
from __future__ import annotations

import base64
import json
import time

import pytest
import torch

from evo.serving.codec import RequestError, decode_request, decode_tensor, encode_outputs, encode_tensor
from evo.workloads.kda import WORKLOAD as KDA
from evo.workloads.kda.inputs import PRESETS
from evo.workloads.requests import TensorSpec

kda_input_specs = KDA.request_specs  # the schema the KDA workload declares for serving

MAX = 1 << 26
SPECS = (
    TensorSpec("x", ("B", "T", 3), ("float32", "bfloat16"), dim_names=("B", "T", "C")),
    TensorSpec("y", ("B", "T"), ("float32",), bounds=(0.0, 1.0)),
    TensorSpec("z", ("B",), ("float32",), required=False, allow_nonfinite=True),
)


def _valid(B: int = 2, T: int = 4) -> dict:
    return {"inputs": {"x": encode_tensor(torch.randn(B, T, 3)), "y": encode_tensor(torch.rand(B, T))}}


def _err(body, specs=SPECS, **kw) -> RequestError:
    with pytest.raises(RequestError) as e:
        decode_request(body if isinstance(body, (str, bytes)) else json.dumps(body), specs,
                       max_bytes=kw.pop("max_bytes", MAX), **kw)
    return e.value


def _with(name: str, entry: dict) -> dict:
    body = _valid()
    body["inputs"][name] = entry
    return body


# ---- round trips -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64])
@pytest.mark.parametrize("encoding", ["data", "b64"])
def test_round_trip_is_bit_exact(dtype, encoding):
    t = (torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0)) * 1e3).to(dtype)
    wire = json.loads(json.dumps(encode_tensor(t, encoding)))
    back = decode_tensor(wire, "t")
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.view(torch.int16) if dtype == torch.bfloat16 else back,
                       t.view(torch.int16) if dtype == torch.bfloat16 else t)


def test_bfloat16_b64_is_upper_half_of_float32():
    t = torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16)
    raw = base64.b64decode(encode_tensor(t, "b64")["b64"])
    f32 = t.float().numpy().astype("<f4").tobytes()
    assert raw == b"".join(f32[i + 2:i + 4] for i in range(0, len(f32), 4))


def test_bfloat16_data_rounds_to_nearest():
    t = decode_tensor({"shape": [2], "dtype": "bfloat16", "data": [1.00390625, 1.01171875]}, "t")
    assert t.float().tolist() == [1.0, 1.015625]  # ties to even: 1+2^-8 -> 1, 1+3*2^-8 -> 1+2^-6


def test_flat_and_nested_data_agree_and_nan_literals_parse():
    nested = decode_tensor({"shape": [2, 2], "dtype": "float32", "data": [[1, 2], [3, 4]]}, "t")
    flat = decode_tensor({"shape": [2, 2], "dtype": "float32", "data": [1, 2, 3, 4]}, "t")
    assert torch.equal(nested, flat)
    t = decode_tensor(json.loads('{"shape": [2], "dtype": "float32", "data": [NaN, -Infinity]}'), "t")
    assert t.isnan()[0] and t[1] == float("-inf")


def test_encode_outputs_and_unknown_encoding():
    out = encode_outputs({"o": torch.ones(1, 2)}, "b64")
    assert set(out) == {"outputs"} and torch.equal(decode_tensor(out["outputs"]["o"], "o"), torch.ones(1, 2))
    with pytest.raises(RequestError) as e:
        encode_outputs({"o": torch.ones(1)}, "hex")
    assert e.value.field == "encoding" and "'hex'" in e.value.message and "b64" in e.value.message


# ---- KDA ---------------------------------------------------------------------------------------

def _kda_body(preset, T: int, encoding: str, initial_state: bool | None) -> dict:
    s = preset.shape
    B, H, K, V = s["B"], s["H"], s["K"], s["V"]
    inputs = {"q": torch.randn(B, T, H, K), "k": torch.randn(B, T, H, K), "v": torch.randn(B, T, H, V),
              "g": -torch.rand(B, T, H, K), "beta": torch.rand(B, T, H)}
    body = {"inputs": {n: encode_tensor(t, encoding) for n, t in inputs.items()}}
    if initial_state is not None:
        body["inputs"]["initial_state"] = encode_tensor(torch.randn(B, H, K, V), encoding) if initial_state else None
    return body


@pytest.mark.parametrize("initial_state", [True, False, None])
def test_kda_cpu_small_request_decodes(initial_state):
    preset = PRESETS["cpu_small"]
    s = preset.shape
    out = decode_request(json.dumps(_kda_body(preset, 100, "data", initial_state)), kda_input_specs(preset),
                         max_bytes=MAX)
    assert {n: tuple(t.shape) for n, t in out.items()} == {
        "q": (1, 100, s["H"], s["K"]), "k": (1, 100, s["H"], s["K"]), "v": (1, 100, s["H"], s["V"]),
        "g": (1, 100, s["H"], s["K"]), "beta": (1, 100, s["H"]),
        **({"initial_state": (1, s["H"], s["K"], s["V"])} if initial_state else {})}
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in out.values())


def test_kda_bfloat16_preset_wants_bfloat16_and_float32_state():
    specs = {s.name: s for s in kda_input_specs(PRESETS["h200"])}
    assert specs["q"].dtypes == ("bfloat16",) and specs["initial_state"].dtypes == ("float32",)
    assert specs["q"].shape == ("B", "T", 96, 128) and not specs["initial_state"].required


def test_kda_cpu_preset_b64_decodes_in_milliseconds():
    preset = PRESETS["cpu"]
    body = json.dumps(_kda_body(preset, preset.shape["T"], "b64", True))  # ~1.3 M floats, 5.7 MB
    best = float("inf")
    for _ in range(3):  # best of 3: the box may be busy; a per-element Python loop would take seconds
        t0 = time.perf_counter()
        decode_request(body, kda_input_specs(preset), max_bytes=MAX)
        best = min(best, time.perf_counter() - t0)
    # ~20 ms on an idle core, ~0.3 s at a load of 6 on 2 cores; a per-element loop takes several seconds
    assert best < 2.0, f"{best * 1e3:.0f} ms"


def test_kda_fixed_dim_and_bounds():
    preset = PRESETS["cpu_small"]
    body = _kda_body(preset, 8, "data", None)
    body["inputs"]["k"] = encode_tensor(torch.randn(1, 8, 2, 16))
    e = _err(body, kda_input_specs(preset))
    assert (e.field, e.status) == ("inputs.k.shape", 422) and "K" in e.message and "32" in e.message
    body = _kda_body(preset, 8, "b64", None)
    g = -torch.rand(1, 8, 2, 32)
    g[0, 3, 1, 5] = 0.5
    body["inputs"]["g"] = encode_tensor(g, "b64")
    e = _err(body, kda_input_specs(preset))
    assert (e.field, e.status) == ("inputs.g.b64", 422)
    assert "0.5" in e.message and "[0, 3, 1, 5]" in e.message and "[-5, 0]" in e.message  # the domain's floor of g


# ---- request-level errors ----------------------------------------------------------------------

def test_valid_request_and_optional_null():
    body = _valid()
    body["inputs"]["z"] = None
    out = decode_request(json.dumps(body), SPECS, max_bytes=MAX)
    assert set(out) == {"x", "y"} and out["x"].shape == (2, 4, 3)
    assert set(decode_request(_valid(), SPECS, max_bytes=MAX)) == {"x", "y"}  # a parsed dict is accepted


def test_body_too_large_is_413():
    body = json.dumps(_valid())
    e = _err(body, max_bytes=100)
    assert (e.field, e.status) == ("body", 413) and str(len(body)) in e.message and "100" in e.message


@pytest.mark.parametrize("body", ['{"inputs": ', b"\xff\xfe{", "[" * 100000])
def test_malformed_json_is_400(body):
    e = _err(body)
    assert (e.field, e.status) == ("body", 400) and "malformed JSON" in e.message


@pytest.mark.parametrize("body, field, words", [
    ("[1, 2]", "body", ["array", "inputs"]),
    ({"x": {}}, "x", ["'x'", "inputs"]),
    ({}, "inputs", ["missing"]),
    ({"inputs": [1]}, "inputs", ["array", "'x'"]),
    ({"inputs": {"x": {}, "w": {}}}, "inputs.w", ["'w'", "'x'", "'y'", "'z'"]),
    ({"inputs": {"x": {}}}, "inputs.y", ["['y']", "received ['x']"]),
    ({"inputs": {"x": None, "y": {}}}, "inputs.x", ["['x']", "null", "required: ['x', 'y']"]),
])
def test_request_structure_errors(body, field, words):
    e = _err(body)
    assert (e.field, e.status) == (field, 422)
    assert all(w in e.message for w in words), e.message
    assert e.to_dict() == {"error": {"field": field, "message": e.message, "status": 422}}


def test_extra_top_level_keys_can_be_allowed():
    assert set(decode_request({**_valid(), "encoding": "b64"}, SPECS, max_bytes=MAX, extra_keys=("encoding",)))
    assert _err({**_valid(), "encoding": "b64"}).field == "encoding"


def test_too_many_elements_is_413():
    e = _err(_valid(B=2, T=4), max_elements=30)  # x: 24, y: 8
    assert (e.field, e.status) == ("inputs.y.shape", 413) and "32" in e.message and "30" in e.message


# ---- tensor-level errors -----------------------------------------------------------------------

X = {"shape": [2, 4, 3], "dtype": "float32"}


@pytest.mark.parametrize("entry, field, words", [
    ([1, 2], "inputs.x", ["array", "shape"]),
    ({"dtype": "float32", "data": [1]}, "inputs.x", ["['shape']", "dtype"]),
    ({**X, "data": [0] * 24, "order": "C"}, "inputs.x", ["['order']", "'b64'"]),
    ({**X, "data": [0] * 24, "b64": "AA=="}, "inputs.x", ["both"]),
    (X, "inputs.x", ["neither"]),
    ({**X, "dtype": "float16", "data": [0] * 24}, "inputs.x.dtype", ["'float16'", "['float32', 'bfloat16']"]),
    ({**X, "dtype": "float64", "data": [0] * 24}, "inputs.x.dtype", ["'float64'", "['float32', 'bfloat16']"]),
    ({**X, "shape": [2, 0, 3], "data": []}, "inputs.x.shape", ["[2, 0, 3]", "dim 1 (T) is 0", "starts at 0"]),
    ({**X, "shape": [2, -1, 3], "data": []}, "inputs.x.shape", ["[2, -1, 3]", "non-negative ints"]),
    ({**X, "shape": "2,4,3", "data": []}, "inputs.x.shape", ["'2,4,3'", "non-negative ints"]),
    ({**X, "shape": [2, 4.0, 3], "data": []}, "inputs.x.shape", ["4.0", "non-negative ints"]),
    ({**X, "shape": [2, 4], "data": [0] * 8}, "inputs.x.shape", ["rank 2", "rank 3", "[B, T, C=3]"]),
    ({**X, "shape": [2, 4, 5], "data": [0] * 40}, "inputs.x.shape", ["dim 2 (C)", "must be 3", "[2, 4, 5]"]),
    ({**X, "data": [0] * 23}, "inputs.x.data", ["23", "24"]),
    ({**X, "data": [[[0] * 3] * 4, [[0] * 3] * 3]}, "inputs.x.data", ["ragged", "data[1]", "3 entries", "4"]),
    ({**X, "data": [[[0] * 3] * 4, [[0] * 3] * 3 + [[0, 0]]]}, "inputs.x.data", ["ragged", "data[1][3]", "2"]),
    ({**X, "data": [[[0] * 3] * 4, [[0] * 3] * 3 + [5]]}, "inputs.x.data", ["data[1][3]", "5", "list of 3"]),
    ({**X, "data": [0] * 23 + ["1"]}, "inputs.x.data", ["data[23]", "'1'", "string", "number"]),
    ({**X, "data": [[[0] * 3] * 4, [[0] * 3] * 3 + [[0, True, 0]]]}, "inputs.x.data",
     ["data[1][3][1]", "True", "boolean"]),
    ({**X, "data": [0] * 23 + [None]}, "inputs.x.data", ["data[23]", "None", "null"]),
    ({**X, "data": [0] * 23 + [[1]]}, "inputs.x.data", ["data[23]", "[1]", "number"]),
    ({**X, "data": "0" * 24}, "inputs.x.data", ["string", "24"]),
    ({**X, "data": [0] * 23 + [10 ** 400]}, "inputs.x.data", ["too large"]),
    ({**X, "b64": "not base64!"}, "inputs.x.b64", ["malformed base64"]),
    ({**X, "b64": 12}, "inputs.x.b64", ["number", "base64"]),
    ({**X, "b64": base64.b64encode(bytes(95)).decode()}, "inputs.x.b64", ["95 bytes", "96"]),
    ({**X, "dtype": "bfloat16", "b64": base64.b64encode(bytes(96)).decode()}, "inputs.x.b64", ["96 bytes", "48"]),
    ({**X, "data": [0] * 23 + [float("nan")]}, "inputs.x.data", ["nan", "[1, 3, 2]", "finite"]),
    ({**X, "data": [0] * 23 + [1e39]}, "inputs.x.data", ["inf", "overflow of float32", "finite"]),
])
def test_tensor_errors(entry, field, words):
    body = _valid()
    body["inputs"]["x"] = entry
    e = _err(body)
    assert (e.field, e.status) == (field, 422)
    assert all(w in e.message for w in words), e.message


def test_symbolic_dims_must_agree():
    e = _err(_with("y", encode_tensor(torch.rand(2, 5))))
    assert (e.field, e.status) == ("inputs.y.shape", 422)
    assert "dim 1 (T) is 5" in e.message and "T = 4" in e.message and "inputs.x.shape" in e.message
    body = _with("z", encode_tensor(torch.rand(3)))
    assert "dim 0 (B) is 3" in _err(body).message


def test_bounds_and_allowed_nonfinite():
    y = torch.rand(2, 4)
    y[1, 2] = -0.25
    e = _err(_with("y", encode_tensor(y, "b64")))
    assert (e.field, e.status) == ("inputs.y.b64", 422)
    assert "-0.25" in e.message and "[1, 2]" in e.message and "below the minimum 0" in e.message
    assert "[0, 1]" in e.message
    y[1, 2] = 1.5
    assert "above the maximum 1" in _err(_with("y", encode_tensor(y))).message
    body = _valid()
    body["inputs"]["z"] = encode_tensor(torch.tensor([float("inf"), float("nan")]))
    z = decode_request(json.dumps(body), SPECS, max_bytes=MAX)["z"]  # z allows non-finite values
    assert z[0] == float("inf") and z[1].isnan()


# ---- integer tensors (token ids) and empty dims ----------------------------------------------------

TOKENS = (TensorSpec("ids", ("B", "P"), ("int64",), bounds=(0, 99)), TensorSpec("more", ("B", "N"), ("int64",)))


def _ids(ids, more=None, **kw):
    more = [[] for _ in ids] if more is None else more
    body = {"inputs": {"ids": {"shape": [len(ids), len(ids[0])], "dtype": "int64", "data": ids},
                       "more": {"shape": [len(more), len(more[0])], "dtype": "int64", "data": more}}}
    return decode_request(json.dumps(body), TOKENS, max_bytes=MAX, **kw)


def test_int64_ids_decode_and_an_empty_dim_is_allowed_where_the_domain_starts_at_0():
    out = _ids([[1, 2, 99], [0, 5, 7]], axes={"N": (0, 4)})
    assert out["ids"].dtype == torch.int64 and out["ids"].tolist() == [[1, 2, 99], [0, 5, 7]]
    assert out["more"].shape == (2, 0)
    with pytest.raises(RequestError) as e:
        _ids([[1, 2]], axes={"N": (1, 4)})
    assert e.value.field == "inputs.more.shape" and "starts at 0" in e.value.message


@pytest.mark.parametrize("ids, words", [
    ([[1, 2.0]], ["2.0", "not an integer"]),
    ([[1, True]], ["boolean"]),
    ([[1, 2 ** 63]], ["out of the range of int64"]),
    ([[1, 100]], ["100", "above the maximum 99", "[0, 99]"]),
    ([[-1, 3]], ["-1", "below the minimum 0"]),
])
def test_int64_errors_name_the_value(ids, words):
    with pytest.raises(RequestError) as e:
        _ids(ids, axes={"N": (0, 4)})
    assert e.value.field == "inputs.ids.data" and all(w in e.value.message for w in words), e.value.message


def test_example_request_of_an_integer_schema_decodes_and_argmax_reduces_the_last_dim():
    from evo.serving.app import REDUCTIONS
    from evo.serving.example import example_body
    body = example_body(TOKENS, {"B": (1, 4), "P": (1, 8), "N": (0, 4)})
    out = decode_request(json.dumps(body), TOKENS, max_bytes=MAX, axes={"N": (0, 4)})
    assert out["ids"].tolist() == [[49]] and out["more"].shape == (1, 1)
    logits = torch.tensor([[[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]]])
    assert REDUCTIONS["argmax"]({"logits": logits})["logits"].tolist() == [[1, 0]]
    assert REDUCTIONS["none"]({"logits": logits})["logits"] is logits


def test_the_registered_pyfunc_checks_inputs_by_serves_rules(monkeypatch):
    """A token id past the vocabulary through the registered model is one line naming the input and the
    allowed range (Serve's rule, `check_tensors`), not an IndexError from the engine."""
    import numpy as np

    from evo.evidence.mlflow import pyfunc_engine
    from evo.serving.source import resolve
    from evo.workloads import get_workload

    calls = []
    monkeypatch.setattr(pyfunc_engine, "confined_engine", lambda record: lambda **inputs: calls.append(inputs) or
                        {"logits": torch.zeros(1, inputs["continuation"].shape[1] + 1, 256)})
    model = pyfunc_engine.EngineModel(resolve("default:llama/cpu_small"))
    V = get_workload("llama").presets()["cpu_small"].shape["V"]
    prompt, continuation = np.zeros((1, 5), np.int64), np.ones((1, 2), np.int64)
    assert model.predict({"prompt": prompt, "continuation": continuation})["logits"].shape == (1, 3, 256)
    prompt[0, 3] = V
    for inputs, field, words in (({"prompt": prompt, "continuation": continuation}, "prompt", f"[0, {V - 1}]"),
                                 ({"prompt": np.zeros((5, 5), np.int64), "continuation": continuation},
                                  "prompt.shape", "B must lie in [1, 4]"),
                                 ({"prompt": np.zeros((1, 5), np.int64)}, "continuation", "missing")):
        with pytest.raises(RequestError) as caught:
            model.predict(inputs)
        assert caught.value.field == field and words in str(caught.value) and "\n" not in str(caught.value)
    assert len(calls) == 1  # only the valid request reached the engine
