"""A request a served engine accepts, built from its own request schema: the `curl` that `evo serve` prints.

The smallest legal request: every free dim at the low end of its verified range (or 1), every
required tensor filled with one value inside its bounds, in `data` encoding so it can be read.
Nothing here imports Ray or torch.
"""
from __future__ import annotations

import json
import math
import shlex
from typing import Mapping

from evo.workloads.requests import TensorSpec


def example_body(specs: tuple[TensorSpec, ...], axes: Mapping[str, tuple[int, int]]) -> dict:
    """`{"inputs": {name: tensor}}` for the required inputs of `specs`, free dims at their smallest."""
    inputs = {}
    for spec in specs:
        if not spec.required:
            continue
        shape = [d if isinstance(d, int) else max(1, axes.get(d, (1, 1))[0]) for d in spec.shape]
        value = _inside(spec.bounds)
        if spec.dtypes[0].startswith("int"):  # integer tensors (token ids) take a whole number
            value = math.floor(value) if spec.bounds[0] is None else max(spec.bounds[0], math.floor(value))
        inputs[spec.name] = {"shape": shape, "dtype": spec.dtypes[0], "data": [value] * math.prod(shape)}
    return {"inputs": inputs}


def example_curl(url: str, specs: tuple[TensorSpec, ...], axes: Mapping[str, tuple[int, int]]) -> str:
    """A shell command that POSTs `example_body` to `url`/v1/infer."""
    body = json.dumps(example_body(specs, axes), separators=(",", ":"))
    return (f"curl -s {url.rstrip('/')}/v1/infer -H 'Content-Type: application/json' -d {shlex.quote(body)}")


def _inside(bounds: tuple[float | None, float | None]) -> float:
    """A round value within inclusive (lo, hi) bounds, each None when unbounded."""
    lo, hi = bounds
    if lo is not None and hi is not None:
        return round((lo + hi) / 2, 3)
    if lo is not None:
        return lo + 0.5
    if hi is not None:
        return hi - 0.5
    return 0.1
