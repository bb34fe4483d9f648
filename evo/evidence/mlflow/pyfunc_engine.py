"""The registered model's pyfunc flavour: a loader module, so nothing is pickled.

`mlflow.pyfunc.load_model("models:/NAME@champion")` imports this module and calls `_load_pyfunc` with
the model's `engine/` folder (`engine.json`: workload, preset, genome and the search's figures). The
engine runs where the judge judged it, never in the caller's process: `evaluators.served.engine.ServedEngine`
builds and verifies it in a confined engine process (the strict sandbox where this machine can build it;
elsewhere a genome without code genes, the project's own engines, runs in an unconfined process of its
own, and one with code genes is refused). MLflow checks the inputs against the model's signature (the
workload's request schema, `evo.evidence.mlflow.registry.engine_signature`) before `predict` sees them;
`predict` then checks them by Serve's rules (`evo.workloads.requests.check_tensors`: shapes within the verified
domain, values within their bounds, e.g. token ids in [0, V-1]): a bad input is one `RequestError` line
naming the input and what is allowed, never an engine's IndexError.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from evo.evidence.engine_record import ENGINE_FILE, EngineRecord


class EngineModel:
    """predict({input name: array}) -> {output name: float32 array}, with the engine on CPU."""

    def __init__(self, record: EngineRecord) -> None:
        self.record = record
        self.check = input_check(record)
        self.engine = confined_engine(record)

    def predict(self, model_input: dict[str, np.ndarray], params: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
        inputs = self.check(model_input)
        return {name: tensor.float().numpy() for name, tensor in self.engine(**inputs).items()}


def input_check(record: EngineRecord) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """{name: array} -> {name: tensor}, checked as Serve checks a request for this record's engine (the
    workload's request schema bounded by its verified domain); RequestError (a ValueError) names the input."""
    import torch

    from evo.workloads.requests import check_tensors, request_schema
    from evo.workloads import get_workload

    workload = get_workload(record.workload)
    try:
        specs, axes = request_schema(workload, workload.presets()[record.preset])
    except NotImplementedError:  # a workload without a request schema: its engine sees the arrays as given
        specs = None

    def check(model_input: Mapping[str, Any]) -> dict[str, Any]:
        inputs = {name: torch.as_tensor(value) for name, value in model_input.items() if value is not None}
        return inputs if specs is None else check_tensors(inputs, specs, axes, prefix="")

    return check


def confined_engine(record: EngineRecord) -> Any:
    """The record's engine, built and verified in its own engine process (strict sandbox where possible)."""
    from evaluators.sandbox import jail
    from evaluators.served.engine import ServedEngine
    from evaluators.settings import EvaluatorSettings

    why = jail.unavailable()
    if why and record.sources:
        raise RuntimeError(f"engine {record.genome.hash} carries code genes, which run only in the judge's strict "
                           f"sandbox, and this machine cannot build it: {why}")
    return ServedEngine(record.workload, record.preset, record.genome.to_json(), record.sources,
                        EvaluatorSettings(sandbox="none" if why else "strict"))


def _load_pyfunc(data_path: str) -> EngineModel:
    """MLflow's entry point for a loader-module model: `data_path` is the model's `engine/` folder."""
    path = Path(data_path)
    engine = path / ENGINE_FILE if path.is_dir() else path
    return EngineModel(EngineRecord.from_dict(json.loads(engine.read_text()), f"pyfunc:{data_path}"))
