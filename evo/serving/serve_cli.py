"""`python -m evo serve RUN`: start or join Ray, deploy the engine app, serve until interrupted."""
from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import ray
from ray import serve

from evo.driver import local_ray
from evo.serving.app import build_app
from evo.serving.source import SourceError, resolve


def serve_forever(engine: str, host: str, port: int, name: str, max_batch_size: int,
                  tracking_uri: str | None) -> int:
    # A relative run directory must mean the same thing to the replicas as to this shell.
    if Path(engine).expanduser().is_dir():
        engine = str(Path(engine).expanduser().resolve())
    try:
        record = resolve(engine, tracking_uri)
    except SourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    own_ray = not ray.is_initialized()
    if own_ray:
        address = os.environ.get("RAY_ADDRESS")
        if address:
            local_ray.join(address, log_to_driver=False)
        else:  # listening on 127.0.0.1 only (evo.driver.local_ray)
            local_ray.init_local(include_dashboard=False, log_to_driver=False)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        app = build_app({"engine": engine, "max_batch_size": max_batch_size, "tracking_uri": tracking_uri})
        serve.run(app, name=name, route_prefix="/")
        print(f"serving engine {record.genome.hash} ({record.workload}/{record.preset}) at http://{host}:{port}"
              f"  (POST /v1/infer, GET /v1/engine, GET /healthz); Ctrl-C stops", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        if own_ray:
            ray.shutdown()
    return 0
