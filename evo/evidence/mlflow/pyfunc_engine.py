"""The registered model's pyfunc flavour: a loader module, so nothing is pickled.

`mlflow.pyfunc.load_model("models:/NAME@champion")` imports this module and calls `_load_pyfunc` with
the model's `engine/` folder (`engine.json`: workload, preset, genome and the search's figures). The
engine runs where the judge judged it, never in the caller's process: `evaluators.served.ServedEngine`
builds and verifies it in a confined engine process (the strict sandbox where this machine can build it;
elsewhere a genome without code genes, the project's own engines, runs in an unconfined process of its
own, and one with code genes is refused). MLflow checks the inputs against the model's signature (the
workload's request schema, `evo.evidence.mlflow.registry.engine_signature`) before `predict` sees them.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from evo.evidence.engine_record import ENGINE_FILE, EngineRecord


class EngineModel:
    """predict({input name: array}) -> {output name: float32 array}, with the engine on CPU."""

    def __init__(self, record: EngineRecord) -> None:
        self.record = record
        self.engine = confined_engine(record)

    def predict(self, model_input: dict[str, np.ndarray], params: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
        import torch

        inputs = {name: torch.as_tensor(value) for name, value in model_input.items() if value is not None}
        return {name: tensor.float().numpy() for name, tensor in self.engine(**inputs).items()}


def confined_engine(record: EngineRecord) -> Any:
    """The record's engine, built and verified in its own engine process (strict sandbox where possible)."""
    from evaluators import jail
    from evaluators.served import ServedEngine
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
