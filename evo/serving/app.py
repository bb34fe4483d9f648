"""Ray Serve application that serves one engine over HTTP, verified before it answers, hot-swappable.

    POST /v1/infer   {"inputs": {name: tensor}, "encoding": "data"|"b64", "reduce": "none"|"argmax"}
                     -> {"outputs": {name: tensor}}   ("argmax": each output's int64 argmax over its last dim)
    GET  /v1/engine  the claim first (paired speedup, 95% interval, vs which baseline), then workload, preset,
                     genome, hash, single timings (labelled so), device, MLflow run id
    GET  /healthz    200 when an engine is loaded and verified

A generation engine (a workload of the generation contract) is served the way LLM clients call one, the
OpenAI API (`evo.serving.generation`, `evo.serving.openai_api`; docs/serving.md):

    POST /v1/completions       prompt as text (where the checkpoint folder has a tokenizer) or token ids
    POST /v1/chat/completions  messages, through the tokenizer's chat template
    GET  /v1/models            the one model this replica serves

with `stream` (server-sent events, `data: [DONE]`), `usage`, `max_tokens`, `temperature`/`top_p`/`seed`
(seeded sampling, where the engine passed its sampling check), `stop`/`stop_token_ids`/`ignore_eos`, and
errors in OpenAI's shape naming the parameter. One engine loop per replica batches the requests of every
connection (continuous batching across HTTP requests); a client that goes away frees its slot; a full
queue is 429 with Retry-After.

The engine is named by `user_config.engine` (any source `evo.serving.source.resolve` accepts). The
replica never runs engine code itself: it is a client of the engine, as the judge is. It starts the
engine in the same confined process kind the evaluator judges engines in (`evaluators.served.engine`: zygote,
jail with its allow-list view, seccomp, cgroups, filtered environment), where the engine is built and
verified against the float64 reference over every check case and a fresh draw over the verified domain
before the replica reports ready; a replica whose engine fails never becomes ready. Each engine call
goes over that process's channel and shared arenas. The replica keeps checking what it serves: a
sample of the engine calls (`rescore_fraction`) is re-scored against the reference on a thread of its
own, off the request path; a mismatch takes the engine out of service (back to the previous engine
where a hot swap left one, else `/healthz` and Serve's health check fail and `/v1/infer` answers 503)
and is reported under "rescoring" in `/v1/engine` and in the logs. A generation engine is held to more
on every request (`evaluators.served.generator`, user_config `verify`, `canary_every`, `slow_*`, `stall_*`):
guards on each token, its judged speed, canaries and, under `verify: all`, the reference before any token
is released; it reports its own failure (`on_failure`) and leaves service the same way, under "guards". What it
checks is judged under the accuracy contract its run declared (exact, or a budget on a running estimate,
reported under "accuracy").
`reconfigure` (a new user_config) first checks every key and value, then builds and verifies the new
engine off the request path, and swaps engine and options in only if all of that passes; otherwise
the old engine and options keep serving and the refusal is reported under "last_swap" in /v1/engine.
Once a replica serves, `reconfigure` never raises: Serve would mark the deployment failed and replace
the replica, leaving the app without a healthy one.

Memory is bounded per replica: a body is refused on its Content-Length before it is read, read as a
stream with a hard cap otherwise, and admitted only while the bytes of the requests in flight stay
within `max_inflight_bytes` (beyond, it waits unread up to `max_queue_wait_s`, then 503 with
Retry-After). Every error, unknown routes and wrong methods included, is the error object
`{"error": {"field", "message", "status"}}`. Requests are batched with `@serve.batch`: requests with
the same tensors, equal in every dim but the batch axis, run as one engine call, concatenated along
that axis. What a request holds is the workload's `request_specs(preset)`, bounded by its verified
domain (`Workload.domain`: every free dim's range, each input's value range; outside is 422 naming
the bound); nothing here knows a workload by name.
"""
# No `from __future__ import annotations` here: FastAPI must see real types (Request) on the routes.

