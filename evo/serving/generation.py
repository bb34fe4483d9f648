"""A generation engine behind the Serve app's OpenAI-compatible routes (`evo.serving.app`).

`load_generator` starts the engine as the judge does (`evaluators.served.generator.ServedGenerator`: its
own confined process, the check replay, one engine loop batching every request the replica gets, the
guards, canaries and verification of `ServePolicy` on what it serves) and reads the checkpoint folder's
tokenizer, if it has one, on the replica's side: text in and out, the chat template and the end-of-text ids are the replica's job, the engine only
ever sees token ids. `answer` runs one `/v1/completions` or `/v1/chat/completions` request: parsed and
bounded by the verified domain (`evo.serving.openai_api`), streamed as server-sent events or answered
whole, refused with 429 and Retry-After when the engine's queue is full.

The engine is judged in Serve under the accuracy contract its run declared (`run_accuracy`: the record's judged
contract, else the run directory's `evaluator.accuracy`, else the preset's default), and /v1/engine reports the
replica's running estimate beside what the search judged (`evaluators.served.estimate`).
"""
# No `from __future__ import annotations`: FastAPI-facing types stay real.

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Dict

import yaml
from fastapi.responses import JSONResponse, StreamingResponse

from evaluators.served.generator import Overloaded, RequestError, ServedGenerator, ServedGeneratorError
from evaluators.served.guards import ServePolicy
from evaluators.settings import BUDGET_KEYS, EvaluatorSettings
from evo.core import code
from evo.core.records import null_for_nan
from evo.serving import openai_api
from evo.serving.completion_stream import Piece, pieces
from evo.serving.openai_api import Answer, Job, Limits, OpenAIError
from evo.serving.source import EngineRecord
from evo.serving.text import TextCodec
from evo.workloads import get_workload

RETRY_AFTER_S = 1


@dataclass(frozen=True)
class LoadedGenerator:
    record: EngineRecord
    engine: ServedGenerator  # the engine's confined process and its loop
    limits: Limits
    device: str
    check_message: str
    loaded_at: float
    max_batch: int = 1  # no batch axis: the engine batches requests itself

    @property
    def text(self) -> Any:
        return self.limits.text

    def info(self) -> dict[str, Any]:
        """What /v1/engine says of the generation engine besides the record and the claim."""
        engine = self.engine
        return {"contract": "generation",
                "openai": {"model": self.limits.model, "routes": ["POST /v1/completions", "POST /v1/chat/completions",
                                                                  "GET /v1/models"],
                           "tokenizer": self.text.folder if self.text else None,
                           "chat_template": bool(self.text and self.text.has_chat_template),
                           "sampling": engine.sampling, "sampling_check": engine.sampling_check or "passed"},
                "limits": {"max_prompt_tokens": self.limits.max_prompt, "max_tokens": self.limits.max_tokens,
                           "vocab": self.limits.vocab, "max_waiting_requests": engine.max_waiting},
                "running": engine.running, "stats": dict(engine.stats),
                # what it is held to while it serves: policy, judged figures, stall bound, slowness, verifier
                "guards": engine.guard_info(),
                # the accuracy contract: the replica's running estimate, and what the search judged (if recorded)
                "accuracy": {**engine.estimate.info(),
                             "judged": null_for_nan(dict(getattr(self.record, "accuracy", None) or {}))},
                # a genome's code in this replica's interpreter: none, and none may be (it is the engine's client)
                "replica_engine_code": {"allowed": code.engine_code_allowed(),
                                        "loaded": sorted(m for m in sys.modules if m.startswith(code.MODULE_PREFIX))}}


def _tokenizer(workload, preset) -> TextCodec | None:
    """The tokenizer of the first folder the engine reads (its checkpoint) that has one."""
    for folder in workload.engine_files(preset):
        if os.path.isdir(folder):
            codec = TextCodec.from_folder(folder)
            if codec is not None:
                return codec
    return None


