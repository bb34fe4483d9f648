"""Ray Serve application that serves one engine over HTTP, verified before it answers, hot-swappable.

    POST /v1/infer   {"inputs": {name: tensor}, "encoding": "data"|"b64"} -> {"outputs": {name: tensor}}
    GET  /v1/engine  workload, preset, genome, hash, measured latency, speedups, device, MLflow run id
    GET  /healthz    200 when an engine is loaded and verified

The engine is named by `user_config.engine` (any source `evo.serving.source.resolve` accepts). Each
replica builds it on its own device and checks it against the float64 reference on fresh inputs
before it reports ready; a replica whose engine fails that check never becomes ready.
`reconfigure` (a new user_config) builds and verifies the new engine off the request path and
swaps it in only if it passes; otherwise the old engine keeps serving and the failure is reported
under "last_swap" in /v1/engine. Requests are batched with `@serve.batch`: requests with the same
sequence length and tensor names run as one engine call, concatenated along the batch axis.
"""
# No `from __future__ import annotations` here: FastAPI must see real types (Request) on the routes.

import asyncio
import logging
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve

from evaluators.check import SeedStream, check_engine
from evaluators.settings import EvaluatorSettings
from evo.serving.codec import ENCODINGS, RequestError, decode_request, encode_outputs, kda_input_specs, parse_body
from evo.serving.source import EngineRecord, resolve
from evo.workloads import get_workload
from evo.workloads.base import DeviceInfo

logger = logging.getLogger("ray.serve")

USER_CONFIG_DEFAULTS: dict[str, Any] = {
    "engine": None,  # required: run directory, models:/NAME/VERSION, runs:/RUN_ID or default:WORKLOAD/PRESET
    "tracking_uri": None,  # MLflow store for models:/ and runs:/ sources; default $MLFLOW_TRACKING_URI or ./mlflow.db
    "max_request_bytes": 64 * 1024 * 1024,  # larger bodies get 413
    "max_batch_size": 8,  # requests merged into one engine call
    "batch_wait_timeout_s": 0.005,  # how long a batch waits to fill
}
INPUT_SPECS = {"kda": kda_input_specs}


class EngineRejected(RuntimeError):
    """The engine failed to build or failed its correctness check; it will not serve."""


@dataclass(frozen=True)
class LoadedEngine:
    record: EngineRecord
    engine: Any
    specs: tuple
    device: str
    check_message: str
    max_rel_error: float
    loaded_at: float


def load_engine(source: str, tracking_uri: str | None = None) -> LoadedEngine:
    """Resolve, build and verify an engine on this process's device; raise EngineRejected if it fails."""
    record = resolve(source, tracking_uri)
    workload = get_workload(record.workload)
    preset = workload.presets()[record.preset]
    device = "cuda" if preset.device == "cuda" and torch.cuda.is_available() else "cpu"
    if preset.device == "cuda" and device != "cuda":
        raise EngineRejected(f"engine {record.genome.hash} is for the cuda preset {preset.name!r}; this replica has no GPU")
    info = DeviceInfo(device, torch.cuda.get_device_name(0) if device == "cuda" else "cpu", torch.get_num_threads())
    if record.workload not in INPUT_SPECS:
        raise EngineRejected(f"no HTTP input schema for workload {record.workload!r}; known: {sorted(INPUT_SPECS)}")
    try:
        engine = workload.build(record.genome, preset, info)
        settings = EvaluatorSettings()
        with torch.no_grad():
            report = check_engine(engine, workload, preset, workload.check_cases(preset),
                                  SeedStream(secrets.randbits(63), "serve"), device=device,
                                  tolerance=settings.tolerance(preset.dtype),
                                  elementwise_factor=settings.elementwise_factor)
    except Exception as exc:
        raise EngineRejected(f"engine {record.genome.hash} from {source}: {type(exc).__name__}: {exc}") from exc
    if not report.passed:
        raise EngineRejected(f"engine {record.genome.hash} from {source} failed its check: {report.message}")
    return LoadedEngine(record, engine, INPUT_SPECS[record.workload](preset), device, report.message,
                        report.max_rel_error, time.time())


def _run_grouped(loaded: LoadedEngine, requests: list[dict[str, torch.Tensor]]) -> tuple[list[dict], int]:
    """Requests with equal sequence length and tensor names become one engine call along axis 0.
    Returns each request's outputs and the number of engine calls made."""
    results: list[dict[str, torch.Tensor] | None] = [None] * len(requests)
    groups: dict[tuple, list[int]] = {}
    for i, inputs in enumerate(requests):
        key = (tuple(sorted(inputs)), tuple(inputs["q"].shape[1:]) if "q" in inputs else i)
        groups.setdefault(key, []).append(i)
    with torch.no_grad():
        for members in groups.values():
            sizes = [requests[i][next(iter(requests[i]))].shape[0] for i in members]
            merged = {name: torch.cat([requests[i][name] for i in members]) for name in requests[members[0]]}
            outputs = loaded.engine(**{k: v.to(loaded.device) for k, v in merged.items()})
            split = {name: torch.split(t.cpu(), sizes) for name, t in outputs.items()}
            for j, i in enumerate(members):
                results[i] = {name: parts[j].clone() for name, parts in split.items()}
    return results, len(groups)


api = FastAPI(title="engine-factory", description="Serves the best engine a search found.")


