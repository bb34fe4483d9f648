"""Register a search's best engine in MLflow as a model that describes itself, linked to the search's run.

A version is logged under the search's parent run as a pyfunc model whose loader module is
`evo.evidence.mlflow.pyfunc_engine` (nothing pickled): its `engine/` folder holds `engine.json`
(workload, preset, genome, and what the search measured) and `genome.json`. It carries
  - a signature: the workload's request schema as MLflow tensor specs (-1 for a free axis such as B
    or T), and the outputs read off the workload's output shapes, with a small input example;
  - tags: genome hash, latency and its spread, speedup over each baseline with its paired 95%
    interval, device, workload, preset, the run (`evo.evidence.mlflow.describe.version_tags`);
  - a description in Markdown.
The alias `champion` moves to a new version only when it is faster: its `latency_ms` tag is lower than
the current champion's (a champion without that tag, registered by an older version, is replaced).
Both latencies are single medians from separate runs; `python -m evo ab` compares two engines paired.

`mlflow.pyfunc.load_model("models:/NAME@champion")` rebuilds the engine on CPU; the Serve app reads
`engine.json` from the model and builds and verifies the engine itself.
"""
from __future__ import annotations

import json
import logging
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from evo.evidence.engine_record import ENGINE_FILE, EngineRecord, record_from_summary
from evo.evidence.mlflow.describe import version_description, version_tags
from evo.evidence.summary import Summary
from evo.workloads.base import CheckCase, Preset, Workload

CHAMPION = "champion"
LATENCY_TAG = "latency_ms"
log = logging.getLogger("evo.mlflow")


@dataclass(frozen=True)
class Registration:
    """A registered version and what became of the alias."""

    uri: str  # models:/NAME/VERSION
    name: str
    version: str
    champion: bool  # whether the alias now points at this version
    previous: tuple[str, float] | None  # the champion before (version, latency in ms), if any

    def describe(self) -> str:
        if self.champion and self.previous:
            return (f"alias @{CHAMPION} moved to version {self.version} (faster than version {self.previous[0]}: "
                    f"{self.previous[1]:.3f} ms)")
        if self.champion:
            return f"alias @{CHAMPION} set to version {self.version} (the first champion)"
        if self.previous is None:
            return f"alias @{CHAMPION} not set: this version has no measured latency"
        return f"alias @{CHAMPION} stays on version {self.previous[0]} ({self.previous[1]:.3f} ms: this one is not faster)"


def _numpy_dtype(name: str) -> np.dtype:
    """What a numpy caller sends for a tensor of dtype `name` (numpy has no bfloat16: float32, cast by the engine)."""
    return np.dtype("float32" if name == "bfloat16" else name)


def engine_signature(workload: Workload, preset: Preset):
    """The model signature: every input of the workload's request schema (optional ones too: MLflow's
    tensor specs cannot be optional), free axes as -1; outputs from `output_shapes` when declared."""
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    specs = workload.request_specs(preset)
    inputs = Schema([TensorSpec(_numpy_dtype(s.dtypes[0]), tuple(-1 if isinstance(d, str) else int(d) for d in s.shape),
                                s.name) for s in specs])
    free = {d for s in specs for d in s.shape if isinstance(d, str)}
    like = workload.timing_case(preset)
    at = workload.output_shapes(CheckCase("signature", dict(preset.shape), like.distribution, like.with_initial_state))
    moved = workload.output_shapes(CheckCase("signature", {k: v + (k in free) for k, v in preset.shape.items()},
                                             like.distribution, like.with_initial_state))
    if not at or not moved:
        return ModelSignature(inputs=inputs)
    outputs = Schema([TensorSpec(np.dtype("float32"), tuple(-1 if a != b else a for a, b in zip(at[name], moved[name])), name)
                      for name in at])  # predict returns float32
    return ModelSignature(inputs=inputs, outputs=outputs)


MAX_EXAMPLE_VALUES = 1_000_000  # an example is stored as JSON with the model: a large preset's is left out


