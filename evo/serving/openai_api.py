"""OpenAI-compatible requests and answers for a served generation engine (no Ray, no HTTP here).

`parse` turns a `/v1/completions` or `/v1/chat/completions` body into a `Job` the engine can run, or
raises `OpenAIError` naming the parameter, what was received and what is allowed. The bounds are the
verified domain's: the prompt's length (P), `max_tokens` (N), token ids inside the vocabulary, and
greedy decoding unless the engine passed the sampling check. The answers (`completion`, `chunk`,
`usage`) have OpenAI's shapes; each choice also carries the `token_ids` it generated (as vLLM's
`return_token_ids` does), the only output a model without a tokenizer has.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from evo.workloads.generation import MIN_TEMPERATURE

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
MAX_STOP_STRINGS = 4
# the bodies the routes take, named in their errors (a malformed body, say)
COMPLETION_BODY = '{"model": ..., "prompt": "text" or [token ids], "max_tokens": ...}'
CHAT_BODY = '{"model": ..., "messages": [{"role": "user", "content": "..."}], "max_tokens": ...}'
MAX_CHARS_PER_TOKEN = 64  # a text past P times this is refused before it is tokenized
# parameters OpenAI defines that this server does not implement: refused unless absent, null or the default
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
               "suffix": (None,), "logit_bias": (None,), "tools": (None,), "tool_choice": (None, "none"),
               "functions": (None,), "response_format": (None,), "presence_penalty": (None, 0), "frequency_penalty": (None, 0)}


class OpenAIError(ValueError):
    """An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, param: str | None, message: str, status: int = 400, kind: str = "invalid_request_error",
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.param, self.message, self.status, self.kind, self.code = param, message, status, kind, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """What the served engine was verified for, and what the replica can do around it."""

    model: str  # the id clients name in `model`
    max_prompt: int  # P
    max_tokens: int  # N
    vocab: int  # V
    text: Any = None  # an evo.serving.text.TextCodec, or None: token ids only
    sampling: bool = False  # the engine passed the sampling check: temperature > 0 and top_p < 1 are served


@dataclass(frozen=True)
class Job:
    """One request as the engine runs it, and how the replica answers it."""

    chat: bool
    prompt: tuple[int, ...]
    max_tokens: int
    stop_ids: tuple[int, ...]  # the engine stops at these (end-of-text unless ignore_eos, and stop_token_ids)
    stop_texts: tuple[str, ...]  # the replica cuts the text at these and aborts the request
    stream: bool
    include_usage: bool
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


def _integer(body: Mapping, name: str, low: int, high: int, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if type(value) is not int or not low <= value <= high:
        raise OpenAIError(name, f"'{name}' must be an integer from {low} to {high} (the verified bound), got {value!r}")
    return value


def _number(body: Mapping, name: str, low: float, high: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if type(value) not in (int, float) or not low <= value <= high:
        raise OpenAIError(name, f"'{name}' must be a number from {low:g} to {high:g}, got {value!r}")
    return float(value)


def _token_ids(value: Any, vocab: int, param: str) -> list[int]:
    if not all(type(t) is int for t in value):
        raise OpenAIError(param, f"'{param}' as token ids must be a list of integers, got {value!r}"[:300])
    bad = next((t for t in value if not 0 <= t < vocab), None)
    if bad is not None:
        raise OpenAIError(param, f"'{param}' holds token id {bad}, outside the vocabulary [0, {vocab - 1}]")
    return list(value)


def _prompt(body: Mapping, limits: Limits, chat: bool) -> list[int]:
    if chat:
        if limits.text is None or not limits.text.has_chat_template:
            raise OpenAIError("messages", f"model {limits.model!r} has no chat template (its checkpoint folder has "
                                          f"{'no tokenizer' if limits.text is None else 'a tokenizer without one'}); "
                                          f"use /v1/completions")
        messages = body.get("messages")
        if isinstance(messages, list) and sum(len(str(m)) for m in messages) > limits.max_prompt * MAX_CHARS_PER_TOKEN:
            raise OpenAIError("messages", f"the messages are far longer than the {limits.max_prompt} prompt tokens this "
                                          f"engine is verified for")
        try:
            ids = limits.text.chat(messages)
        except ValueError as exc:
            raise OpenAIError("messages", str(exc)) from None
        where = "messages"
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if limits.text is None:
                raise OpenAIError("prompt", f"model {limits.model!r} has no tokenizer: send the prompt as a list of "
                                            f"token ids in [0, {limits.vocab - 1}]")
            if len(prompt) > limits.max_prompt * MAX_CHARS_PER_TOKEN:  # refused before the tokenizer reads it
                raise OpenAIError("prompt", f"the prompt is {len(prompt)} characters, far more than the "
                                            f"{limits.max_prompt} tokens this engine is verified for")
            ids = limits.text.encode(prompt)
        elif isinstance(prompt, list) and prompt and not isinstance(prompt[0], (str, list)):
            if len(prompt) > limits.max_prompt:
                raise OpenAIError("prompt", f"the prompt is {len(prompt)} tokens; this engine is verified for prompts "
                                            f"of 1 to {limits.max_prompt} tokens")
            ids = _token_ids(prompt, limits.vocab, "prompt")
        else:
            raise OpenAIError("prompt", f"'prompt' must be a string{' or' if limits.text else ''} a list of token ids "
                                        f"(one prompt: n=1, no batches), got {str(prompt)[:100]!r}")
        where = "prompt"
    if not 1 <= len(ids) <= limits.max_prompt:
        raise OpenAIError(where, f"the prompt is {len(ids)} tokens; this engine is verified for prompts of 1 to "
                                 f"{limits.max_prompt} tokens")
    return ids


def _stops(body: Mapping, limits: Limits) -> tuple[tuple[str, ...], tuple[int, ...]]:
    stop = body.get("stop")
    texts: list[str] = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not (isinstance(texts, list) and len(texts) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in texts)):
        raise OpenAIError("stop", f"'stop' must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them, "
                                  f"got {stop!r}"[:300])
    if texts and limits.text is None:
        raise OpenAIError("stop", f"model {limits.model!r} has no tokenizer: stop strings cannot be matched; use "
                                  f"'stop_token_ids'")
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list):
        raise OpenAIError("stop_token_ids", f"'stop_token_ids' must be a list of token ids, got {ids!r}")
    ids = _token_ids(ids, limits.vocab, "stop_token_ids")
    ignore_eos = body.get("ignore_eos") or False
    if type(ignore_eos) is not bool:
        raise OpenAIError("ignore_eos", f"'ignore_eos' must be true or false, got {ignore_eos!r}")
    if not ignore_eos and limits.text is not None:
        ids += [t for t in limits.text.eos_ids if t not in ids]
    return tuple(texts), tuple(ids)


