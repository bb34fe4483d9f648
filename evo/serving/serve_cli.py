"""`python -m evo serve RUN`: check the port, start or join Ray, deploy the engine app, print how to call
it, serve until interrupted. Ray is imported only once the port is known to be free."""
from __future__ import annotations

import errno
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from evo.serving.source import SourceError, resolve


def port_problem(host: str, port: int) -> str | None:
    """Why `host:port` cannot be served on (in use, not an address of this machine), or None."""
    if not 0 < port < 65536:
        return f"--port {port} is not a TCP port; give 1..65535"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"--host {host!r} does not resolve ({exc.strerror}); give an address such as 127.0.0.1"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Serve's proxy binds: TIME_WAIT is free
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (f"port {port} on {host} is already in use (another `evo serve` or server?); stop it, "
                        f"or pick another with --port")
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def serve_forever(engine: str, host: str, port: int, name: str, max_batch_size: int,
                  tracking_uri: str | None, sandbox: str = "strict", rescore_fraction: float = 0.05) -> int:
    problem = port_problem(host, port)  # before Ray starts: a busy port is one line, not a traceback
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    # A relative run directory must mean the same thing to the replicas as to this shell.
    if Path(engine).expanduser().is_dir():
        engine = str(Path(engine).expanduser().resolve())
    try:
        record = resolve(engine, tracking_uri)
    except SourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import ray
    from ray import serve

    from evo.driver import local_ray
    from evo.serving.app import build_app

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
        app = build_app({"engine": engine, "max_batch_size": max_batch_size, "tracking_uri": tracking_uri,
                         "sandbox": sandbox, "rescore_fraction": rescore_fraction})
        serve.run(app, name=name, route_prefix="/")
        url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
        print(f"serving engine {record.genome.hash} ({record.workload}/{record.preset}) at {url}"
              f"  (POST /v1/infer, GET /v1/engine, GET /healthz); Ctrl-C stops", flush=True)
        print(f"try it:\n  {curl_for(record.workload, record.preset, url)}", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        if own_ray:
            ray.shutdown()
    return 0


def curl_for(workload_name: str, preset_name: str, url: str) -> str:
    """The `curl` of the smallest request the engine of `workload_name`/`preset_name` accepts at `url`."""
    from evo.serving.app import request_schema
    from evo.serving.example import example_curl
    from evo.workloads import get_workload

    workload = get_workload(workload_name)
    specs, axes = request_schema(workload, workload.presets()[preset_name])
    return example_curl(url, specs, axes)
