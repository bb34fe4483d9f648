"""One chat call to an OpenAI-compatible endpoint (OpenAI, vLLM, SGLang, Ollama), with its cost.

`ChatClient.chat` sends the messages through the `openai` client and returns a `ChatReply` or raises
`LlmError`, whose `kind` says what went wrong and whose `usage` says what the failed call still cost.
`Usage` values add up; `Budget.exhausted` says in words when a total has reached a limit. `redact`
removes API keys from text before it is logged or stored.

This module imports neither Ray nor MLflow nor torch, and `openai` only when a call is made (it takes
~2 s to import: every agent process and the driver import this module).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

LOCAL_KEY = "not-needed"  # sent when the key variable is unset: local servers ignore the key
ERROR_KINDS = ("rate_limited", "timeout", "connection", "http", "malformed", "over_limit", "empty")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_KEY_PATTERNS = (re.compile(r"sk-[A-Za-z0-9_-]{8,}"), re.compile(r"Bearer \S+"))
_EXCERPT = 300  # characters of a server body quoted in an error


def _check_keys(cls: type, data: object) -> Mapping[str, Any]:
    """`data` as a mapping whose keys are all fields of `cls`; ValueError listing the allowed ones."""
    names = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(data, Mapping):
        raise ValueError(f"{cls.__name__} expects a mapping with keys from {names}, got {type(data).__name__}")
    unknown = sorted(str(k) for k in data if k not in names)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} for {cls.__name__}; allowed: {names}")
    return data


def _number(owner: str, name: str, value: object, *, integer: bool = False, minimum: float = 0.0,
            optional: bool = False) -> None:
    if value is None and optional:
        return
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or value < minimum:
        what = "an integer" if integer else "a finite number"
        none = " or None (unlimited)" if optional else ""
        raise ValueError(f"{owner}.{name} must be {what} >= {minimum:g}{none}, got {value!r}")


@dataclass(frozen=True)
class Price:
    """What a model costs, in US dollars per million tokens."""

    input_per_mtok: float = 0.0  # prompt tokens
    output_per_mtok: float = 0.0  # completion tokens

    def __post_init__(self) -> None:
        _number("Price", "input_per_mtok", self.input_per_mtok)
        _number("Price", "output_per_mtok", self.output_per_mtok)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Price:
        return cls(**_check_keys(cls, data))

    def cost(self, tokens_in: int, tokens_out: int) -> float:
        return tokens_in * self.input_per_mtok / 1e6 + tokens_out * self.output_per_mtok / 1e6


@dataclass(frozen=True)
class LlmSettings:
    """Where the model is served and how to ask it; read from the `llm:` mapping of a config."""

    base_url: str = "http://127.0.0.1:11434/v1"  # Ollama's default; OpenAI: https://api.openai.com/v1
    model: str = "qwen2.5-coder:7b"  # the model name the server knows
    api_key_env: str = "OPENAI_API_KEY"  # NAME of the env var holding the key; unset -> "not-needed" (local servers)
    timeout_s: float = 120.0  # per HTTP request (each retry gets its own)
    max_retries: int = 2  # the openai client's own retries (429 with retry-after, 5xx, timeouts, connection errors)
    temperature: float = 0.7  # sampling temperature, 0..2
    max_tokens: int = 4096  # most tokens per reply (sent as max_tokens); more -> LlmError over_limit
    prices: Mapping[str, Price] = field(default_factory=dict)  # model -> price; a model without one costs 0

    def __post_init__(self) -> None:
        if not isinstance(self.base_url, str) or not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"LlmSettings.base_url must be an http:// or https:// URL such as "
                             f"'http://127.0.0.1:11434/v1' (Ollama) or 'https://api.openai.com/v1', got {self.base_url!r}")
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError(f"LlmSettings.model must be a non-empty model name, got {self.model!r}")
        if not isinstance(self.api_key_env, str) or not _ENV_NAME.fullmatch(self.api_key_env):
            # not echoed: a value that is no variable name may be the key itself
            raise ValueError("LlmSettings.api_key_env must be the NAME of the environment variable that holds the "
                             "key (e.g. OPENAI_API_KEY), not the key; the value given is not a variable name "
                             "(not shown, in case it is a key)")
        _number("LlmSettings", "timeout_s", self.timeout_s, minimum=1e-3)
        _number("LlmSettings", "max_retries", self.max_retries, integer=True)
        _number("LlmSettings", "temperature", self.temperature)
        if self.temperature > 2:
            raise ValueError(f"LlmSettings.temperature must be in 0..2, got {self.temperature!r}")
        _number("LlmSettings", "max_tokens", self.max_tokens, integer=True, minimum=1)
        if not isinstance(self.prices, Mapping):
            raise ValueError(f"LlmSettings.prices must map model names to Price, got {type(self.prices).__name__}")
        prices = {}
        for model, price in self.prices.items():
            if not isinstance(price, Price):
                raise ValueError(f"LlmSettings.prices[{model!r}] must be a Price (from_dict takes "
                                 f"{{input_per_mtok: ..., output_per_mtok: ...}}), got {price!r}")
            prices[str(model)] = price
        object.__setattr__(self, "prices", prices)  # a private copy: the caller's dict may change

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LlmSettings:
        """From a YAML mapping; `prices` as {model: {input_per_mtok: ..., output_per_mtok: ...}}."""
        values = dict(_check_keys(cls, data))
        prices = values.get("prices") or {}
        if not isinstance(prices, Mapping):
            raise ValueError(f"LlmSettings.prices must be a mapping {{model: {{input_per_mtok: ..., "
                             f"output_per_mtok: ...}}}}, got {type(prices).__name__}")
        values["prices"] = {m: p if isinstance(p, Price) else Price.from_dict(p) for m, p in prices.items()}
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["prices"] = {m: dataclasses.asdict(p) for m, p in self.prices.items()}
        return data

    def price(self, *models: str) -> Price | None:
        """The price of the first of `models` that has one."""
        return next((self.prices[m] for m in models if m in self.prices), None)


@dataclass(frozen=True)
class Usage:
    """What calls cost; values add up with `+`."""

    calls: int = 0
    tokens_in: int = 0  # prompt tokens, as the server reported them
    tokens_out: int = 0  # completion tokens, as the server reported them
    cost_usd: float = 0.0
    wall_s: float = 0.0  # seconds spent waiting, retries included

    def __add__(self, other: object) -> Usage:
        if not isinstance(other, Usage):
            return NotImplemented
        return Usage(self.calls + other.calls, self.tokens_in + other.tokens_in, self.tokens_out + other.tokens_out,
                     self.cost_usd + other.cost_usd, self.wall_s + other.wall_s)

    @property
    def tokens(self) -> int:
        return self.tokens_in + self.tokens_out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Usage:
        return cls(**_check_keys(cls, data))


@dataclass(frozen=True)
class Budget:
    """Limits on the total `Usage` of an agent; None = unlimited."""

    max_calls: int | None = None
    max_tokens: int | None = None  # prompt + completion tokens
    max_cost_usd: float | None = None
    max_wall_s: float | None = None  # seconds spent waiting on the model

    def __post_init__(self) -> None:
        _number("Budget", "max_calls", self.max_calls, integer=True, optional=True)
        _number("Budget", "max_tokens", self.max_tokens, integer=True, optional=True)
        _number("Budget", "max_cost_usd", self.max_cost_usd, optional=True)
        _number("Budget", "max_wall_s", self.max_wall_s, optional=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Budget:
        return cls(**_check_keys(cls, data))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def exhausted(self, spent: Usage) -> str | None:
        """Why `spent` has reached a limit (e.g. "spent 10 of 10 calls"), or None while all are left."""
        if self.max_calls is not None and spent.calls >= self.max_calls:
            return f"spent {spent.calls} of {self.max_calls} calls"
        if self.max_tokens is not None and spent.tokens >= self.max_tokens:
            return f"spent {spent.tokens} of {self.max_tokens} tokens (prompt + completion)"
        if self.max_cost_usd is not None and spent.cost_usd >= self.max_cost_usd:
            return f"spent ${spent.cost_usd:.4f} of ${self.max_cost_usd:.4f}"
        if self.max_wall_s is not None and spent.wall_s >= self.max_wall_s:
            return f"spent {spent.wall_s:.1f} of {self.max_wall_s:.1f} s waiting on the model"
        return None


@dataclass(frozen=True)
class ChatReply:
    text: str  # the assistant message content
    finish_reason: str  # "stop", or what the server said
    model: str  # the model the server says answered
    usage: Usage  # this call: calls=1, tokens, cost, wall time
    priced: bool  # False when the model has no price in the settings (cost_usd is then 0)


class LlmError(Exception):
    """A chat call that gave no usable reply. `kind` is one of ERROR_KINDS; `usage` is what it still cost."""

    def __init__(self, kind: str, message: str, usage: Usage = Usage()) -> None:
        if kind not in ERROR_KINDS:
            raise ValueError(f"LlmError kind must be one of {list(ERROR_KINDS)}, got {kind!r}")
        super().__init__(kind, message, usage)  # all in args, so the error pickles (Ray)
        self.kind, self.message, self.usage = kind, message, usage

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


def redact(text: str, secrets: Iterable[str]) -> str:
    """`text` with every secret of 4+ characters, every `sk-...` key and every `Bearer ...` token
    replaced by [REDACTED]."""
    for secret in sorted((s for s in secrets if s and len(s) >= 4), key=len, reverse=True):
        text = text.replace(secret, "[REDACTED]")
    text = _KEY_PATTERNS[0].sub("[REDACTED]", text)
    return _KEY_PATTERNS[1].sub("Bearer [REDACTED]", text)


class ChatClient:
    """Chat with the model `settings` names. The openai client is built on first use, so a ChatClient
    pickles (it can be handed to a Ray actor) and each process builds its own connection pool."""

    def __init__(self, settings: LlmSettings, environ: Mapping[str, str] | None = None) -> None:
        self.settings = settings
        environ = os.environ if environ is None else environ
        self._key = environ.get(settings.api_key_env) or None
        self._client: openai.OpenAI | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}

    def secrets(self) -> tuple[str, ...]:
        """The API key, if one was set, for `redact`."""
        return (self._key,) if self._key else ()

    def _openai(self) -> openai.OpenAI:
        import openai

        if self._client is None:
            s = self.settings
            self._client = openai.OpenAI(base_url=s.base_url, api_key=self._key or LOCAL_KEY,
                                         timeout=s.timeout_s, max_retries=s.max_retries)
        return self._client

    def chat(self, messages: list[dict], seed: int | None = None) -> ChatReply:
        """One completion of `messages`; raises LlmError (carrying the call's usage) when there is no usable text."""
        import openai

        s = self.settings
        extra = {} if seed is None else {"seed": seed}
        started = time.monotonic()
        try:
            completion = self._openai().chat.completions.create(
                model=s.model, messages=messages, temperature=s.temperature, max_tokens=s.max_tokens, **extra)
        except openai.OpenAIError as exc:
            raise self._error(*_classify(exc, s), Usage(calls=1, wall_s=time.monotonic() - started)) from exc
        except ValueError as exc:  # a 200 whose body is not JSON (json.JSONDecodeError)
            body = getattr(exc, "doc", "")
            raise self._error("malformed", f"the server at {s.base_url} answered 200 with a body that is not JSON "
                                           f"({exc}); body starts: {body[:_EXCERPT]!r}",
                              Usage(calls=1, wall_s=time.monotonic() - started)) from exc
        return self._reply(completion, time.monotonic() - started)

    def _reply(self, completion: object, wall_s: float) -> ChatReply:
        from openai.types.chat import ChatCompletion

        s = self.settings
        if not isinstance(completion, ChatCompletion):  # a non-JSON content type comes back as str
            raise self._error("malformed", f"the server at {s.base_url} answered 200 with something that is not a "
                                           f"chat completion: {str(completion)[:_EXCERPT]!r}",
                              Usage(calls=1, wall_s=wall_s))
        model = getattr(completion, "model", None) or s.model
        reported = getattr(completion, "usage", None)
        tokens_in = _count(getattr(reported, "prompt_tokens", 0))
        tokens_out = _count(getattr(reported, "completion_tokens", 0))
        price = s.price(s.model, model)
        cost = price.cost(tokens_in, tokens_out) if price else 0.0
        usage = Usage(calls=1, tokens_in=tokens_in, tokens_out=tokens_out, cost_usd=cost, wall_s=wall_s)
        choices = getattr(completion, "choices", None)
        if not isinstance(choices, list) or not choices:
            raise self._error("malformed", f"the reply from {s.base_url} has no choices: "
                                           f"{_dump(completion)[:_EXCERPT]!r}", usage)
        choice = choices[0]
        finish = getattr(choice, "finish_reason", None) or ""
        text = getattr(getattr(choice, "message", None), "content", None)
        if tokens_out > s.max_tokens or finish == "length":
            raise self._error("over_limit", f"the reply was cut or too long: finish_reason={finish!r}, "
                                            f"{tokens_out} completion tokens, max_tokens={s.max_tokens}", usage)
        if not isinstance(text, str) or not text.strip():
            raise self._error("empty", f"the reply from {model} has no text (content={text!r}, "
                                       f"finish_reason={finish!r})", usage)
        return ChatReply(text=text, finish_reason=str(finish), model=str(model), usage=usage, priced=price is not None)

    def _error(self, kind: str, message: str, usage: Usage) -> LlmError:
        return LlmError(kind, redact(message, self.secrets()), usage)


def _classify(exc: openai.OpenAIError, settings: LlmSettings) -> tuple[str, str]:
    """(kind, message) for an exception of the openai client (raised after its own retries)."""
    import openai

    where = settings.base_url
    tries = f"after {settings.max_retries + 1} attempt(s)"
    if isinstance(exc, openai.RateLimitError):
        return "rate_limited", f"HTTP 429 from {where} {tries}: {_body(exc)}"
    if isinstance(exc, openai.APITimeoutError):
        return "timeout", f"no answer from {where} within timeout_s={settings.timeout_s} {tries}"
    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__ or exc
        return "connection", f"cannot reach {where} {tries}: {type(cause).__name__}: {cause}"
    if isinstance(exc, openai.APIStatusError):
        return "http", f"HTTP {exc.status_code} from {where}: {_body(exc)}"
    return "http", f"{type(exc).__name__} from {where}: {exc}"


def _body(exc: openai.APIStatusError) -> str:
    try:
        text = exc.response.text
    except Exception:  # a streamed body that was never read
        text = str(exc)
    text = " ".join(text.split())
    return text[:_EXCERPT] + ("..." if len(text) > _EXCERPT else "")


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _dump(completion: Any) -> str:
    try:
        return json.dumps(completion.model_dump(exclude_unset=True), default=str)
    except Exception:
        return repr(completion)
