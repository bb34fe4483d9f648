"""A serving load test with `vllm bench serve`'s knobs and names, against any OpenAI-compatible server.

    .venv/bin/python -m evo loadtest http://127.0.0.1:8000 --tokenizer CKPT --num-prompts 64 \
        --random-input-len 64 --random-output-len 64 --max-concurrency 4 --ignore-eos

Every request streams (`stream: true`, `stream_options.include_usage`) through the `openai` client
(`AsyncOpenAI`, no retries); each content chunk is timestamped on arrival on the client's monotonic
clock, and `evo.bench.loadtest_report` turns those timestamps into TTFT, TPOT, ITL, E2EL, throughputs
and goodput. Prompts are vLLM's "random" dataset: seeded random token ids, decoded to text with
`--tokenizer` (re-encoded until they are the asked length), else sent as token-id lists. Arrivals are
all at once (`--request-rate inf`) or Poisson/gamma at the given rate, seeded by `--seed`; one
uncounted request first warms the server up and fails the run early if the server cannot answer.
Only loopback servers unless `--allow-remote`.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as _dt
import ipaddress
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence
from urllib.parse import urlparse

if TYPE_CHECKING:
    import numpy as np

from evo.bench.loadtest_report import (METRICS, RequestRecord, compute_metrics, parse_goodput, per_request_lists,
                                       render_table, write_result)

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
DATASETS = ("random",)
DEFAULT_ID_VOCAB = 256  # ids drawn without a tokenizer: every byte-level or larger vocabulary has them


class LoadtestError(ValueError):
    """A flag or a server that makes the run impossible; the message names the flag and what is allowed."""


def _opt(default: Any, help: str, **argparse_kw: Any) -> Any:
    """An option declared once: its default, its help and its argparse spelling live on the field."""
    return field(default=default, metadata={"help": help, **argparse_kw})


@dataclass(frozen=True)
class LoadtestOptions:
    """What one load test does. Field names are `vllm bench serve`'s flags with '_' for '-'."""

    url: str = _opt(None, "server base URL, e.g. http://127.0.0.1:8000 (without /v1)", positional=True)
    model: str | None = _opt(None, "model id sent in each request (default: the first id of GET URL/v1/models)")
    endpoint: str = _opt("/v1/completions", "API route to load", choices=ENDPOINTS)
    dataset_name: str = _opt("random", "prompt source: random token ids (vLLM's 'random' dataset)", choices=DATASETS)
    random_input_len: int = _opt(1024, "prompt tokens per request", type=int)
    random_output_len: int = _opt(128, "max_tokens per request (exact with --ignore-eos)", type=int)
    random_range_ratio: float = _opt(0.0, "lengths drawn uniformly from [len*(1-r), len*(1+r)], r in [0, 1)",
                                     type=float)
    random_vocab_size: int | None = _opt(None, "token ids are drawn from [0, N) (default: the tokenizer's "
                                               f"non-special ids, else {DEFAULT_ID_VOCAB})", type=int)
    num_prompts: int = _opt(1000, "requests in the benchmark", type=int)
    request_rate: float = _opt(math.inf, "requests per second, Poisson arrivals (inf: all at once)", type=float)
    burstiness: float = _opt(1.0, "gamma shape of the arrivals (1: Poisson; < 1 burstier, > 1 steadier)",
                             type=float)
    max_concurrency: int | None = _opt(None, "most requests in flight at once (default: unlimited)", type=int)
    seed: int = _opt(0, "seed of the prompts, the lengths and the arrival times", type=int)
    tokenizer: str | None = _opt(None, "Hugging Face tokenizer folder: prompts go as text (default: none, "
                                       "prompts go as token-id lists; the chat endpoint needs one)")
    ignore_eos: bool = _opt(False, "send ignore_eos: true (vLLM's extension) so each request yields exactly "
                                   "its output length", action="store_true")
    temperature: float = _opt(0.0, "sampling temperature (0: greedy)", type=float)
    extra_body: str | None = _opt(None, "JSON object merged into every request body, e.g. '{\"top_k\": 1}'")
    goodput: tuple[str, ...] = _opt((), "SLOs in ms for goodput, e.g. ttft:200 tpot:50 e2el:2000 (default: none)",
                                    nargs="+",
                                    metavar="NAME:MS")
    percentile_metrics: str = _opt("ttft,tpot,itl,e2el", f"comma-separated metrics to give percentiles of "
                                                         f"({', '.join(METRICS)})")
    metric_percentiles: str = _opt("99", "comma-separated percentiles, e.g. 50,90,99")
    save_result: bool = _opt(False, "write the result JSON", action="store_true")
    result_dir: str | None = _opt(None, "folder of the result JSON (default: the current one)")
    result_filename: str | None = _opt(None, "name of the result JSON (default: loadtest-LABEL-RATEqps-cN-DATE.json)")
    label: str | None = _opt(None, "a name for this run, printed and saved with the result")
    request_timeout: float = _opt(600.0, "seconds a request may take before it counts as failed", type=float)
    allow_remote: bool = _opt(False, "allow a server that is not on this machine's loopback (127.0.0.0/8, "
                                     "localhost, ::1)", action="store_true")

    @property
    def is_chat(self) -> bool:
        return self.endpoint == "/v1/chat/completions"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The loadtest's flags on `parser`, one per `LoadtestOptions` field (`--random-input-len`, ...)."""
    for f in dataclasses.fields(LoadtestOptions):
        meta = dict(f.metadata)
        help_text = meta.pop("help")
        if meta.pop("positional", False):
            parser.add_argument(f.name, metavar=f.name.upper(), help=help_text)
            continue
        if meta.get("action") is None and f.default is None:
            help_text = help_text if "default" in help_text else f"{help_text} (default: none)"
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=f.default, help=help_text, **meta)