def parse(body: Any, limits: Limits, chat: bool) -> Job:
    """The body of a completions (or chat completions) request as a Job; OpenAIError names what is wrong."""
    if not isinstance(body, dict):
        raise OpenAIError(None, f"the body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model != limits.model:
        raise OpenAIError("model", f"The model {model!r} does not exist; this server serves {limits.model!r} "
                                   f"(GET /v1/models)", 404, code="model_not_found")
    for name, defaults in UNSUPPORTED.items():
        if name in body and body[name] not in defaults:
            raise OpenAIError(name, f"'{name}' is not supported by this server; leave it out")
    if body.get("n") not in (None, 1) or isinstance(body.get("n"), bool):
        raise OpenAIError("n", f"'n' must be 1 (one choice per request), got {body.get('n')!r}")
    prompt = _prompt(body, limits, chat)
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, key, 1, limits.max_tokens,
                          limits.max_tokens if chat else min(DEFAULT_COMPLETION_TOKENS, limits.max_tokens))
    temperature = _number(body, "temperature", 0.0, 2.0, 1.0 if limits.sampling else 0.0)
    if temperature < MIN_TEMPERATURE:
        temperature = 0.0  # greedy in all but name
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:
        raise OpenAIError("top_p", "'top_p' must be above 0 (up to 1)")
    if not limits.sampling and (temperature > 0 or top_p < 1):
        param = "temperature" if temperature > 0 else "top_p"
        raise OpenAIError(param, f"this engine is verified for greedy decoding only: 'temperature' must be 0 and "
                                 f"'top_p' 1, got temperature {temperature:g}, top_p {top_p:g}")
    seed = body.get("seed")
    if seed is not None and (type(seed) is not int or not 0 <= seed < 2 ** 63):
        raise OpenAIError("seed", f"'seed' must be an integer from 0 to 2**63 - 1, got {seed!r}")
    stream = body.get("stream") or False
    if type(stream) is not bool:
        raise OpenAIError("stream", f"'stream' must be true or false, got {stream!r}")
    options = body.get("stream_options") or {}
    if (not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}
            or any(type(v) not in (bool, type(None)) for v in options.values())):
        raise OpenAIError("stream_options", f"'stream_options' may hold 'include_usage': true or false, got {options!r}")
    texts, ids = _stops(body, limits)
    if seed is None:
        seed = uuid.uuid4().int % 2 ** 63  # unseeded sampling: a fresh draw
    return Job(chat, tuple(prompt), max_tokens, ids, texts, stream, bool(options.get("include_usage")),
               temperature, top_p, seed)


# ---------------------------------------------------------------------------------------------- answers
@dataclass(frozen=True)
class Answer:
    """The identity every chunk of one answer repeats."""

    id: str
    created: int
    model: str
    chat: bool

    @classmethod
    def new(cls, model: str, chat: bool) -> Answer:
        return cls(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()), model, chat)

    @property
    def kind(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _choice(answer: Answer, text: str, token_ids: Sequence[int], finish: str | None, delta: bool,
            first: bool = False) -> dict[str, Any]:
    if not answer.chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "token_ids": list(token_ids)}
    content = {"role": "assistant", "content": text} if not delta or first else {"content": text}
    return {"index": 0, "delta" if delta else "message": content, "logprobs": None, "finish_reason": finish,
            "token_ids": list(token_ids)}


def completion(answer: Answer, text: str, token_ids: Sequence[int], finish: str, prompt_tokens: int) -> dict:
    """The whole answer of a request without `stream`."""
    return {"id": answer.id, "object": answer.kind, "created": answer.created, "model": answer.model,
            "choices": [_choice(answer, text, token_ids, finish, delta=False)],
            "usage": usage(prompt_tokens, len(token_ids))}


def chunk(answer: Answer, text: str, token_ids: Sequence[int], finish: str | None, first: bool = False) -> dict:
    """One streamed piece: the new text and token ids, and the finish reason on the last."""
    return {"id": answer.id, "object": f"{answer.kind}.chunk" if answer.chat else answer.kind,
            "created": answer.created, "model": answer.model,
            "choices": [_choice(answer, text, token_ids, finish, delta=True, first=first)]}


def usage_chunk(answer: Answer, prompt_tokens: int, completion_tokens: int) -> dict:
    """The last chunk of a stream asked for with `stream_options: {"include_usage": true}`."""
    return {"id": answer.id, "object": f"{answer.kind}.chunk" if answer.chat else answer.kind,
            "created": answer.created, "model": answer.model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def sse(payload: Mapping | str) -> bytes:
    """One server-sent event: `data: <json>` (or the final `data: [DONE]`)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def models(model: str, created: int) -> dict:
    """GET /v1/models."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "evo"}]}
