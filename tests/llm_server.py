"""A scripted OpenAI-compatible chat server on 127.0.0.1, for tests that drive a real `openai` client.

`ScriptedLlmServer` answers `POST /v1/chat/completions` from a script: a sequence of `Step`s (the n-th
request gets the n-th step) or a function of the request body. A step can be a good reply, an HTTP
error with headers (429 + retry-after), a delay (client timeouts) or a verbatim body (malformed JSON).
It is a real socket, so processes other than the test's (Ray workers on this machine) can call it;
the script and the recorded `requests` live in the test's process.
"""
from __future__ import annotations

import itertools
import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Mapping, Sequence

from evo.core.code import START_MARK

CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class Step:
    """One scripted answer."""

    content: str = ""  # assistant message content
    status: int = 200  # HTTP status; anything but 200 sends an OpenAI-style {"error": {...}} body
    headers: Mapping[str, str] = field(default_factory=dict)  # extra response headers, e.g. {"retry-after": "0.2"}
    delay_s: float = 0.0  # wait before answering (to trigger client timeouts); cut short by stop()
    raw_body: str | None = None  # send this body verbatim instead of a chat.completion JSON
    completion_tokens: int | None = None  # reported usage; default len(content) // 4 + 1
    finish_reason: str = "stop"

    def __post_init__(self) -> None:
        if not isinstance(self.status, int) or not 100 <= self.status <= 599:
            raise ValueError(f"Step.status must be an HTTP status 100..599, got {self.status!r}")
        if self.delay_s < 0:
            raise ValueError(f"Step.delay_s must be >= 0 seconds, got {self.delay_s!r}")
        if self.completion_tokens is not None and self.completion_tokens < 0:
            raise ValueError(f"Step.completion_tokens must be >= 0 or None, got {self.completion_tokens!r}")


def prompt_tokens(body: Mapping[str, Any]) -> int:
    """A rough token count of a request's messages: characters // 4 + 1."""
    chars = 0
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):  # content parts: [{"type": "text", "text": ...}]
            chars += sum(len(part.get("text", "")) for part in content if isinstance(part, dict))
    return chars // 4 + 1


def completion_body(step: Step, body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat.completion object answering `body` with `step`."""
    tokens_in = prompt_tokens(body)
    tokens_out = step.completion_tokens if step.completion_tokens is not None else len(step.content) // 4 + 1
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model", "scripted"),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": step.content},
                     "finish_reason": step.finish_reason, "logprobs": None}],
        "usage": {"prompt_tokens": tokens_in, "completion_tokens": tokens_out,
                  "total_tokens": tokens_in + tokens_out},
    }


def _error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "scripted_error", "param": None, "code": status}}


class ScriptedLlmServer:
    """A loopback OpenAI-compatible server that answers from a script; use as a context manager."""

    def __init__(self, script: Sequence[Step] | Callable[[dict], Step], repeat_last: bool = True) -> None:
        if not callable(script):
            script = tuple(script)
            if not script or not all(isinstance(s, Step) for s in script):
                raise ValueError(f"script must be a non-empty sequence of Step or a callable(request) -> Step; "
                                 f"got {script!r}")
        self._script = script
        self._repeat_last = repeat_last
        self._lock = threading.Lock()
        self._served = 0  # chat requests answered so far (index of the next step)
        self._stopping = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.requests: list[dict] = []

    @property
    def url(self) -> str:
        """The base_url for an OpenAI client: http://127.0.0.1:<port>/v1."""
        if self._server is None:
            raise RuntimeError("ScriptedLlmServer has no address until start() is called")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> ScriptedLlmServer:
        if self._stopping.is_set():
            raise RuntimeError("this ScriptedLlmServer was stopped; create a new one")
        if self._server is not None:
            return self
        owner = self

        class Handler(_Handler):
            server_owner = owner

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="scripted-llm-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, wake handlers that are waiting out a delay, close the socket; idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        server, thread = self._server, self._thread
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=10)
        self._thread = None

    def __enter__(self) -> ScriptedLlmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _record(self, body: dict, headers: dict[str, str]) -> None:
        with self._lock:
            self.requests.append({**body, "_headers": headers})

    def _next_step(self, body: dict) -> Step | None:
        """The step for this request, or None when a sequence script is exhausted."""
        if callable(self._script):
            step = self._script(body)
            if not isinstance(step, Step):
                raise TypeError(f"the script callable must return a Step, returned {type(step).__name__}")
            return step
        with self._lock:
            index = self._served
            self._served += 1
        if index < len(self._script):
            return self._script[index]
        return self._script[-1] if self._repeat_last else None