@serve.deployment(name="EngineServer", max_ongoing_requests=32, ray_actor_options={"num_cpus": 1})
@serve.ingress(api)
class EngineServer:
    def __init__(self, engine: str | None = None, **options: Any) -> None:
        self.config = dict(USER_CONFIG_DEFAULTS)
        self.loaded: LoadedEngine | None = None
        self.last_swap: dict[str, Any] | None = None
        self.stats = {"requests": 0, "batches": 0, "engine_calls": 0}
        if engine is not None:  # plain `serve.run(EngineServer.bind(engine=...))` without user_config
            self._apply_options(options)
            self.loaded = load_engine(engine, self.config["tracking_uri"])
            self.config["engine"] = engine

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        unknown = sorted(set(user_config) - set(USER_CONFIG_DEFAULTS))
        if unknown:
            raise ValueError(f"unknown user_config keys {unknown}; allowed: {sorted(USER_CONFIG_DEFAULTS)}")
        if not user_config.get("engine"):
            raise ValueError("user_config needs 'engine': a run directory, models:/NAME/VERSION, runs:/RUN_ID "
                             "or default:WORKLOAD/PRESET")
        self._apply_options(user_config)
        source = user_config["engine"]
        if self.loaded is not None and source == self.config["engine"]:
            return
        started = time.time()
        try:  # build and verify off the event loop: requests keep being served meanwhile
            candidate = await asyncio.to_thread(load_engine, source, self.config["tracking_uri"])
        except Exception as exc:
            if self.loaded is None:
                raise  # nothing to fall back on: the replica must not become ready
            self.last_swap = {"source": source, "ok": False, "error": str(exc), "at": started,
                              "kept": self.loaded.record.genome.hash}
            logger.error("engine swap to %s refused, keeping %s: %s", source, self.loaded.record.genome.hash, exc)
            return
        previous = self.loaded.record.genome.hash if self.loaded else None
        self.loaded = candidate  # one reference assignment: in-flight batches finish on the old engine
        self.config["engine"] = source
        self.last_swap = {"source": source, "ok": True, "from": previous, "to": candidate.record.genome.hash,
                          "at": started, "seconds": time.time() - started}

    def _apply_options(self, options: dict[str, Any]) -> None:
        for key in ("tracking_uri", "max_request_bytes", "max_batch_size", "batch_wait_timeout_s"):
            if key in options and options[key] is not None:
                self.config[key] = options[key]
        if not isinstance(self.config["max_request_bytes"], int) or self.config["max_request_bytes"] < 1:
            raise ValueError(f"max_request_bytes must be a positive int, got {self.config['max_request_bytes']!r}")
        self._run_batch.set_max_batch_size(int(self.config["max_batch_size"]))
        self._run_batch.set_batch_wait_timeout_s(float(self.config["batch_wait_timeout_s"]))

    def check_health(self) -> None:
        if self.loaded is None:
            raise RuntimeError("no verified engine loaded")

    @api.get("/healthz")
    async def healthz(self) -> JSONResponse:
        if self.loaded is None:
            return JSONResponse({"status": "no engine"}, status_code=503)
        return JSONResponse({"status": "ok", "hash": self.loaded.record.genome.hash})

    @api.get("/v1/engine")
    async def engine_info(self) -> JSONResponse:
        if self.loaded is None:
            return JSONResponse({"error": {"field": "engine", "message": "no engine loaded", "status": 503}}, 503)
        record = self.loaded.record
        return JSONResponse({
            **record.to_dict(),
            "serving_device": self.loaded.device,
            "verification": {"message": self.loaded.check_message, "max_rel_error": self.loaded.max_rel_error},
            "loaded_at": self.loaded.loaded_at,
            "last_swap": self.last_swap,
            "batching": {"max_batch_size": self.config["max_batch_size"],
                         "batch_wait_timeout_s": self.config["batch_wait_timeout_s"]},
            "replica": os.getpid(),
            "stats": dict(self.stats),
        })

    @api.post("/v1/infer")
    async def infer(self, request: Request) -> JSONResponse:
        loaded = self.loaded
        if loaded is None:
            return JSONResponse({"error": {"field": "engine", "message": "no engine loaded", "status": 503}}, 503)
        try:
            body = parse_body(await request.body(), max_bytes=self.config["max_request_bytes"])
            encoding = body.get("encoding", "data") if isinstance(body, dict) else "data"
            if encoding not in ENCODINGS:
                raise RequestError("encoding", f"got {encoding!r}; allowed: {list(ENCODINGS)}")
            inputs = decode_request(body, loaded.specs, max_bytes=self.config["max_request_bytes"],
                                    extra_keys=("encoding",))
        except RequestError as exc:
            return JSONResponse(exc.to_dict(), status_code=exc.status)
        outputs = await self._run_batch(inputs)
        return JSONResponse(encode_outputs(outputs, encoding))

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
    async def _run_batch(self, requests: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        loaded = self.loaded  # the engine this whole batch runs on, even if a swap lands meanwhile
        results, calls = await asyncio.to_thread(_run_grouped, loaded, requests)
        self.stats["requests"] += len(requests)
        self.stats["batches"] += 1
        self.stats["engine_calls"] += calls
        return results


def build_app(args: dict[str, Any]) -> serve.Application:
    """Application builder for Serve config files (`import_path: evo.serving.app:build_app`).

    `args` may hold `engine` and the other user_config keys; the deployment's user_config in the
    config file takes precedence. A cuda preset gets one GPU per replica."""
    config = {k: v for k, v in (args or {}).items() if v is not None}
    unknown = sorted(set(config) - set(USER_CONFIG_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown args {unknown}; allowed: {sorted(USER_CONFIG_DEFAULTS)}")
    options: dict[str, Any] = {}
    if config.get("engine"):
        record = resolve(config["engine"], config.get("tracking_uri"))
        if get_workload(record.workload).presets()[record.preset].device == "cuda":
            options["ray_actor_options"] = {"num_cpus": 1, "num_gpus": 1}
        options["user_config"] = {**USER_CONFIG_DEFAULTS, **config}
    return EngineServer.options(**options).bind()
