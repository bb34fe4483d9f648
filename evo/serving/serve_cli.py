"""`python -m evo serve RUN`: check the port and the batch size, start or join Ray, deploy the engine app,
print how to call it (or, when the deployment fails, its cause in one line), serve until interrupted.
Ray is imported only once the port and the engine are known to be good."""
from __future__ import annotations

import errno
import logging
import os
import re
import signal
import socket
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from evo.evidence.engine_record import EngineRecord
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


def batch_size(record: EngineRecord, requested: int | None) -> int:
    """`--max-batch-size`: by default the largest batch (B) engines of the record's workload and preset are
    verified at; ValueError naming that bound for one outside 1..bound."""
    from evo.workloads import get_workload

    workload = get_workload(record.workload)
    bound = workload.verified_batch(workload.presets()[record.preset])
    if requested is None:
        return bound
    if not 1 <= requested <= bound:
        where = f"above B={bound}, the largest batch" if requested > bound else "below 1, the smallest batch"
        raise ValueError(f"--max-batch-size {requested} is {where} engines of {record.workload}/{record.preset} are "
                         f"verified at; give 1..{bound}, or leave it out (default: {bound})")
    return requested


def serve_forever(engine: str, host: str, port: int, name: str, max_batch_size: int | None,
                  tracking_uri: str | None, sandbox: str = "strict", rescore_fraction: float = 0.05,
                  verify: str = "sampled") -> int:
    """Serve `engine` until interrupted; the exit status. `verify` (generation engines): "sampled" or "all"
    (every token checked against the reference before it is released; docs/serving.md)."""
    problem = port_problem(host, port)  # before Ray starts: a busy port is one line, not a traceback
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    # A relative run directory must mean the same thing to the replicas as to this shell.
    if Path(engine).expanduser().is_dir():
        engine = str(Path(engine).expanduser().resolve())
    try:
        record = resolve(engine, tracking_uri)
        generation = _generates(record)
        max_batch_size = None if generation else batch_size(record, max_batch_size)
    except (SourceError, ValueError) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
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
                         "sandbox": sandbox, "rescore_fraction": rescore_fraction, "verify": verify})
        failure = _deploy(app, name, stop)  # building and verifying the engine takes a while: Ctrl-C still stops
        if failure is not None:
            print(f"error: {failure}", file=sys.stderr, flush=True)
            return 1
        if not stop.is_set():
            url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
            claim = record.claim()  # the claim before the numbers: the paired speedup with its interval
            if generation:
                from evo.serving.generation import snippet

                routes = "the OpenAI API: POST /v1/completions, POST /v1/chat/completions, GET /v1/models"
                try_it = snippet(record, url)
            else:
                routes, try_it = f"POST /v1/infer; max_batch_size {max_batch_size}", curl_for(record.workload,
                                                                                              record.preset, url)
            print(f"serving engine {record.genome.hash} ({record.workload}/{record.preset}"
                  f"{'; ' + claim['text'] if claim else ''}) at {url}  ({routes}; GET /v1/engine, GET /healthz);"
                  f" Ctrl-C stops", flush=True)
            print(f"try it:\n  {try_it}", flush=True)
            stop.wait()
    finally:
        _stop_serving(name, disconnect=own_ray)
    return 0


def _generates(record: EngineRecord) -> bool:
    """Whether the record's workload is of the generation contract (served by the OpenAI routes)."""
    from evo.workloads import get_workload

    return get_workload(record.workload).contract == "generation"


def _deploy(app: Any, name: str, stop: threading.Event) -> str | None:
    """Deploy `app` as `name` and wait until it runs, or fails, or `stop` is set. None, or the deployment's
    cause in one line (Serve's own exception says only "Deploying application ... failed")."""
    from ray import serve

    done, failed = threading.Event(), []

    def run() -> None:
        try:  # Serve's INFO lines here ("New http_options ... will not be applied") are not the user's business
            with _quiet("ray.serve"):
                serve.run(app, name=name, route_prefix="/")
        except Exception as exc:  # DEPLOY_FAILED (RuntimeError), a lost controller: reported below
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="evo-serve-deploy", daemon=True).start()
    while not (done.is_set() or stop.is_set()):
        done.wait(0.25)
    if not failed:
        return None
    try:
        status = serve.status()
    except Exception:  # the controller itself is gone: Serve's exception is all there is
        status = None
    return deployment_error(status, name, failed[0])


def deployment_error(status: Any, name: str, exc: BaseException) -> str:
    """Why application `name` failed to deploy, as one line: the last exception of the replica's error
    (the deployment's message in `serve.status()`; Serve keeps its traceback there), else the application's
    message, else `exc`."""
    app = getattr(status, "applications", {}).get(name)
    messages = [d.message for d in getattr(app, "deployments", {}).values() if getattr(d, "message", "")]
    messages += [app.message] if app is not None and app.message else []
    for message in messages:
        cause = _last_exception(message)
        if cause:
            return f"application {name!r} failed to deploy: {cause}"
    return f"application {name!r} failed to deploy: {_one_line(exc)}"


_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Z]\w*): (.*)$")  # "evo.serving.app.EngineRejected: ..."


def _last_exception(message: str) -> str | None:
    """'EngineRejected: engine ... failed its verification ...' from a traceback: its last exception line (module
    path dropped) with the lines that continue it, in one line; None when the text holds no exception line."""
    lines = message.splitlines()
    starts = [i for i, line in enumerate(lines) if _EXCEPTION_LINE.match(line)]
    if not starts:
        return None
    kind, text = _EXCEPTION_LINE.match(lines[starts[-1]]).groups()
    return _one_line(f"{kind}: {' '.join([text, *lines[starts[-1] + 1:]])}")[:1000]


def _stop_serving(name: str, disconnect: bool) -> None:
    """Delete the application, then leave Ray. Not `serve.shutdown()`: the controller kills itself at the
    end of its graceful shutdown, and Ray then prints a warning that it will retry that call (once per
    Ctrl-C); and on a joined cluster it would take down every other application too. A local Ray ends
    with this process anyway, its controller and proxy with it."""
    import ray
    from ray import serve

    try:
        if ray.is_initialized():
            with _quiet("ray.serve"):
                serve.delete(name)
    except Exception:  # never deployed, or Ray already going down: nothing to delete
        pass
    if disconnect:
        ray.shutdown()


@contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Warnings only from `logger_name` meanwhile (Serve logs each step of a deletion at INFO)."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _one_line(exc: BaseException | str) -> str:
    return " ".join(str(exc).split())


def curl_for(workload_name: str, preset_name: str, url: str) -> str:
    """The `curl` of the smallest request the engine of `workload_name`/`preset_name` accepts at `url`."""
    from evo.serving.app import request_schema
    from evo.serving.example import example_curl
    from evo.workloads import get_workload

    workload = get_workload(workload_name)
    specs, axes = request_schema(workload, workload.presets()[preset_name])
    return example_curl(url, specs, axes)