import asyncio
import ctypes
import functools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from evaluators.sandbox.process import SANDBOXES
from evaluators.served.engine import ServedEngine, ServedEngineError
from evaluators.served.guards import POLICY_DEFAULTS, ServePolicy
from evaluators.settings import EvaluatorSettings
from evo.core.records import null_for_nan
from evo.serving.codec import ENCODINGS, RequestError, decode_request, encode_outputs, parse_body, request_schema
from evo.serving.example import example_body
from evo.serving.generation import LoadedGenerator, load_generator
from evo.serving.generation import answer as answer_completion
from evo.serving.openai_api import CHAT_BODY, COMPLETION_BODY, OpenAIError
from evo.serving.openai_api import models as models_body
from evo.serving.rescoring import Rescorer
from evo.serving.source import EngineRecord, resolve
from evo.workloads import get_workload
from evo.workloads.base import DeviceInfo, Preset, Workload

logger = logging.getLogger("ray.serve")

USER_CONFIG_DEFAULTS: dict[str, Any] = {
    "engine": None,  # required: run directory, models:/NAME/VERSION, runs:/RUN_ID or default:WORKLOAD/PRESET
    "tracking_uri": None,  # MLflow store for models:/ and runs:/ sources; default $MLFLOW_TRACKING_URI or ./mlflow.db
    "max_request_bytes": 64 * 1024 * 1024,  # larger bodies get 413 (on Content-Length, before reading)
    "max_inflight_bytes": 128 * 1024 * 1024,  # request bytes a replica holds at once; beyond, a request waits
    "max_queue_wait_s": 0.0,  # how long a request may wait for room (unread) before its 503 + Retry-After
    "max_batch_size": None,  # batch rows merged into one engine call; None: the largest verified B (Workload.verified_batch)
    "batch_wait_timeout_s": 0.005,  # how long a batch waits to fill
    "rescore_fraction": 0.05,  # share of engine calls re-scored against the float64 reference, off the request path
    "sandbox": "strict",  # the engine process's confinement, as the evaluator's; "none" only for trusted engines
    # generation engines (the OpenAI routes)
    "served_model_name": None,  # the id clients name in `model`; None: the checkpoint folder's name, else WORKLOAD/PRESET
    "max_waiting_requests": 256,  # requests queued or running in the engine; beyond, 429 with Retry-After
    # what a generation engine is held to while it serves (evaluators.served.guards.ServePolicy: each key's doc and
    # check there): verify (sampled | all), verify_chunk, canary_every, slow_action (report | remove), slow_factor,
    # slow_window_s, stall_factor, stall_floor_s
    **POLICY_DEFAULTS,
}
REBUILD_KEYS = ("engine", "sandbox", "served_model_name", "max_waiting_requests")  # a change starts a new engine
DRAIN_S = 120.0  # how long a retired generation engine's in-flight requests may take to finish
RETRY_AFTER_S = 1