def model_id(record: EngineRecord, codec: TextCodec | None, name: str | None) -> str:
    """The id clients name in `model`: the configured name, else the checkpoint folder's name, else WORKLOAD/PRESET."""
    if name:
        return name
    if codec is not None:
        return os.path.basename(os.path.normpath(codec.folder))
    return f"{record.workload}/{record.preset}"


def run_accuracy(record: EngineRecord) -> Dict[str, Any]:
    """The accuracy contract the engine's run judged it under, as the Serve-side judge's `evaluator.accuracy`:
    - the record's judged contract (`EngineRecord.accuracy`: its mode and, in budget mode, every bound of the budget
      the search used, so a calibrated budget is not recalibrated; a bound that is no positive number, a calibrated
      min_agreement of 0, is left to the calibration, which is deterministic);
    - else, for a run directory, `evaluator.accuracy` in its config.yaml;
    - else {}: the preset's default (exact at float32/float64, a calibrated budget below), as for a run that
      declared nothing.
    ValueError naming the file when a run directory's config cannot be read."""
    judged = getattr(record, "accuracy", None) or {}
    if judged.get("mode") == "exact":
        return {"mode": "exact"}
    if judged.get("mode") == "budget":
        budget = judged.get("budget") or {}
        return {"mode": "budget", **{k: float(budget[k]) for k in BUDGET_KEYS if _positive(budget.get(k))}}
    path = Path(record.source) / "config.yaml"
    if not path.is_file():
        return {}
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: cannot read the run's config for its accuracy contract: {exc}") from exc
    evaluator = config.get("evaluator") if isinstance(config, dict) else None
    return dict((evaluator or {}).get("accuracy") or {}) if isinstance(evaluator or {}, dict) else {}


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def load_generator(record: EngineRecord, sandbox: str, max_waiting: int, served_name: str | None,
                   policy: ServePolicy | None = None) -> LoadedGenerator:
    """Start, check and open the generation engine, judged under its run's accuracy contract (`run_accuracy`);
    ServedGeneratorError or ValueError when it will not serve."""
    workload = get_workload(record.workload)
    preset = workload.presets()[record.preset]
    codec = _tokenizer(workload, preset)
    settings = EvaluatorSettings(sandbox=sandbox, accuracy=run_accuracy(record))
    engine = ServedGenerator(record.workload, record.preset, record.genome.to_json(), record.sources, settings,
                             max_waiting=max_waiting, policy=policy)
    if codec is not None and any(not 0 <= t < engine.vocab for t in codec.eos_ids):
        engine.close()
        raise ValueError(f"the tokenizer in {codec.folder!r} ends text with ids {list(codec.eos_ids)}, outside the "
                         f"model's vocabulary [0, {engine.vocab - 1}]: fix its tokenizer or generation_config.json")
    limits = Limits(model_id(record, codec, served_name), engine.max_prompt, engine.max_tokens, engine.vocab, codec,
                    engine.sampling)
    message = (f"passed the judge's check replay (every request scored against the float64 reference's tokens) in a "
               f"{sandbox} sandbox; seeded sampling: {engine.sampling_check or 'passed'}; guards scaled by "
               f"{engine.judged.source}; accuracy contract: {_contract(engine)}")
    return LoadedGenerator(record, engine, limits, engine.judge.device, message, time.time())


def _contract(engine: ServedGenerator) -> str:
    """The mode the engine is judged under in Serve, and where its budget comes from."""
    contract = engine.judge.generation.accuracy
    if contract.budget is None:
        return "exact (every checked token the rule's pick or a near tie with it)"
    return (f"budget (a running estimate over the requests the replica checks; the budget's basis: "
            f"{contract.budget.basis})")


def openai_error(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), exc.status, headers=exc.headers or None)


