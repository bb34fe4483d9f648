"""Register a search's best engine in MLflow as a pyfunc model, linked to the search's parent run.

The model's artifacts are `engine.json` (workload, preset, genome, and what the search measured)
and `genome.json`. Loading it with `mlflow.pyfunc.load_model` rebuilds the engine from the genome;
the Serve app reads `engine.json` from `models:/NAME/VERSION` and builds and verifies it itself.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import mlflow
import mlflow.pyfunc

from evo.evidence.engine_record import ENGINE_FILE, EngineRecord


class EnginePyfunc(mlflow.pyfunc.PythonModel):
    """predict({input name: array}) -> {output name: float32 array} with the engine on CPU; the names
    are the workload's (`input_names`, `output_names`)."""

    def load_context(self, context) -> None:
        from evo.workloads import get_workload
        from evo.workloads.base import DeviceInfo

        record = EngineRecord.from_dict(json.loads(Path(context.artifacts["engine"]).read_text()), "pyfunc")
        workload = get_workload(record.workload)
        preset = workload.presets()[record.preset]
        self.engine = workload.build(record.genome, preset, DeviceInfo("cpu", "cpu", 1), record.sources)
        self.dtype = preset.dtype

    # No type hints on predict: MLflow would read them as a (list-of-rows) schema.
    def predict(self, context, model_input, params=None):
        import torch

        inputs = {name: torch.as_tensor(value) for name, value in model_input.items() if value is not None}
        with torch.no_grad():
            outputs = self.engine(**inputs)
        return {name: tensor.float().numpy() for name, tensor in outputs.items()}


def register_engine(record: EngineRecord, run_id: str, model_name: str, tracking_uri: str,
                    tags: dict[str, str] | None = None) -> str:
    """Log the engine as a model of run `run_id` and register it as `model_name`; returns its version.
    `tags` go on the model version (e.g. `speedup_ci.<baseline>`: the paired 95% interval of its speedup)."""
    mlflow.set_tracking_uri(tracking_uri)
    with tempfile.TemporaryDirectory() as tmp:
        engine = Path(tmp) / ENGINE_FILE
        engine.write_text(json.dumps(record.to_dict(), indent=2, sort_keys=True))
        genome = Path(tmp) / "genome.json"
        genome.write_text(json.dumps(record.genome.to_dict(), indent=2, sort_keys=True))
        with mlflow.start_run(run_id=run_id):
            info = mlflow.pyfunc.log_model(
                name="engine", python_model=EnginePyfunc(),
                artifacts={"engine": str(engine), "genome": str(genome)},
                pip_requirements=["engine-factory", "torch"], registered_model_name=model_name,
            )
    version = str(info.registered_model_version)
    if tags:
        client = mlflow.tracking.MlflowClient(tracking_uri=tracking_uri)
        for key, value in tags.items():
            client.set_model_version_tag(model_name, version, key, value)
    return version
