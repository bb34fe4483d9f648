"""MLflow's client loaded in the background while Ray and the evaluators start.

Loading MLflow's database stores takes seconds (their imports, and for a new SQLite file the schema's
migrations: ~10 s on a 2-core machine), while starting Ray and the evaluators is mostly waiting on other
processes. `warm(uri)` does the first part on a thread meanwhile; MLflow caches the store per URI (and
builds it under a lock), so the run's own client later finds it ready. Failures are left for the run's
own client to meet (and report): a down server is the outbox's business, not this thread's.
"""
from __future__ import annotations

import logging
import threading

log = logging.getLogger("evo.mlflow")

_DATABASES = ("sqlite:", "postgresql", "mysql", "mssql")


def warm(uri: str) -> threading.Thread:
    """Start loading the tracking and registry stores for `uri` on a daemon thread; returns the thread."""

    def load() -> None:
        try:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=uri, registry_uri=uri)
            if uri.startswith(_DATABASES):  # local calls: they build the stores (and create or upgrade the schema)
                client.search_experiments(max_results=1)
                client.search_registered_models(max_results=1)
        except Exception as exc:  # noqa: BLE001 - the run's own client meets it again, and says so
            log.debug("warming MLflow for %s: %s", uri, exc)

    thread = threading.Thread(target=load, name="mlflow-warm", daemon=True)
    thread.start()
    return thread