def input_example(workload: Workload, preset: Preset, seed: int = 0) -> dict[str, np.ndarray] | None:
    """One request at the smallest verified size of each free axis, every input present (as the signature asks);
    None when even that is over MAX_EXAMPLE_VALUES values (MLflow then notes that the example is missing)."""
    specs = workload.request_specs(preset)
    free = {d for s in specs for d in s.shape if isinstance(d, str)}
    axes = {axis: lo for axis, (lo, _) in workload.domain(preset).axis_bounds().items() if axis in free}
    example = workload.example_request(preset, seed, **axes)
    missing = [s.name for s in specs if s.name not in example]
    if missing:  # an optional input the example leaves out: zeros of its shape
        sizes = {**preset.shape, **axes}
        for spec in (s for s in specs if s.name in missing):
            example[spec.name] = np.zeros([sizes[d] if isinstance(d, str) else d for d in spec.shape],
                                          _numpy_dtype(spec.dtypes[0]))
    example = {name: _as_numpy(value) for name, value in example.items() if name in {s.name for s in specs}}
    return example if sum(a.size for a in example.values()) <= MAX_EXAMPLE_VALUES else None


def _as_numpy(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    return value.float().numpy() if str(value.dtype) == "torch.bfloat16" else value.numpy()


def register_engine(record: EngineRecord, run_id: str, model_name: str, tracking_uri: str,
                    tags: dict[str, str] | None = None, description: str | None = None) -> str:
    """Log the engine as a model of run `run_id` and register it as `model_name`; returns its version.
    `tags` and `description` go on the model version."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from evo.workloads import get_workload

    workload = get_workload(record.workload)
    preset = workload.presets()[record.preset]
    try:
        signature, example = engine_signature(workload, preset), input_example(workload, preset)
    except NotImplementedError:  # a workload without a request schema: it cannot be served, and has no signature
        signature, example = None, None
    mlflow.set_tracking_uri(tracking_uri)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "engine"
        folder.mkdir()
        (folder / ENGINE_FILE).write_text(json.dumps(record.to_dict(), indent=2, sort_keys=True))
        (folder / "genome.json").write_text(json.dumps(record.genome.to_dict(), indent=2, sort_keys=True))
        with mlflow.start_run(run_id=run_id):
            info = mlflow.pyfunc.log_model(
                name="engine", loader_module="evo.evidence.mlflow.pyfunc_engine", data_path=str(folder),
                signature=signature, input_example=example,
                pip_requirements=["engine-factory", "torch"], registered_model_name=model_name,
            )
    version = str(info.registered_model_version)
    client = MlflowClient(tracking_uri=tracking_uri)
    for key, value in (tags or {}).items():
        client.set_model_version_tag(model_name, version, key, value)
    if description:
        client.update_model_version(model_name, version, description=description)
    return version


def promote(client, name: str, version: str, latency_ms: float) -> Registration:
    """Point `champion` at `version` if there is no champion yet or this version is faster (see the module)."""
    from mlflow.exceptions import MlflowException

    version, previous = str(version), None
    try:
        current = client.get_model_version_by_alias(name, CHAMPION)
        recorded = float(current.tags.get(LATENCY_TAG, "nan"))
        previous = (str(current.version), recorded)
    except MlflowException:  # no champion yet
        pass
    faster = previous is None or not math.isfinite(previous[1]) or latency_ms < previous[1]
    if faster and math.isfinite(latency_ms):
        client.set_registered_model_alias(name, CHAMPION, version)
    return Registration(f"models:/{name}/{version}", name, version, faster and math.isfinite(latency_ms), previous)


def register_best(summary: Summary, run_dir: Path, run_id: str, model_name: str, tracking_uri: str,
                  experiment_id: str | None = None) -> Registration:
    """Register the best engine of `summary` (a version with signature, tags and description, under run
    `run_id`) and move the alias when it is the fastest."""
    from mlflow.tracking import MlflowClient

    tags = version_tags(summary, run_id, run_dir)
    description = version_description(summary, Path(run_dir).name, experiment_id, run_id)
    version = register_engine(record_from_summary(summary, str(run_dir)), run_id, model_name, tracking_uri, tags,
                              description)
    client = MlflowClient(tracking_uri=tracking_uri)
    client.update_registered_model(model_name, description=(
        f"Engines for {summary.workload} at preset `{summary.preset}`, one version per search that registered its best. "
        f"`@{CHAMPION}` is the fastest by recorded latency (moved only when a new version is faster); "
        f"serve it with `python -m evo serve models:/{model_name}@{CHAMPION}`."))
    return promote(client, model_name, version, summary.best_latency_ms)


def __getattr__(name: str):
    """`EnginePyfunc`, the pickled class of versions registered before the loader module, loads on demand."""
    if name == "EnginePyfunc":
        from evo.evidence.mlflow.legacy_pyfunc import EnginePyfunc

        return EnginePyfunc
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