def options_from_args(args: argparse.Namespace) -> LoadtestOptions:
    names = {f.name for f in dataclasses.fields(LoadtestOptions)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["goodput"] = tuple(values.get("goodput") or ())
    return LoadtestOptions(**values)


@dataclass(frozen=True)
class Checked:
    """Options after validation, with the parsed forms the run uses."""

    options: LoadtestOptions
    percentile_metrics: tuple[str, ...]
    metric_percentiles: tuple[float, ...]
    goodput: dict[str, float]
    extra_body: dict[str, Any]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_url(url: str, allow_remote: bool) -> str:
    """The base URL without a trailing '/' or '/v1'; raises LoadtestError for a non-http(s) URL or, unless
    allow_remote, a host outside this machine's loopback."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise LoadtestError(f"URL: got {url!r}; allowed: http(s)://HOST:PORT, e.g. http://127.0.0.1:8000")
    host = parsed.hostname
    if not allow_remote and host != "localhost":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise LoadtestError(f"URL: host {host!r} is not this machine's loopback; allowed: 127.0.0.0/8, localhost, "
                                f"::1 (pass --allow-remote to load another host you are responsible for)")
    base = url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def validate(options: LoadtestOptions) -> Checked:
    """Every flag checked at once before any request; the first bad one raises LoadtestError naming it."""
    o = options
    url = check_url(o.url or "", o.allow_remote)
    positive_ints = {"random_input_len": o.random_input_len, "random_output_len": o.random_output_len,
                     "num_prompts": o.num_prompts}
    for name, value in positive_ints.items():
        if not isinstance(value, int) or value < 1:
            raise LoadtestError(f"{_flag(name)}: got {value!r}; allowed: an integer >= 1")
    for name in ("max_concurrency", "random_vocab_size"):
        value = getattr(o, name)
        if value is not None and value < 1:
            raise LoadtestError(f"{_flag(name)}: got {value!r}; allowed: an integer >= 1 (or leave it out)")
    if not 0.0 <= o.random_range_ratio < 1.0:
        raise LoadtestError(f"--random-range-ratio: got {o.random_range_ratio}; allowed: 0 <= r < 1")
    if not (o.request_rate > 0):
        raise LoadtestError(f"--request-rate: got {o.request_rate}; allowed: a rate > 0 requests/s, or inf")
    if not (o.burstiness > 0 and math.isfinite(o.burstiness)):
        raise LoadtestError(f"--burstiness: got {o.burstiness}; allowed: a finite number > 0 (1: Poisson)")
    if not (o.request_timeout > 0):
        raise LoadtestError(f"--request-timeout: got {o.request_timeout}; allowed: seconds > 0")
    if not (o.temperature >= 0):
        raise LoadtestError(f"--temperature: got {o.temperature}; allowed: a number >= 0")
    if o.endpoint not in ENDPOINTS:
        raise LoadtestError(f"--endpoint: got {o.endpoint!r}; allowed: {', '.join(ENDPOINTS)}")
    if o.dataset_name not in DATASETS:
        raise LoadtestError(f"--dataset-name: got {o.dataset_name!r}; allowed: {', '.join(DATASETS)}")
    if o.is_chat and o.tokenizer is None:
        raise LoadtestError("--endpoint /v1/chat/completions sends text messages: it needs --tokenizer FOLDER "
                            "(token-id prompts only go to /v1/completions)")
    if o.tokenizer is not None and not Path(o.tokenizer).is_dir():
        raise LoadtestError(f"--tokenizer: {o.tokenizer!r} is not a folder; allowed: a Hugging Face tokenizer folder "
                            "(tokenizer.json, or what AutoTokenizer loads offline)")
    metrics = tuple(m.strip() for m in o.percentile_metrics.split(",") if m.strip())
    unknown = [m for m in metrics if m not in METRICS]
    if unknown or not metrics:
        raise LoadtestError(f"--percentile-metrics: got {o.percentile_metrics!r}; allowed: a comma-separated subset "
                            f"of {','.join(METRICS)}")
    try:
        percentiles = tuple(float(p) for p in o.metric_percentiles.split(",") if p.strip())
    except ValueError:
        percentiles = ()
    if not percentiles or not all(0 < p < 100 for p in percentiles):
        raise LoadtestError(f"--metric-percentiles: got {o.metric_percentiles!r}; allowed: comma-separated numbers "
                            "in (0, 100), e.g. 50,99")
    try:
        goodput = parse_goodput(o.goodput)
    except ValueError as exc:
        raise LoadtestError(str(exc)) from None
    extra: Any = {}
    if o.extra_body is not None:
        try:
            extra = json.loads(o.extra_body)
        except json.JSONDecodeError as exc:
            raise LoadtestError(f"--extra-body: not JSON ({exc}); allowed: a JSON object, e.g. '{{\"top_k\": 1}}'") from None
        if not isinstance(extra, dict):
            raise LoadtestError(f"--extra-body: got {type(extra).__name__}; allowed: a JSON object")
    if o.result_filename is not None and not o.save_result:
        raise LoadtestError("--result-filename is only used with --save-result: add --save-result")
    return Checked(dataclasses.replace(o, url=url), metrics, percentiles, goodput, extra)


# ---- the dataset -------------------------------------------------------------------------------------------

class Tokenizer:
    """The few calls the dataset needs from a Hugging Face tokenizer folder, loaded offline."""

    def __init__(self, folder: str):
        import numpy as np

        path = Path(folder)
        self.name = str(path)
        if (path / "tokenizer.json").exists():
            from tokenizers import Tokenizer as Fast

            fast = Fast.from_file(str(path / "tokenizer.json"))
            self._encode = lambda text: fast.encode(text, add_special_tokens=False).ids
            self._decode = lambda ids: fast.decode(ids, skip_special_tokens=False)
            size = fast.get_vocab_size(with_added_tokens=True)
            special = {i for i, t in fast.get_added_tokens_decoder().items() if t.special}
        else:
            try:
                from transformers import AutoTokenizer
            except ImportError as exc:
                raise LoadtestError(f"--tokenizer: {folder} has no tokenizer.json and transformers is not "
                                    f"installed ({exc})") from None
            slow = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            self._encode = lambda text: slow.encode(text, add_special_tokens=False)
            self._decode = lambda ids: slow.decode(ids)
            size = len(slow)
            special = set(slow.all_special_ids)
        self.normal_ids = np.array([i for i in range(size) if i not in special], dtype=np.int64)

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode(list(ids))


@dataclass(frozen=True)
class RequestSpec:
    """One request of the dataset: its prompt (text, or token ids), prompt tokens and max_tokens."""

    index: int
    prompt: str | tuple[int, ...]
    input_len: int
    output_len: int


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> np.ndarray:
    low, high = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
    return rng.integers(low, high + 1, size=n)


def _text_of_length(tokenizer: Tokenizer, ids: list[int], target: int, rng: np.random.Generator,
                    pool: np.ndarray) -> tuple[str, int]:
    """Decode ids to text whose re-encoding is `target` tokens (as vLLM does): decoding and encoding again
    merges or splits tokens, so trim or top up and retry a few times; returns the text and its length."""
    text = tokenizer.decode(ids)
    for _ in range(10):
        again = tokenizer.encode(text)
        if len(again) == target:
            break
        ids = again[:target] if len(again) > target else again + rng.choice(pool, target - len(again)).tolist()
        text = tokenizer.decode(ids)
    return text, len(tokenizer.encode(text))


def random_dataset(options: LoadtestOptions, tokenizer: Tokenizer | None) -> list[RequestSpec]:
    """vLLM's random dataset: seeded lengths within the range ratio, uniform random token ids (never special
    ones), as text through the tokenizer or as id lists. Same options and seed, same requests."""
    import numpy as np

    rng = np.random.default_rng([options.seed, 0x6c74])  # the dataset's own stream, apart from arrivals
    n = options.num_prompts
    inputs = _lengths(rng, options.random_input_len, options.random_range_ratio, n)
    outputs = _lengths(rng, options.random_output_len, options.random_range_ratio, n)
    if tokenizer is not None:
        pool = tokenizer.normal_ids
        if options.random_vocab_size is not None:
            pool = pool[pool < options.random_vocab_size]
    else:
        pool = np.arange(options.random_vocab_size or DEFAULT_ID_VOCAB, dtype=np.int64)
    if pool.size == 0:
        raise LoadtestError(f"--random-vocab-size: {options.random_vocab_size} leaves no usable token id")
    specs = []
    for i in range(n):
        ids = rng.choice(pool, int(inputs[i])).tolist()
        if tokenizer is None:
            specs.append(RequestSpec(i, tuple(ids), len(ids), int(outputs[i])))
        else:
            text, length = _text_of_length(tokenizer, ids, int(inputs[i]), rng, pool)
            specs.append(RequestSpec(i, text, length, int(outputs[i])))
    return specs


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: all 0 at rate inf, else the cumulative sum of
    gamma(burstiness, 1/(rate*burstiness)) gaps (exponential, i.e. Poisson arrivals, at burstiness 1)."""
    if math.isinf(rate):
        return [0.0] * n
    import numpy as np

    rng = np.random.default_rng([seed, 0x6172])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request goes at once
    return np.cumsum(gaps).tolist()