def _refusal(exc: Exception, chat: bool = False) -> OpenAIError:
    """What the engine's loop refused at submit, as OpenAI's error (the field named as the client sent it)."""
    if isinstance(exc, Overloaded):
        return OpenAIError(None, f"the engine is busy: {exc}; retry after {RETRY_AFTER_S} s", 429,
                           "rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, RequestError):
        param = str(exc).split(":", 1)[0].split(",")[0].strip()
        param = {"prompt": "messages" if chat else "prompt", "stop": "stop_token_ids"}.get(param, param)
        return OpenAIError(param, str(exc))
    return OpenAIError(None, f"the engine serves no more: {exc}", 503, "service_unavailable")


async def answer(loaded: LoadedGenerator, body: Any, chat: bool, on_done: Callable,
                 on_failure: Callable[[LoadedGenerator, str], None]):
    """The response to one completions request (see the module)."""
    try:
        job = openai_api.parse(body, loaded.limits, chat)
    except OpenAIError as exc:
        return openai_error(exc)
    made = pieces(loaded.engine, job, loaded.text, lambda request, tokens: on_done(loaded, request, tokens))
    try:
        first = await made.__anext__()  # refusals at submit become their status before any byte is sent
    except (Overloaded, RequestError) as exc:
        return openai_error(_refusal(exc, chat))
    except ServedGeneratorError as exc:
        on_failure(loaded, str(exc))
        return openai_error(_refusal(exc))
    answered = Answer.new(loaded.limits.model, chat)
    if job.stream:
        return StreamingResponse(_events(answered, job, first, made, loaded, on_failure), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    texts, tokens, finish = [first.text], list(first.token_ids), first.finish
    try:
        async for piece in made:
            texts.append(piece.text)
            tokens += piece.token_ids
            finish = piece.finish
    except ServedGeneratorError as exc:
        on_failure(loaded, str(exc))
        return openai_error(_refusal(exc))
    return JSONResponse(openai_api.completion(answered, "".join(texts), tokens, finish or "length", len(job.prompt)))


async def _events(answered: Answer, job: Job, first: Piece, rest: AsyncIterator[Piece], loaded: LoadedGenerator,
                  on_failure: Callable) -> AsyncIterator[bytes]:
    """The stream: one chunk per token (its text and id), the finish reason on the last, the usage chunk when
    asked for, then [DONE]. A client that goes away cancels this generator, and with it the request."""
    made = len(first.token_ids)
    yield openai_api.sse(openai_api.chunk(answered, first.text, first.token_ids, first.finish, first=True))
    try:
        async for piece in rest:
            made += len(piece.token_ids)
            yield openai_api.sse(openai_api.chunk(answered, piece.text, piece.token_ids, piece.finish))
    except ServedGeneratorError as exc:
        on_failure(loaded, str(exc))
        yield openai_api.sse(OpenAIError(None, f"the engine failed mid-stream: {exc}", 503, "service_unavailable").body())
        return
    finally:
        await rest.aclose()
    if job.include_usage:
        yield openai_api.sse(openai_api.usage_chunk(answered, len(job.prompt), made))
    yield openai_api.sse("[DONE]")


def close(loaded: LoadedGenerator, drain_s: float) -> None:
    """Retire the engine once its in-flight requests finished (at most `drain_s`), then kill it."""
    loaded.engine.close(drain_s=drain_s)


def snippet(record: EngineRecord, url: str, served_name: str | None = None) -> str:
    """How to call the served generation engine: a streaming curl and the `openai` client, as `evo serve` prints."""
    workload = get_workload(record.workload)
    codec = _tokenizer(workload, workload.presets()[record.preset])
    model = model_id(record, codec, served_name)
    prompt = '"Once upon a time"' if codec is not None else "[1, 2, 3]"
    curl = (f"curl -N {url}/v1/completions -H 'Content-Type: application/json' -d '{{\"model\": \"{model}\", "
            f"\"prompt\": {prompt}, \"max_tokens\": 8, \"stream\": true}}'")
    client = (f"python -c 'from openai import OpenAI; c = OpenAI(base_url=\"{url}/v1\", api_key=\"none\"); "
              f"r = c.completions.create(model=\"{model}\", prompt={prompt}, max_tokens=8); "
              f"print(r.choices[0].text, r.choices[0].model_extra[\"token_ids\"], r.usage)'")
    return f"{curl}\n  {client}"
