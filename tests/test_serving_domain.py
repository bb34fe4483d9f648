"""Serve accepts exactly the domain engines are verified over: each bound of it, and one step beyond
each, through the request validation Serve runs (`request_schema` + `decode_request`). One real
Serve request past a bound is in test_serving.py."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from evo.serving.app import request_schema
from evo.serving.codec import RequestError, decode_request, encode_tensor
from evo.workloads.base import CheckCase
from evo.workloads.kda import WORKLOAD as KDA

PRESET = KDA.presets()["cpu_small"]
DOMAIN = KDA.domain(PRESET)
SPECS, AXES = request_schema(KDA, PRESET)
MAX = 1 << 28


def body(B: int = 1, T: int = 5, H: int | None = None, **values: float) -> bytes:
    """A b64 request at this shape; each of `values` (an input name) set at one element."""
    shape = {**PRESET.shape, "B": B, "T": T, "H": H or PRESET.shape["H"]}
    inputs = KDA.make_inputs(CheckCase("edge", shape, "standard", True), "float32", "cpu", 1)
    for name, value in values.items():
        inputs[name].view(-1)[-1] = value
    return json.dumps({"inputs": {k: encode_tensor(v, "b64") for k, v in inputs.items()}}).encode()


def decode(raw: bytes) -> dict:
    return decode_request(raw, SPECS, max_bytes=MAX, axes=AXES)


def refused(raw: bytes) -> RequestError:
    with pytest.raises(RequestError) as e:
        decode(raw)
    assert e.value.status == 422
    return e.value


def below(x: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(-math.inf)))


def above(x: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(math.inf)))


def test_serve_bounds_are_the_domain():
    assert AXES == {"B": (1, 8), "T": (1, 8 * PRESET.shape["T"]), "H": (1, PRESET.shape["H"] + 1)}
    assert KDA.verified_batch(PRESET) == DOMAIN.axes["B"].hi
    bounds = {s.name: s.bounds for s in SPECS}
    assert bounds["g"] == (DOMAIN.values["g"].lo, DOMAIN.values["g"].hi) == (-5.0, 0.0)
    assert bounds["beta"] == (0.0, 1.0)


@pytest.mark.parametrize("axis", ["B", "T"])
def test_every_free_axis_is_accepted_at_its_bounds_and_refused_one_step_beyond(axis):
    lo, hi = AXES[axis]
    for value in (lo, hi):
        inputs = decode(body(**{axis: value}))
        assert inputs["q"].shape[0 if axis == "B" else 1] == value
    e = refused(body(**{axis: hi + 1}))
    assert e.field == "inputs.q.shape" and f"({axis}) is {hi + 1}" in e.message and f"[{lo}, {hi}]" in e.message
    # one step below the lowest (1) is a dim of 0: no tensor at all
    data = json.loads(body())
    data["inputs"]["q"]["shape"][0 if axis == "B" else 1] = lo - 1
    e = refused(json.dumps(data).encode())
    assert e.field == "inputs.q.shape" and f"({axis}) is 0" in e.message and "starts at 0" in e.message


def test_heads_are_the_presets_only_a_subset_of_the_verified_range():
    decode(body(H=PRESET.shape["H"]))
    for H in (PRESET.shape["H"] - 1, PRESET.shape["H"] + 1):
        assert "fixed" in refused(body(H=H)).message


@pytest.mark.parametrize("name", ["g", "beta"])
def test_every_value_bound_is_accepted_and_refused_one_float_beyond(name):
    r = DOMAIN.values[name]
    for edge, beyond in ((r.lo, below(r.lo)), (r.hi, above(r.hi))):
        assert decode(body(**{name: edge}))[name].view(-1)[-1] == edge
        e = refused(body(**{name: beyond}))
        assert e.field == f"inputs.{name}.b64" and f"[{r.lo:g}, {r.hi:g}]" in e.message, e.message


def test_the_largest_accepted_request_is_one_the_cascade_draws():
    """Serve's largest T is the domain's, reached by the evaluator's draws (test_domain) and by Serve's own check."""
    inputs = decode(body(T=AXES["T"][1]))
    assert DOMAIN.outside({**PRESET.shape, "T": inputs["q"].shape[1]}, PRESET.shape) is None
    assert torch.isfinite(inputs["g"]).all()