# ---- the requests ------------------------------------------------------------------------------------------

def _body(spec: RequestSpec, checked: Checked, model: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(keyword arguments of the openai call, extra_body) for one request."""
    o = checked.options
    kwargs: dict[str, Any] = {"model": model, "max_tokens": spec.output_len, "temperature": o.temperature,
                              "stream": True, "stream_options": {"include_usage": True}}
    if o.is_chat:
        kwargs["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        kwargs["prompt"] = spec.prompt if isinstance(spec.prompt, str) else list(spec.prompt)
    extra = dict(checked.extra_body)
    if o.ignore_eos:
        extra["ignore_eos"] = True
    return kwargs, extra


def _describe(exc: BaseException) -> str:
    import openai

    if isinstance(exc, openai.APIStatusError):
        try:
            body = exc.response.text
        except Exception:  # a streamed body already consumed
            body = str(exc.body)
        return f"HTTP {exc.status_code}: {' '.join(body.split())[:300]}"
    cause = exc.__cause__ if isinstance(exc, openai.APIConnectionError) and exc.__cause__ is not None else None
    text = f"{exc} ({type(cause).__name__}: {cause})" if cause is not None else str(exc)
    return f"{type(exc).__name__}: {' '.join(text.split())[:300]}"


async def send_request(client: Any, spec: RequestSpec, checked: Checked, model: str, t0: float) -> RequestRecord:
    """One streamed request; every content chunk's arrival is stamped (seconds since t0). Failure is a value."""
    kwargs, extra = _body(spec, checked, model)
    chunk_times: list[float] = []
    pieces: list[str] = []
    usage = None
    chat = checked.options.is_chat

    async def stream_all() -> None:
        nonlocal usage
        create = client.chat.completions.create if chat else client.completions.create
        stream = await create(extra_body=extra or None, **kwargs)
        async for chunk in stream:
            now = time.perf_counter() - t0
            if getattr(chunk, "usage", None) is not None:
                usage = chunk.usage
            for choice in chunk.choices or ():
                text = choice.delta.content if chat else choice.text
                if text:
                    chunk_times.append(now)
                    pieces.append(text)
                    break

    start = time.perf_counter() - t0
    try:  # the client's own timeout bounds each read; this bounds the whole request
        await asyncio.wait_for(stream_all(), checked.options.request_timeout)
        error = None
    except asyncio.TimeoutError:
        error = f"TimeoutError: the stream did not end within --request-timeout {checked.options.request_timeout:g} s"
    except Exception as exc:  # the server's or the network's failure: a recorded result, never a crash
        error = _describe(exc)
    end = time.perf_counter() - t0
    return RequestRecord(index=spec.index, start=start, end=end, chunk_times=tuple(chunk_times),
                         input_len=spec.input_len, output_len=spec.output_len,
                         prompt_tokens=getattr(usage, "prompt_tokens", None),
                         completion_tokens=getattr(usage, "completion_tokens", None), error=error,
                         generated_text="".join(pieces))


async def _first_model(client: Any, url: str) -> str:
    try:
        page = await client.models.list()
        ids = [m.id for m in page.data]
    except Exception as exc:
        raise LoadtestError(f"cannot list the server's models: GET {url}/v1/models failed ({_describe(exc)}); "
                            "is the server up? (or pass --model ID)") from None
    if not ids:
        raise LoadtestError(f"GET {url}/v1/models lists no model; pass --model ID")
    return ids[0]


@dataclass(frozen=True)
class LoadtestResult:
    """A finished load test: the metrics (vLLM's keys), every request's record, what ran and where."""

    metrics: dict[str, Any]
    records: tuple[RequestRecord, ...]
    checked: Checked
    model: str
    environment: dict[str, Any]

    def table(self) -> str:
        o = self.checked.options
        return render_table(self.metrics, percentile_metrics=self.checked.percentile_metrics,
                            metric_percentiles=self.checked.metric_percentiles, max_concurrency=o.max_concurrency,
                            request_rate=o.request_rate, label=o.label)

    def as_json(self) -> dict[str, Any]:
        o = self.checked.options
        head = {"date": self.environment["date"], "backend": "openai-chat" if o.is_chat else "openai",
                "label": o.label, "model_id": self.model, "tokenizer_id": o.tokenizer, "base_url": o.url,
                "endpoint": o.endpoint, "num_prompts": o.num_prompts,
                "request_rate": "inf" if math.isinf(o.request_rate) else o.request_rate,
                "burstiness": o.burstiness, "max_concurrency": o.max_concurrency, "ignore_eos": o.ignore_eos,
                "random_input_len": o.random_input_len, "random_output_len": o.random_output_len,
                "random_range_ratio": o.random_range_ratio, "seed": o.seed,
                "percentile_metrics": ",".join(self.checked.percentile_metrics),
                "metric_percentiles": ",".join(f"{p:g}" for p in self.checked.metric_percentiles)}
        return {**head, **self.metrics, "environment": self.environment, **per_request_lists(self.records)}


def _environment(client_module: Any) -> dict[str, Any]:
    return {"date": _dt.datetime.now().strftime("%Y%m%d-%H%M%S"), "host": platform.node(),
            "python": platform.python_version(), "openai": getattr(client_module, "__version__", "?"),
            "cpus": os.cpu_count(), "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


async def run_loadtest(options: LoadtestOptions, *, log: Any = print) -> LoadtestResult:
    """Validate, build the dataset, warm up with one uncounted request, then send every request on its
    arrival schedule under the concurrency limit. Raises LoadtestError before the benchmark when a flag is
    bad or the server cannot answer the warm-up; failed requests during it are recorded, not raised."""
    import openai

    checked = validate(options)
    o = checked.options
    try:
        tokenizer = Tokenizer(o.tokenizer) if o.tokenizer else None
    except LoadtestError:
        raise
    except Exception as exc:  # no `tokenizers` package, a damaged tokenizer.json
        raise LoadtestError(f"--tokenizer: cannot load {o.tokenizer} ({type(exc).__name__}: {exc}); allowed: a "
                            "Hugging Face tokenizer folder, with the `tokenizers` package installed") from None
    specs = random_dataset(o, tokenizer)
    offsets = arrival_offsets(len(specs), o.request_rate, o.burstiness, o.seed)
    environment = _environment(openai)
    # a connection per request, as `vllm bench serve` opens a session per request: a pooled keep-alive connection
    # the server closed between two requests failed the second ("Server disconnected without sending a
    # response"), a fault of the client's reuse charged to the server (llama-server, 1 request in ~30)
    client = openai.AsyncOpenAI(base_url=f"{o.url}/v1", api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                                max_retries=0, timeout=o.request_timeout,
                                http_client=_one_connection_per_request(openai))
    try:
        model = o.model or await _first_model(client, o.url)
        log(f"Starting initial single prompt test run (model {model}, {o.endpoint}) ...")
        warm = await send_request(client, specs[0], checked, model, time.perf_counter())
        if not warm.ok:
            raise LoadtestError(f"the initial test request to {o.url}{o.endpoint} failed: {warm.error}")
        log("Initial test run completed. Starting main benchmark run...")
        log(f"Traffic request rate: {o.request_rate}, burstiness: {o.burstiness}, "
            f"maximum request concurrency: {o.max_concurrency}")
        limits = asyncio.Semaphore(o.max_concurrency) if o.max_concurrency else None

        async def one(spec: RequestSpec, at: float, t0: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            if limits is None:
                return await send_request(client, spec, checked, model, t0)
            async with limits:
                return await send_request(client, spec, checked, model, t0)

        t0 = time.perf_counter()
        records = await asyncio.gather(*(one(s, at, t0) for s, at in zip(specs, offsets)))
        duration = time.perf_counter() - t0
    finally:
        await client.close()
    if tokenizer is not None:  # a server that sent no usage: count its tokens as vLLM does, from the text
        records = [dataclasses.replace(r, text_tokens=len(tokenizer.encode(r.generated_text)))
                   if r.ok and r.completion_tokens is None else r for r in records]
    environment["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    metrics = compute_metrics(records, duration, percentile_metrics=checked.percentile_metrics,
                              metric_percentiles=checked.metric_percentiles, goodput=checked.goodput or None)
    return LoadtestResult(metrics, tuple(records), checked, model, environment)


def _one_connection_per_request(openai: Any) -> Any:
    """The `openai` client's own async HTTP client with no keep-alive pool (its HTTP library, httpx or httpx2,
    is the one that client is built on)."""
    import importlib

    http = importlib.import_module(openai.DefaultAsyncHttpxClient.__mro__[1].__module__.split(".")[0])
    return openai.DefaultAsyncHttpxClient(limits=http.Limits(max_connections=None, max_keepalive_connections=0))


def loadtest(options: LoadtestOptions, *, log: Any = print) -> LoadtestResult:
    """`run_loadtest` from synchronous code."""
    return asyncio.run(run_loadtest(options, log=log))


def result_path(result: LoadtestResult) -> Path:
    o = result.checked.options
    name = o.result_filename
    if name is None:
        rate = "inf" if math.isinf(o.request_rate) else f"{o.request_rate:g}"
        tag = (o.label or result.model).replace("/", "-")
        name = f"loadtest-{tag}-{rate}qps-c{o.max_concurrency or 'inf'}-{result.environment['date']}.json"
    return Path(o.result_dir or ".") / name


def main(options: LoadtestOptions) -> int:
    """The CLI: the table on stdout, the JSON with --save-result. Exit 0 when every request succeeded,
    1 when some failed or the server could not be loaded, 2 for a bad flag."""
    try:
        validate(options)
    except LoadtestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        result = loadtest(options, log=lambda line: print(line, flush=True))
    except LoadtestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if str(exc).startswith("--") else 1
    print(result.table(), flush=True)
    if options.save_result:
        path = result_path(result)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_result(str(path), result.as_json())
        print(f"written: {path}")
    return 0 if result.metrics["failed"] == 0 else 1
