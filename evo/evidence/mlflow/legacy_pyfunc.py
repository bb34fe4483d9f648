"""The pickled pyfunc class of engine versions registered before the loader module (`pyfunc_engine`).

Those versions name `evo.registry.EnginePyfunc` or `evo.evidence.mlflow.registry.EnginePyfunc`; both
resolve here on demand, so loading an old version still works. New versions pickle nothing.
"""
from __future__ import annotations

import json
from pathlib import Path

import mlflow.pyfunc

from evo.evidence.engine_record import EngineRecord


class EnginePyfunc(mlflow.pyfunc.PythonModel):
    """predict({input name: array}) -> {output name: float32 array} with the engine on CPU."""

    def load_context(self, context) -> None:
        from evo.workloads import get_workload
        from evo.workloads.base import DeviceInfo

        record = EngineRecord.from_dict(json.loads(Path(context.artifacts["engine"]).read_text()), "pyfunc")
        workload = get_workload(record.workload)
        preset = workload.presets()[record.preset]
        self.engine = workload.build(record.genome, preset, DeviceInfo("cpu", "cpu", 1), record.sources)
        self.dtype = preset.dtype

    def predict(self, context, model_input, params=None):  # untyped, as those versions were logged
        import torch

        inputs = {name: torch.as_tensor(value) for name, value in model_input.items() if value is not None}
        with torch.no_grad():
            outputs = self.engine(**inputs)
        return {name: tensor.float().numpy() for name, tensor in outputs.items()}
