"""Where a run's evidence is in the MLflow UI: URLs of a run, its lineage page and a model version.

MLflow 3.17's UI opens every experiment on its GenAI overview (traces, an assistant) unless the page
is asked for the classic view: it reads the kind of an experiment from its `workflowType` (the URL's
`?workflowType=machine_learning`, else the last one picked in the UI, default `genai`), not from the
experiment's `mlflow.experimentKind` tag, which older 3.x UIs read. So the experiment is tagged
(`EXPERIMENT_KIND`, for the UIs that read it) and every URL printed here carries the query as well.

A store that is not a server (SQLite, the default) has no UI of its own: the URLs then point at
`mlflow ui` on 127.0.0.1:5000, and `ui_hint` says how to start it.
"""
from __future__ import annotations

from urllib.parse import quote

KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"  # "Machine learning" in the UI: runs, not traces
VIEW = "workflowType=machine_learning"
DEFAULT_UI = "http://127.0.0.1:5000"


def ui_base(tracking_uri: str) -> str:
    """The UI's address: the tracking server itself, or `mlflow ui`'s default for a local store."""
    return tracking_uri.rstrip("/") if tracking_uri.startswith(("http://", "https://")) else DEFAULT_UI


def ui_hint(tracking_uri: str) -> str | None:
    """How to start a UI for a store that has none (None: the tracking server is the UI)."""
    if tracking_uri.startswith(("http://", "https://")):
        return None
    return f"mlflow ui --backend-store-uri {tracking_uri} --host 127.0.0.1 --port 5000"


def run_path(experiment_id: str, run_id: str) -> str:
    """The UI route of a run, relative to the UI (a Markdown link in a run's description)."""
    return f"#/experiments/{experiment_id}/runs/{run_id}?{VIEW}"


def artifact_path(experiment_id: str, run_id: str, artifact: str) -> str:
    """The UI route of one artifact of a run (the UI renders HTML artifacts in place)."""
    return f"#/experiments/{experiment_id}/runs/{run_id}/artifacts/{artifact}?{VIEW}"


def model_version_path(name: str, version: str) -> str:
    return f"#/models/{quote(name, safe='')}/versions/{version}?{VIEW}"


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    return f"{ui_base(tracking_uri)}/{run_path(experiment_id, run_id)}"


def artifact_url(tracking_uri: str, experiment_id: str, run_id: str, artifact: str) -> str:
    return f"{ui_base(tracking_uri)}/{artifact_path(experiment_id, run_id, artifact)}"


def model_version_url(tracking_uri: str, name: str, version: str) -> str:
    return f"{ui_base(tracking_uri)}/{model_version_path(name, version)}"


def mlflow_lines(tracking_uri: str, url: str | None, pending: int, run_dir) -> list[str]:
    """What a finished run (and `evo report`) prints about MLflow: the parent run's URL, and how to open it."""
    if url is None:
        return [f"MLflow run: not in {tracking_uri} yet ({pending} operations pending); "
                f"send them with `python -m evo mlflow-sync {run_dir}`"]
    lines = [f"MLflow run: {url}"]
    hint = ui_hint(tracking_uri)
    if hint:
        lines.append(f"  (start the UI first: {hint})")
    return lines
