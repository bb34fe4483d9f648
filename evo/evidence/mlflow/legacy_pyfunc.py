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
        from evo.evidence.mlflow.pyfunc_engine import confined_engine, input_check

        record = EngineRecord.from_dict(json.loads(Path(context.artifacts["engine"]).read_text()), "pyfunc")
        self.check = input_check(record)  # Serve's request rules: a bad input is one line naming it
        self.engine = confined_engine(record)  # in its own engine process, as Serve runs it

    def predict(self, context, model_input, params=None):  # untyped, as those versions were logged
        return {name: tensor.float().numpy() for name, tensor in self.engine(**self.check(model_input)).items()}