class _Handler(BaseHTTPRequestHandler):
    server_owner: ScriptedLlmServer
    protocol_version = "HTTP/1.0"  # one request per connection: nothing lingers after stop()

    def log_message(self, format: str, *args: Any) -> None:  # silence the default stderr log
        pass

    def do_GET(self) -> None:
        self._send_json(404, _error_body(404, f"no route GET {self.path}; this server serves POST {CHAT_PATH}"))

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        if self.path.split("?")[0].rstrip("/") != CHAT_PATH:
            self._send_json(404, _error_body(404, f"no route POST {self.path}; this server serves POST {CHAT_PATH}"))
            return
        owner = self.server_owner
        try:
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError(f"expected a JSON object, got {type(body).__name__}")
        except ValueError as exc:
            owner._record({"_raw": raw.decode(errors="replace")}, self._header_dict())
            self._send_json(400, _error_body(400, f"request body is not a JSON object: {exc}"))
            return
        owner._record(body, self._header_dict())
        try:
            step = owner._next_step(body)
        except Exception as exc:  # a failing script callable is the test's bug: say so in the reply
            self._send_json(500, _error_body(500, f"script raised {type(exc).__name__}: {exc}"))
            return
        if step is None:
            self._send_json(500, _error_body(500, "script exhausted"))
            return
        if step.delay_s and owner._stopping.wait(step.delay_s):
            return  # stopping: drop the request
        if step.raw_body is not None:
            self._send(step.status, step.raw_body.encode(), step.headers)
        elif step.status != 200:
            message = step.content or f"scripted HTTP {step.status}"
            self._send_json(step.status, _error_body(step.status, message), step.headers)
        else:
            self._send_json(200, completion_body(step, body), step.headers)

    def _header_dict(self) -> dict[str, str]:
        return {key.lower(): value for key, value in self.headers.items()}

    def _send_json(self, status: int, payload: Any, headers: Mapping[str, str] = {}) -> None:
        self._send(status, json.dumps(payload).encode(), headers)

    def _send(self, status: int, data: bytes, headers: Mapping[str, str]) -> None:
        try:
            self.send_response(status)
            extra = {key.lower(): value for key, value in headers.items()}
            if "content-type" not in extra:
                self.send_header("Content-Type", "application/json")
            for key, value in extra.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timed out) first
            pass


class CommentingModel:
    """Replies like a (very cautious) model: each proposal adds a comment line inside the first marked
    block of the source it was shown, so every child is new, applies and stays correct. The first
    proposal's edit does not apply (a repair is needed). Critiques get a numbered lesson."""

    def __init__(self) -> None:
        self.numbers = itertools.count(1)
        self.lock = threading.Lock()
        self.first = True

    def __call__(self, body: dict) -> Step:
        critique = "review one experiment" in body["messages"][0]["content"]
        with self.lock:
            n = next(self.numbers)
            first = self.first and not critique
            self.first = self.first and not first
        if critique:
            return Step(f"Scripted lesson {n}: a comment changes no latency; look for fewer kernel launches.")
        if first:
            return Step(json.dumps({"rationale": "try a line that is not there",
                                    "edits": [{"search": "no such line\n", "replace": "x\n"}]}))
        source = re.search(r"```python\n(.*?)\n```", body["messages"][1]["content"], re.S).group(1) + "\n"
        block = source.split(START_MARK + "\n", 1)[1]
        line = next(l for l in block.splitlines(keepends=True) if l.strip())
        indent = line[: len(line) - len(line.lstrip())]
        return Step(json.dumps({"rationale": f"variant {n}: annotate the first step",
                                "edits": [{"search": line, "replace": f"{indent}# scripted variant {n}\n{line}"}]}))
