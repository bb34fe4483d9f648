"""Where a served engine comes from: a run directory, an MLflow run id, a registered model, or a default.

Every source resolves to an `EngineRecord`: the genome, the workload and preset it was searched for,
and what the search measured (latency, speedups, device, MLflow lineage run id).

Accepted forms:
  runs/<name>-20261130-094905      a run directory (holds summary.json and best_genome.json)
  models:/<name>-engine/3          a registered MLflow model version (or models:/NAME/latest)
  models:/<name>-engine@champion   the version an alias points at (`champion`: the last to win a paired
                                   race against the one before, see evo.evidence.mlflow.registry)
  models:/<name>-engine@champion-budget  the lossy (budget-mode) engine that holds its own alias under an
                                   exact champion (a lossy engine never takes `champion` from an exact one)
  runs:/<run_id>  or  <run_id>     an MLflow run whose artifacts hold the engine (the search's parent run)
  default:WORKLOAD/PRESET          the workload's default genome for that preset (no search needed)
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from evo.evidence.engine_record import ENGINE_FILE, EngineRecord, SourceError, record_from_summary
from evo.evidence.summary import SUMMARY_FILE, Summary


def resolve(source: str, tracking_uri: str | None = None) -> EngineRecord:
    """The engine named by `source` (see the module docstring for the accepted forms)."""
    if not isinstance(source, str) or not source.strip():
        raise SourceError(f"engine source must be a non-empty string, got {source!r}")
    source = source.strip()
    if source.startswith("default:"):
        return _default(source)
    if source.startswith("models:/") or source.startswith("runs:/") or re.fullmatch(r"[0-9a-f]{32}", source):
        return _from_mlflow(source, tracking_uri)
    path = Path(source).expanduser()
    if path.is_dir():
        summary = path / SUMMARY_FILE
        if not summary.is_file():
            raise SourceError(f"run directory {str(path)!r} has no {SUMMARY_FILE} (did the search finish?)")
        return record_from_summary(Summary.read(summary), str(path.resolve()))
    raise SourceError(f"engine source {source!r} is not a run directory, 'models:/NAME/VERSION', 'models:/NAME@ALIAS', "
                      f"'runs:/RUN_ID', an MLflow run id or 'default:WORKLOAD/PRESET'")


def _default(source: str) -> EngineRecord:
    from evo.workloads import get_workload
    from evo.workloads.base import DeviceInfo

    workload_name, _, preset_name = source.removeprefix("default:").partition("/")
    try:
        workload = get_workload(workload_name)
    except ValueError as exc:
        raise SourceError(f"{source}: {exc}") from exc
    presets = workload.presets()
    if preset_name not in presets:
        raise SourceError(f"{source}: unknown preset {preset_name!r}; available: {sorted(presets)}")
    preset = presets[preset_name]
    genome = workload.gene_space(preset, DeviceInfo(preset.device, preset.device, 1)).default()
    return EngineRecord(workload_name, preset_name, genome, source)


def _from_mlflow(source: str, tracking_uri: str | None) -> EngineRecord:
    import mlflow
    from mlflow.exceptions import MlflowException

    from evo.evidence.mlflow.outbox import tracking_uri as default_uri

    uri = default_uri(tracking_uri)
    if re.fullmatch(r"[0-9a-f]{32}", source):
        source = f"runs:/{source}"
    # A run holds summary.json; a registered model holds engine.json among its artifacts.
    artifact = f"{source.rstrip('/')}/{SUMMARY_FILE}" if source.startswith("runs:/") else source
    with tempfile.TemporaryDirectory() as tmp, _no_progress_bar():
        try:
            if artifact.startswith("models:/"):
                artifact = _model_version_artifacts(artifact, uri)
            local = Path(mlflow.artifacts.download_artifacts(artifact_uri=artifact, dst_path=tmp, tracking_uri=uri,
                                                             registry_uri=uri))
        except (MlflowException, OSError) as exc:
            raise SourceError(f"could not load {artifact!r} from MLflow at {uri}: {exc}") from exc
        if local.is_dir():
            found = sorted(local.rglob(ENGINE_FILE))
            if not found:
                raise SourceError(f"{source} has no {ENGINE_FILE}: it is not a model registered by this project")
            local = found[0]
        data = json.loads(local.read_text())
    if source.startswith("runs:/"):
        return record_from_summary(Summary.from_dict(data), source)
    return EngineRecord.from_dict(data, source)


def _model_version_artifacts(source: str, uri: str) -> str:
    """Where the artifacts of `models:/NAME/VERSION`, `models:/NAME/latest` or `models:/NAME@ALIAS` live in the
    store at `uri`. Resolved here because MLflow resolves `models:/` against the process-wide registry URI,
    not the one passed to `download_artifacts` (another store set earlier in the process wins)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    name_and_version = source.removeprefix("models:/").rstrip("/")
    if "@" in name_and_version:
        name, alias = name_and_version.split("@", 1)
        version = client.get_model_version_by_alias(name, alias).version
    else:
        name, _, version = name_and_version.rpartition("/")
        if not name or not version:
            raise MlflowException(f"{source!r} names no version: use models:/NAME/VERSION, models:/NAME/latest "
                                  f"or models:/NAME@ALIAS")
        if version == "latest":
            versions = client.search_model_versions(f"name='{name}'")
            if not versions:
                raise MlflowException(f"registered model {name!r} has no versions")
            version = max(int(v.version) for v in versions)
    return client.get_model_version_download_uri(name, str(version))


@contextmanager
def _no_progress_bar() -> Iterator[None]:
    """MLflow draws a progress bar per download (a handful of small files here): not on `evo serve`'s output."""
    key = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    saved = os.environ.get(key)
    os.environ[key] = "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved
