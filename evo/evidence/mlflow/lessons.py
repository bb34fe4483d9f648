"""Lessons of an earlier run, found by what a user names: a run directory, a lessons file, or an MLflow
experiment whose newest finished parent run logged them (the MLflow half of `evo.core.lessons`)."""
from __future__ import annotations

import tempfile
from pathlib import Path

from evo.core.lessons import FILE, Lessons, LessonsError, read


def load(source: str, tracking_uri: str | None = None) -> Lessons:
    """Lessons from a run directory, a lessons file, or the newest MLflow run of an experiment that logged them."""
    path = Path(source)
    if path.is_dir():
        if not (path / FILE).exists():
            raise LessonsError(f"{path} has no {FILE}: it is not a finished run directory of this version "
                               f"(runs write {FILE} when they end); pass another run directory or an experiment")
        return read(path / FILE)
    if path.is_file():
        return read(path)
    return _from_mlflow(source, tracking_uri)


def _from_mlflow(experiment: str, tracking_uri: str | None) -> Lessons:
    from mlflow.tracking import MlflowClient

    from evo.evidence.mlflow.outbox import tracking_uri as default_uri

    client = MlflowClient(tracking_uri=default_uri(tracking_uri))
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise LessonsError(f"--warm-start {experiment!r} is neither a run directory, a lessons file nor an MLflow "
                           f"experiment in {default_uri(tracking_uri)}")
    runs = client.search_runs([found.experiment_id], filter_string="attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time DESC"], max_results=50)
    for run in runs:
        if run.data.tags.get("mlflow.parentRunId"):
            continue
        try:
            with tempfile.TemporaryDirectory() as tmp:
                return read(Path(client.download_artifacts(run.info.run_id, FILE, tmp)))
        except Exception:  # this run logged no lessons: try the next older one
            continue
    raise LessonsError(f"no finished run of MLflow experiment {experiment!r} has logged {FILE}")
