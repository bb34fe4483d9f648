"""The registered model's pyfunc flavour: a loader module, so nothing is pickled.

`mlflow.pyfunc.load_model("models:/NAME@champion")` imports this module and calls `_load_pyfunc` with
the model's `engine/` folder (`engine.json`: workload, preset, genome and the search's figures); the
engine is rebuilt from its genome on CPU. MLflow checks the inputs against the model's signature (the
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
        from evo.workloads import get_workload
        from evo.workloads.base import DeviceInfo

        workload = get_workload(record.workload)
        preset = workload.presets()[record.preset]
        self.record = record
        self.engine = workload.build(record.genome, preset, DeviceInfo("cpu", "cpu", 1), record.sources)

    def predict(self, model_input: dict[str, np.ndarray], params: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
        import torch

        inputs = {name: torch.as_tensor(value) for name, value in model_input.items() if value is not None}
        with torch.no_grad():
            outputs = self.engine(**inputs)
        return {name: tensor.float().numpy() for name, tensor in outputs.items()}


def _load_pyfunc(data_path: str) -> EngineModel:
    """MLflow's entry point for a loader-module model: `data_path` is the model's `engine/` folder."""
    path = Path(data_path)
    engine = path / ENGINE_FILE if path.is_dir() else path
    return EngineModel(EngineRecord.from_dict(json.loads(engine.read_text()), f"pyfunc:{data_path}"))