def check_user_config(user_config: Any) -> dict[str, Any]:
    """The user_config with defaults filled in, or ValueError naming the key, what was received and what
    is allowed. Nothing is applied here: a refused config changes nothing."""
    if not isinstance(user_config, dict):
        raise ValueError(f"user_config must be a mapping, got {type(user_config).__name__} {user_config!r}")
    unknown = sorted(set(user_config) - set(USER_CONFIG_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown user_config key(s) {unknown}; allowed: {sorted(USER_CONFIG_DEFAULTS)}")
    config = {**USER_CONFIG_DEFAULTS, **{k: v for k, v in user_config.items() if v is not None}}
    if not isinstance(config["engine"], str) or not config["engine"]:
        raise ValueError(f"user_config 'engine' must name an engine (a run directory, models:/NAME/VERSION, "
                         f"runs:/RUN_ID or default:WORKLOAD/PRESET), got {config['engine']!r}")
    if config["tracking_uri"] is not None and not isinstance(config["tracking_uri"], str):
        raise ValueError(f"user_config 'tracking_uri' must be a string or null, got {config['tracking_uri']!r}")
    name = config["served_model_name"]
    if name is not None and (not isinstance(name, str) or not name.strip() or len(name) > 256):
        raise ValueError(f"user_config 'served_model_name' must be a non-empty string (the id clients send as "
                         f"`model`), got {name!r}")
    for key, low in (("max_request_bytes", 1), ("max_inflight_bytes", 1), ("max_batch_size", 1),
                     ("max_waiting_requests", 1)):
        if key == "max_batch_size" and config[key] is None:
            continue  # the engine's largest verified B, filled in once the engine is known (check_batch)
        if type(config[key]) is not int or config[key] < low:
            raise ValueError(f"user_config {key!r} must be an integer >= {low}, got {config[key]!r}")
    fraction = config["rescore_fraction"]
    if type(fraction) not in (int, float) or not 0 <= fraction <= 1:
        raise ValueError(f"user_config 'rescore_fraction' must be a number in [0, 1], got {fraction!r}")
    if config["sandbox"] not in SANDBOXES:
        raise ValueError(f"user_config 'sandbox' must be one of {list(SANDBOXES)}, got {config['sandbox']!r}")
    for key in ("batch_wait_timeout_s", "max_queue_wait_s"):
        wait = config[key]
        if type(wait) not in (int, float) or not 0 <= wait <= 600:
            raise ValueError(f"user_config {key!r} must be a number of seconds in [0, 600], got {wait!r}")
    ServePolicy.from_config(config)  # ValueError naming the key and what it allows
    if config["max_inflight_bytes"] < config["max_request_bytes"]:
        raise ValueError(f"user_config 'max_inflight_bytes' ({config['max_inflight_bytes']}) must be at least "
                         f"'max_request_bytes' ({config['max_request_bytes']}), or no maximum-size request fits")
    return config


def _argmax_last(outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each output -> the int64 index of its largest value along the last dim (a language model's greedy
    tokens from its logits)."""
    return {name: t.argmax(dim=-1) for name, t in outputs.items()}


# the request option "reduce": what the response holds of each output
REDUCTIONS = {"none": lambda outputs: outputs, "argmax": _argmax_last}


def error_response(field: str, message: str, status: int, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"field": field, "message": message, "status": status}}, status, headers=headers)


def _release_memory() -> None:
    """Hand freed heap pages back to the OS after a large request (glibc keeps them otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class EngineRejected(RuntimeError):
    """The engine failed to build or failed its correctness check; it will not serve."""


@dataclass(frozen=True)
class LoadedEngine:
    record: EngineRecord
    engine: ServedEngine  # the engine's confined process; calls go over its channel
    specs: tuple
    device: str
    check_message: str
    max_rel_error: float
    loaded_at: float
    max_batch: int = 1  # the largest batch (B) the evaluator's cascade verified engines of this workload at
    axes: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # free dim -> verified (lo, hi)


def check_batch(config: dict[str, Any], loaded: LoadedEngine) -> dict[str, Any]:
    """`config` with max_batch_size filled in (unset: the largest verified B); refuse one that would merge
    requests into batches no engine was verified at. A generation engine batches requests itself: the option
    is not used. A call engine refuses `verify: all` (its calls are re-scored by rescore_fraction)."""
    if isinstance(loaded, LoadedGenerator):
        return {**config, "max_batch_size": config["max_batch_size"] or 1}
    if config.get("verify", "sampled") != "sampled":
        raise ValueError(f"user_config 'verify' {config['verify']!r} is for generation engines (token streams); engine "
                         f"{loaded.record.genome.hash} takes tensors: its calls are re-scored by rescore_fraction. Use "
                         f"'sampled'")
    if config["max_batch_size"] is None:
        return {**config, "max_batch_size": loaded.max_batch}
    if config["max_batch_size"] > loaded.max_batch:
        raise ValueError(f"user_config 'max_batch_size' {config['max_batch_size']} is larger than the largest batch "
                         f"engines of this workload are verified at (B={loaded.max_batch}); use at most "
                         f"{loaded.max_batch}, or leave it unset for that")
    return config


def load_engine(source: str, tracking_uri: str | None = None, sandbox: str = "strict", max_waiting: int = 256,
                served_name: str | None = None, policy: ServePolicy | None = None) -> LoadedEngine | LoadedGenerator:
    """Resolve the engine, start it in its own confined process, build and verify it there; raise
    EngineRejected if anything of that fails. A generation engine is checked by the judge's replay and
    served by one engine loop (`evo.serving.generation`)."""
    record = resolve(source, tracking_uri)
    workload = get_workload(record.workload)
    preset = workload.presets()[record.preset]
    if preset.device == "cuda" and not torch.cuda.is_available():
        raise EngineRejected(f"engine {record.genome.hash} is for the cuda preset {preset.name!r}; this replica has no GPU")
    if workload.contract == "generation":
        try:
            return load_generator(record, sandbox, max_waiting, served_name, policy)
        except (RuntimeError, ValueError) as exc:
            raise EngineRejected(f"engine {record.genome.hash} from {source}: {exc}") from exc
    try:
        specs, axes = request_schema(workload, preset)
    except NotImplementedError as exc:
        raise EngineRejected(f"engine {record.genome.hash} from {source}: no HTTP input schema: {exc}") from exc
    try:
        engine = ServedEngine(record.workload, record.preset, record.genome.to_json(), record.sources,
                              EvaluatorSettings(sandbox=sandbox))
    except (ServedEngineError, ValueError) as exc:
        raise EngineRejected(f"engine {record.genome.hash} from {source}: {exc}") from exc
    return LoadedEngine(record, engine, specs, engine.device, engine.check_message,
                        engine.max_rel_error, time.time(), workload.verified_batch(preset), axes)


def _run_grouped(loaded: LoadedEngine, requests: list[dict[str, torch.Tensor]]
                 ) -> tuple[list[dict], list[tuple[dict, dict]]]:
    """Requests with the same tensors, equal in every dim but the batch axis (0), become one engine call
    along axis 0, never more than `loaded.max_batch` (verified) batch elements in one call. Returns each
    request's outputs and each engine call's (inputs, outputs)."""
    results: list[dict[str, torch.Tensor] | None] = [None] * len(requests)
    groups: list[list[int]] = []
    open_groups: dict[tuple, tuple[list[int], int]] = {}
    for i, inputs in enumerate(requests):
        key = tuple((name, tuple(tensor.shape[1:])) for name, tensor in sorted(inputs.items()))
        size = int(next(iter(inputs.values())).shape[0])
        members, total = open_groups.get(key, (None, 0))
        if members is None or total + size > loaded.max_batch:
            members, total = [], 0
            groups.append(members)
        members.append(i)
        open_groups[key] = (members, total + size)
    calls = []
    for members in groups:
        sizes = [requests[i][next(iter(requests[i]))].shape[0] for i in members]
        merged = {name: torch.cat([requests[i][name] for i in members]) for name in requests[members[0]]}
        outputs = loaded.engine(**merged)
        calls.append((merged, outputs))
        split = {name: torch.split(t, sizes) for name, t in outputs.items()}
        for j, i in enumerate(members):
            results[i] = {name: parts[j].clone() for name, parts in split.items()}
    return results, calls


def _content_length(request: Request, limit: int) -> int | None:
    """The declared body size, refused (413) before a byte of the body is read when over `limit`."""
    declared = request.headers.get("content-length")
    if declared is None:
        return None
    if not declared.strip().isdigit():
        raise RequestError("body", f"Content-Length {declared!r} is not a byte count", 400)
    if int(declared) > limit:
        raise RequestError("body", f"Content-Length is {int(declared)} bytes; the limit is {limit} bytes "
                                   f"(max_request_bytes; send fewer or smaller tensors, or use \"b64\" encoding)", 413)
    return int(declared)


async def _read_capped(request: Request, limit: int) -> bytearray:
    """The body, read as a stream and refused (413) as soon as it passes `limit` bytes."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestError("body", f"request body passed {limit} bytes (max_request_bytes) while being read; "
                                       f"send fewer or smaller tensors, or use \"b64\" encoding", 413)
    return body


def engine_summary(record: EngineRecord) -> dict[str, Any]:
    """What `/v1/engine` says of the engine, claim first: `claim` (the paired speedup with its 95% interval,
    `EngineRecord.claim`), then the record, its single timings labelled as such (`latency_ms_single_timing`,
    `speedups_single_timing`: one median of one run each, no interval)."""
    info = record.to_dict()
    single = {"latency_ms_single_timing": info.pop("latency_ms"), "speedups_single_timing": info.pop("speedups")}
    return null_for_nan({"claim": record.claim(), **info, **single})  # a record's NaN figures: null


def _plain(value: Any) -> Any:
    """A user_config as JSON can show it (what was refused, for last_swap)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


# Above the deployment class: Serve pickles the class when it is decorated, with the module globals its methods
# name that exist by then.
def _retire(loaded: LoadedEngine | LoadedGenerator) -> None:
    """Kill a replaced engine's process: a call engine after the call still running there, a generation engine
    after its in-flight requests finished (at most DRAIN_S)."""
    if isinstance(loaded, LoadedGenerator):
        loaded.engine.close(drain_s=DRAIN_S)
    else:
        loaded.engine.close()


def _kill(loaded: LoadedEngine | LoadedGenerator) -> None:
    """Close an engine found wrong: nothing more of it is served, its in-flight requests fail."""
    try:
        loaded.engine.close()
    except Exception:  # noqa: BLE001 - it was failing already; the replica goes on
        logger.exception("closing a failed engine")


api = FastAPI(title="engine-factory", description="Serves the best engine a search found.")


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes (404) and wrong methods (405) get the documented error object too."""
    if exc.status_code == 405:
        allowed = exc.headers.get("Allow", "") if exc.headers else ""
        return error_response("method", f"{request.method} is not allowed on {request.url.path}; allowed: "
                                        f"{allowed or 'see the HTTP API'}", 405, headers=exc.headers)
    if exc.status_code == 404:
        return error_response("path", f"no route {request.url.path}; routes: POST /v1/infer (call engines), "
                                      f"POST /v1/completions, POST /v1/chat/completions, GET /v1/models (generation "
                                      f"engines), GET /v1/engine, GET /healthz", 404)
    return error_response("request", str(exc.detail), exc.status_code, headers=exc.headers)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response("request", str(exc.errors())[:500], 422)


@api.exception_handler(Exception)
async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("request %s %s failed", request.method, request.url.path)
    return error_response("engine", f"internal error: {type(exc).__name__}: {exc}"[:500], 500)


# A replica whose engine fails to build or verify is not started again (Serve's default is 3 tries): each try
# verifies on fresh inputs, so an engine wrong on some of them would get another draw; the failure is final.
@serve.deployment(name="EngineServer", max_ongoing_requests=512, ray_actor_options={"num_cpus": 1},
                  max_constructor_retry_count=1)
@serve.ingress(api)
class EngineServer:
    def __init__(self, engine: str | None = None, **options: Any) -> None:
        self.config = dict(USER_CONFIG_DEFAULTS)
        self.loaded: LoadedEngine | None = None
        self.previous: LoadedEngine | None = None  # the engine a hot swap replaced: the fallback
        self.out_of_service: dict[str, Any] | None = None  # why no engine serves (live re-scoring failed)
        self.rescorer = Rescorer(self._take_out_of_service)
        self.last_swap: dict[str, Any] | None = None
        self.stats = {"requests": 0, "batches": 0, "engine_calls": 0, "refused_busy": 0}
        self.inflight_bytes = 0  # bytes reserved by the requests this replica is reading or running
        self._budget: asyncio.Condition | None = None  # admission: waits for inflight_bytes to fit
        if engine is not None:  # plain `serve.run(EngineServer.bind(engine=...))` without user_config
            config = check_user_config({**options, "engine": engine})
            self.loaded = load_engine(engine, config["tracking_uri"], config["sandbox"], config["max_waiting_requests"],
                                      config["served_model_name"], ServePolicy.from_config(config))
            self._watch(self.loaded)
            self._apply_options(check_batch(config, self.loaded))

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Check the whole config, build and verify its engine, then swap both in. Once an engine serves,
        a refusal never raises (Serve would replace the replica): it is recorded under last_swap."""
        started = time.time()
        source = user_config.get("engine") if isinstance(user_config, dict) else None
        try:
            config = check_user_config(user_config)
            if self.loaded is not None and all(config[k] == self.config[k] for k in REBUILD_KEYS):
                candidate = self.loaded  # options only
            else:  # build and verify off the event loop: requests keep being served meanwhile
                candidate = await asyncio.to_thread(load_engine, config["engine"], config["tracking_uri"],
                                                    config["sandbox"], config["max_waiting_requests"],
                                                    config["served_model_name"], ServePolicy.from_config(config))
                self._watch(candidate)
            config = check_batch(config, candidate)
        except Exception as exc:
            if self.loaded is None:
                raise  # nothing to fall back on: the replica must not become ready
            self.last_swap = {"source": source, "ok": False, "error": f"{type(exc).__name__}: {exc}", "at": started,
                              "kept": self.loaded.record.genome.hash, "config": _plain(user_config)}
            logger.error("user_config refused, keeping engine %s and its options: %s",
                         self.loaded.record.genome.hash, exc)
            return
        previous = self.loaded.record.genome.hash if self.loaded else None
        self._apply_options(config)
        if isinstance(candidate, LoadedGenerator):
            candidate.engine.policy = ServePolicy.from_config(config)  # options only: live on the serving engine
        if candidate is not self.loaded:
            retired, self.previous = self.previous, self.loaded
            self.loaded = candidate  # one reference assignment: in-flight batches finish on the old engine
            self.out_of_service = None
            self.last_swap = {"source": config["engine"], "ok": True, "from": previous,
                              "to": candidate.record.genome.hash, "at": started, "seconds": time.time() - started}
            if retired is not None:  # waits for what still runs there, then kills its process
                await asyncio.to_thread(_retire, retired)

    def _watch(self, loaded: LoadedEngine | LoadedGenerator) -> None:
        """A generation engine tells the replica itself when it fails (a guard, a verification, a canary), from
        its own threads: it leaves service at once, not at the next request."""
        if isinstance(loaded, LoadedGenerator):
            loaded.engine.on_failure = functools.partial(self._failed, loaded)

    def _take_out_of_service(self, failed: LoadedEngine, why: str, by: str = "live re-scoring") -> None:
        """Live re-scoring found `failed` wrong (or it failed a call, or `by` its guards): serve the previous engine
        where there is one, else nothing. An engine swapped away is killed off the request path (once: only here
        is it dropped)."""
        if failed is self.previous:
            self.previous = None
            threading.Thread(target=_kill, args=(failed,), name="retire-failed", daemon=True).start()
            return
        if failed is not self.loaded:
            return
        fallback = self.previous
        if fallback is not None:  # (on the re-scoring thread: why first, then the swap readers see)
            self.last_swap = {"source": fallback.record.source, "ok": True, "from": failed.record.genome.hash,
                              "to": fallback.record.genome.hash, "at": time.time(), "reason": why}
            self.previous, self.loaded = None, fallback
            threading.Thread(target=_kill, args=(failed,), name="retire-failed", daemon=True).start()
        else:
            self.out_of_service = {"hash": failed.record.genome.hash, "reason": why, "at": time.time(), "by": by}

    def _apply_options(self, config: dict[str, Any]) -> None:
        """Apply a config `check_user_config` accepted."""
        self.config = dict(config)
        self._run_batch.set_max_batch_size(int(config["max_batch_size"]))
        self._run_batch.set_batch_wait_timeout_s(float(config["batch_wait_timeout_s"]))
        self.rescorer.fraction = float(config["rescore_fraction"])

    def _unavailable(self) -> str | None:
        """Why no engine may answer now, or None."""
        if self.out_of_service is not None:
            gone, by = self.out_of_service, self.out_of_service.get("by", "live re-scoring")
            return f"engine {gone['hash']} was taken out of service by {by}: {gone['reason']}"[:500]
        return "no verified engine loaded yet" if self.loaded is None else None

    def check_health(self) -> None:
        why = self._unavailable()
        if why is not None:
            raise RuntimeError(why)

    @api.get("/healthz")
    async def healthz(self) -> JSONResponse:
        why = self._unavailable()
        if why is not None:
            return error_response("engine", why, 503)
        return JSONResponse({"status": "ok", "hash": self.loaded.record.genome.hash})

    @api.get("/v1/engine")
    async def engine_info(self) -> JSONResponse:
        if self.loaded is None:
            return error_response("engine", "no engine loaded", 503)
        if isinstance(self.loaded, LoadedGenerator):
            return JSONResponse({
                **engine_summary(self.loaded.record), **self.loaded.info(),
                "serving_device": self.loaded.device, "verification": {"message": self.loaded.check_message},
                "loaded_at": self.loaded.loaded_at, "last_swap": self.last_swap, "sandbox": self.config["sandbox"],
                "rescoring": self._rescoring(), "replica": os.getpid()})
        return JSONResponse({
            **engine_summary(self.loaded.record),
            "serving_device": self.loaded.device,
            "verification": {"message": self.loaded.check_message, "max_rel_error": self.loaded.max_rel_error},
            "loaded_at": self.loaded.loaded_at,
            "last_swap": self.last_swap,
            "sandbox": self.config["sandbox"],
            "rescoring": self._rescoring(),
            "batching": {"max_batch_size": self.config["max_batch_size"],
                         "batch_wait_timeout_s": self.config["batch_wait_timeout_s"]},
            "limits": {"max_request_bytes": self.config["max_request_bytes"],
                       "max_inflight_bytes": self.config["max_inflight_bytes"], "inflight_bytes": self.inflight_bytes},
            "replica": os.getpid(),
            "stats": dict(self.stats),
            "example_request": example_body(self.loaded.specs, self.loaded.axes),  # POST it to /v1/infer
        })

    def _rescoring(self) -> dict[str, Any]:
        return {"fraction": self.config["rescore_fraction"], **self.rescorer.stats, "out_of_service": self.out_of_service,
                "previous": self.previous.record.genome.hash if self.previous else None}

    # ------------------------------------------------------------------ generation engines: the OpenAI API
    def _generator(self) -> LoadedGenerator:
        """The generation engine that answers now; OpenAIError when none may."""
        loaded, why = self.loaded, self._unavailable()
        if why is not None:
            raise OpenAIError(None, why, 503, "service_unavailable")
        if not isinstance(loaded, LoadedGenerator):
            raise OpenAIError(None, f"engine {loaded.record.genome.hash} ({loaded.record.workload}) takes tensors, not "
                                    f"prompts: POST /v1/infer (GET /v1/engine has an example request)", 404,
                              code="not_a_generation_engine")
        return loaded

    @api.get("/v1/models")
    async def models(self) -> JSONResponse:
        try:
            loaded = self._generator()
        except OpenAIError as exc:
            return JSONResponse(exc.body(), exc.status)
        return JSONResponse(models_body(loaded.limits.model, int(loaded.loaded_at)))

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._complete(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._complete(request, chat=True)

    async def _complete(self, request: Request, chat: bool):
        limit = self.config["max_request_bytes"]
        try:
            loaded = self._generator()
            _content_length(request, limit)
            body = parse_body(await _read_capped(request, limit), max_bytes=limit,
                              expected=CHAT_BODY if chat else COMPLETION_BODY)
        except OpenAIError as exc:
            return JSONResponse(exc.body(), exc.status)
        except RequestError as exc:
            return JSONResponse(OpenAIError(exc.field, exc.message, exc.status).body(), exc.status)
        self.stats["requests"] += 1
        return await answer_completion(loaded, body, chat, self._finished, self._failed)

    def _finished(self, loaded: LoadedGenerator, request: Any, tokens: list[int]) -> None:
        if loaded.engine.policy.verify != "all":  # under `verify: all` every token was checked before it went out
            self.rescorer.offer(loaded, [(request, tokens)])  # re-scored against the reference off the request path

    def _failed(self, loaded: LoadedGenerator, why: str) -> None:
        logger.error("generation engine failed; taking it out of service: %s", why)
        self._take_out_of_service(loaded, why, by="the replica's serving checks")

    @api.post("/v1/infer")
    async def infer(self, request: Request) -> JSONResponse:
        loaded, why = self.loaded, self._unavailable()
        if why is not None:
            return error_response("engine", why, 503)
        if isinstance(loaded, LoadedGenerator):
            return error_response("path", f"engine {loaded.record.genome.hash} generates tokens: POST /v1/completions "
                                          f"or /v1/chat/completions with model {loaded.limits.model!r}", 404)
        limit, budget = self.config["max_request_bytes"], self.config["max_inflight_bytes"]
        try:
            declared = _content_length(request, limit)
        except RequestError as exc:
            return JSONResponse(exc.to_dict(), status_code=exc.status)
        reserve = limit if declared is None else declared  # unknown length: the most it may grow to
        if not await self._admit(reserve, budget):
            self.stats["refused_busy"] += 1
            return error_response("body", f"the replica holds {self.inflight_bytes} bytes of requests in flight; "
                                          f"this one ({reserve} bytes) would pass max_inflight_bytes {budget} and "
                                          f"waited max_queue_wait_s {self.config['max_queue_wait_s']} s: "
                                          f"retry after {RETRY_AFTER_S} s", 503,
                                  headers={"Retry-After": str(RETRY_AFTER_S)})
        try:
            try:
                body = parse_body(await _read_capped(request, limit), max_bytes=limit)
                encoding = body.get("encoding", "data")
                if encoding not in ENCODINGS:
                    raise RequestError("encoding", f"got {encoding!r}; allowed: {list(ENCODINGS)}")
                reduce = body.get("reduce", "none")
                if reduce not in REDUCTIONS:
                    raise RequestError("reduce", f"got {reduce!r}; allowed: {list(REDUCTIONS)}")
                inputs = decode_request(body, loaded.specs, max_bytes=limit, extra_keys=("encoding", "reduce"),
                                        consume=True,
                                        axes=loaded.axes)  # the verified domain: B, T, ... and value bounds
                del body
                first = next(iter(inputs))
                if inputs[first].shape[0] > loaded.max_batch:
                    raise RequestError(f"inputs.{first}.shape", f"batch of {inputs[first].shape[0]}: engines of this "
                                       f"workload are verified up to B={loaded.max_batch}; split the request", 422)
            except RequestError as exc:
                return JSONResponse(exc.to_dict(), status_code=exc.status)
            outputs = await self._run_batch(inputs)
            del inputs
            return JSONResponse(encode_outputs(REDUCTIONS[reduce](outputs), encoding))
        finally:
            async with self._admission():
                self.inflight_bytes -= reserve
                self._admission().notify_all()
            if self.inflight_bytes == 0 and reserve > 4 * 1024 * 1024:
                _release_memory()

    def _admission(self) -> asyncio.Condition:
        if self._budget is None:  # made on the replica's event loop, where requests run
            self._budget = asyncio.Condition()
        return self._budget

    async def _admit(self, reserve: int, budget: int) -> bool:
        """Wait (unread: the body stays in the sender's buffers) until `reserve` bytes fit the budget;
        a request alone is always admitted. False after max_queue_wait_s."""
        fits = lambda: not self.inflight_bytes or self.inflight_bytes + reserve <= budget  # noqa: E731
        async with self._admission():
            if not fits():
                try:
                    await asyncio.wait_for(self._admission().wait_for(fits), self.config["max_queue_wait_s"])
                except asyncio.TimeoutError:
                    return False
            self.inflight_bytes += reserve
            return True

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
    async def _run_batch(self, requests: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        loaded = self.loaded  # the engine this whole batch runs on, even if a swap lands meanwhile
        try:
            results, calls = await asyncio.to_thread(_run_grouped, loaded, requests)
        except ServedEngineError as exc:  # it raised, died or answered malformed on verified inputs
            logger.error("engine call failed; taking the engine out of service: %s", exc)
            self._take_out_of_service(loaded, str(exc))
            raise
        self.stats["requests"] += len(requests)
        self.stats["batches"] += 1
        self.stats["engine_calls"] += len(calls)
        self.rescorer.offer(loaded, calls)
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
        check_user_config(config)
        record = resolve(config["engine"], config.get("tracking_uri"))
        if get_workload(record.workload).presets()[record.preset].device == "cuda":
            options["ray_actor_options"] = {"num_cpus": 1, "num_gpus": 1}
        options["user_config"] = {**USER_CONFIG_DEFAULTS, **config}
    return EngineServer.options(**options).bind()
