"""operators.llm.client through the real openai client against a scripted loopback server."""
from __future__ import annotations

import json
import pickle
import socket
import subprocess
import sys
import time

import pytest

from operators.llm.client import (Budget, ChatClient, ChatReply, LlmError, LlmSettings, Price, Usage, redact)
from tests.llm_server import ScriptedLlmServer, Step

MESSAGES = [{"role": "system", "content": "You write code."}, {"role": "user", "content": "Make it faster."}]


def client(server: ScriptedLlmServer, environ: dict | None = None, **overrides) -> ChatClient:
    values = {"base_url": server.url, "model": "coder", "max_retries": 0, "timeout_s": 10.0, **overrides}
    return ChatClient(LlmSettings(**values), environ={} if environ is None else environ)


def chat_error(chat: ChatClient, **kwargs) -> LlmError:
    with pytest.raises(LlmError) as caught:
        chat.chat(MESSAGES, **kwargs)
    return caught.value


def test_good_reply_with_price_and_without():
    with ScriptedLlmServer([Step("def f(): pass", completion_tokens=1000)]) as server:
        priced = client(server, prices={"coder": Price(input_per_mtok=2.0, output_per_mtok=10.0)})
        reply = priced.chat(MESSAGES, seed=7)
        assert isinstance(reply, ChatReply)
        assert (reply.text, reply.finish_reason, reply.model, reply.priced) == ("def f(): pass", "stop", "coder", True)
        tokens_in = (len("You write code.") + len("Make it faster.")) // 4 + 1
        assert (reply.usage.calls, reply.usage.tokens_in, reply.usage.tokens_out) == (1, tokens_in, 1000)
        assert reply.usage.cost_usd == pytest.approx(tokens_in * 2.0 / 1e6 + 1000 * 10.0 / 1e6)
        assert 0 < reply.usage.wall_s < 10

        unpriced = client(server, prices={"other-model": Price(1.0, 1.0)}).chat(MESSAGES)
        assert unpriced.priced is False and unpriced.usage.cost_usd == 0.0 and unpriced.usage.tokens_out == 1000

        sent = server.requests[0]
        assert sent["model"] == "coder" and sent["messages"] == MESSAGES
        assert (sent["seed"], sent["temperature"], sent["max_tokens"]) == (7, 0.7, 4096)
        assert "seed" not in server.requests[1]


def test_rate_limited_once_then_retried_by_the_openai_client():
    script = [Step(status=429, headers={"retry-after": "0.1"}), Step("ok")]
    with ScriptedLlmServer(script) as server:
        reply = client(server, max_retries=2).chat(MESSAGES)
        assert reply.text == "ok" and len(server.requests) == 2
        assert server.requests[1]["_headers"]["x-stainless-retry-count"] == "1"


def test_rate_limited_forever_gives_up_after_the_retries():
    with ScriptedLlmServer([Step("slow down", status=429, headers={"retry-after": "0.1"})]) as server:
        error = chat_error(client(server, max_retries=2))
        assert error.kind == "rate_limited" and "429" in error.message and "slow down" in error.message
        assert len(server.requests) == 3
        assert error.usage.calls == 1 and error.usage.wall_s >= 0.2


def test_a_slow_server_times_out():
    started = time.monotonic()
    with ScriptedLlmServer([Step("late", delay_s=3.0)]) as server:
        error = chat_error(client(server, timeout_s=0.5))
        waited = time.monotonic() - started
    assert error.kind == "timeout" and "0.5" in error.message
    assert waited < 2.9, f"the call waited {waited:.1f} s: the server's 3 s delay, not the 0.5 s timeout"
    assert time.monotonic() - started < 10  # stop() cut the handler's delay short


def test_a_body_that_is_not_json_is_malformed():
    with ScriptedLlmServer([Step(raw_body="not json{"),
                            Step(raw_body="plain text", headers={"content-type": "text/plain"}),
                            Step(raw_body=json.dumps({"id": "x", "object": "chat.completion"}))]) as server:
        chat = client(server)
        first = chat_error(chat)
        assert first.kind == "malformed" and "not json{" in first.message and first.usage.calls == 1
        assert chat_error(chat).kind == "malformed"  # a text/plain 200: the openai client returns a str
        no_choices = chat_error(chat)
        assert no_choices.kind == "malformed" and "no choices" in no_choices.message


def test_a_reply_over_max_tokens_or_cut_is_over_limit_and_still_costs():
    price = {"coder": Price(input_per_mtok=0.0, output_per_mtok=1.0)}
    with ScriptedLlmServer([Step("x" * 40, completion_tokens=50_000), Step("half a rep", finish_reason="length")]) \
            as server:
        chat = client(server, max_tokens=100, prices=price)
        over = chat_error(chat)
        assert over.kind == "over_limit" and "50000" in over.message
        assert over.usage.tokens_out == 50_000 and over.usage.cost_usd == pytest.approx(0.05)
        cut = chat_error(chat)
        assert cut.kind == "over_limit" and "length" in cut.message and cut.usage.tokens_out > 0


def test_empty_content_is_empty():
    with ScriptedLlmServer([Step("   ")]) as server:
        error = chat_error(client(server))
        assert error.kind == "empty" and error.usage.calls == 1 and error.usage.tokens_in > 0


def test_server_errors_are_http_with_status_and_body():
    with ScriptedLlmServer([Step("model 'coder' is not loaded", status=500), Step("bad", status=400)]) as server:
        chat = client(server)
        error = chat_error(chat)
        assert error.kind == "http" and "500" in error.message and "is not loaded" in error.message
        assert chat_error(chat).kind == "http" and len(server.requests) == 2


def test_nothing_listening_is_connection():
    with socket.socket() as probe:  # a port that was free a moment ago
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    chat = ChatClient(LlmSettings(base_url=f"http://127.0.0.1:{port}/v1", max_retries=0), environ={})
    assert chat_error(chat).kind == "connection"


def test_the_key_comes_from_the_named_variable_and_is_redacted():
    key = "sk-test-0123456789abcdef"
    with ScriptedLlmServer([Step("ok")]) as server:
        chat = client(server, environ={"MY_LLM_KEY": key}, api_key_env="MY_LLM_KEY")
        chat.chat(MESSAGES)
        headers = server.requests[0]["_headers"]
        assert headers["authorization"] == f"Bearer {key}"
        assert chat.secrets() == (key,)
        assert key not in redact(json.dumps(headers), chat.secrets())
        local = client(server)  # no variable set: a placeholder local servers ignore, nothing to redact
        local.chat(MESSAGES)
        assert server.requests[1]["_headers"]["authorization"] == "Bearer not-needed" and local.secrets() == ()


def test_redact():
    text = "key=hunter2-long token sk-abcdefghijkl and Authorization: Bearer abc.def, short=abc"
    clean = redact(text, ["hunter2-long", "abc", ""])
    assert "hunter2" not in clean and "sk-abcdefghijkl" not in clean and "abc.def" not in clean
    assert clean.count("[REDACTED]") == 3 and "short=abc" in clean  # secrets under 4 characters are left
    assert redact(clean, []) == clean


def test_errors_and_clients_pickle():
    error = LlmError("timeout", "no answer", Usage(calls=1, wall_s=0.5))
    again = pickle.loads(pickle.dumps(error))
    assert (again.kind, again.message, again.usage, str(again)) == ("timeout", "no answer", error.usage,
                                                                    "timeout: no answer")
    with ScriptedLlmServer([Step("ok")]) as server:
        chat = client(server)
        chat.chat(MESSAGES)
        assert pickle.loads(pickle.dumps(chat)).chat(MESSAGES).text == "ok"
    with pytest.raises(ValueError, match="kind must be one of"):
        LlmError("oops", "x")


def test_usage_adds_and_round_trips():
    total = Usage(1, 10, 20, 0.5, 1.0) + Usage(2, 1, 2, 0.25, 0.5)
    assert total == Usage(3, 11, 22, 0.75, 1.5) and total.tokens == 33
    assert Usage.from_dict(total.to_dict()) == total
    with pytest.raises(ValueError, match="allowed"):
        Usage.from_dict({"calls": 1, "tokens": 3})


def test_budget_exhausted():
    assert Budget().exhausted(Usage(calls=10**6, cost_usd=1e6)) is None
    assert Budget(max_calls=10).exhausted(Usage(calls=10)) == "spent 10 of 10 calls"
    assert Budget(max_calls=10).exhausted(Usage(calls=9)) is None
    assert "tokens" in Budget(max_tokens=100).exhausted(Usage(tokens_in=60, tokens_out=40))
    assert Budget(max_tokens=100).exhausted(Usage(tokens_in=60, tokens_out=39)) is None
    assert "$0.5000 of $0.5000" in Budget(max_cost_usd=0.5).exhausted(Usage(cost_usd=0.5))
    assert "s waiting" in Budget(max_wall_s=60).exhausted(Usage(wall_s=61))
    assert Budget.from_dict({"max_calls": 3, "max_cost_usd": 1}).max_calls == 3
    with pytest.raises(ValueError, match="allowed: \\['max_calls', 'max_tokens', 'max_cost_usd', 'max_wall_s'\\]"):
        Budget.from_dict({"calls": 3})
    with pytest.raises(ValueError, match="max_calls must be an integer >= 0 or None"):
        Budget(max_calls=-1)


def test_settings_from_dict():
    settings = LlmSettings.from_dict({"base_url": "https://api.openai.com/v1", "model": "gpt-4o-mini",
                                      "timeout_s": 30, "prices": {"gpt-4o-mini": {"input_per_mtok": 0.15,
                                                                                  "output_per_mtok": 0.6}}})
    assert settings.prices["gpt-4o-mini"] == Price(0.15, 0.6) and settings.max_retries == 2
    assert LlmSettings.from_dict(settings.to_dict()) == settings
    assert LlmSettings.from_dict({}) == LlmSettings()
    with pytest.raises(ValueError) as caught:
        LlmSettings.from_dict({"model": "m", "api_key": "sk-secret-123456789"})
    assert "['api_key']" in str(caught.value) and "allowed:" in str(caught.value) and "api_key_env" in str(caught.value)
    with pytest.raises(ValueError, match="unknown key.*output_per_mtok"):
        LlmSettings.from_dict({"prices": {"m": {"input": 1.0}}})
    with pytest.raises(ValueError) as caught:
        LlmSettings(api_key_env="sk-secret-123456789")  # the key pasted where its variable's name belongs
    assert "NAME of the environment variable" in str(caught.value) and "sk-secret" not in str(caught.value)
    for bad in ({"base_url": "127.0.0.1:11434"}, {"timeout_s": 0}, {"max_retries": -1}, {"temperature": 3},
                {"max_tokens": 0}, {"model": ""}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LlmSettings.from_dict(bad)


def test_server_answers_other_processes_computes_replies_and_404s():
    def reply(request: dict) -> Step:
        return Step(f"you said {request['messages'][-1]['content']}")

    with ScriptedLlmServer(reply) as server:
        assert client(server).chat(MESSAGES).text == "you said Make it faster."
        code = ("import json, sys, urllib.request, urllib.error\n"
                "body = json.dumps({'model': 'm', 'messages': [{'role': 'user', 'content': 'hi'}]}).encode()\n"
                "request = urllib.request.Request(sys.argv[1] + '/chat/completions', body, "
                "{'content-type': 'application/json'})\n"
                "print(json.load(urllib.request.urlopen(request, timeout=10))['choices'][0]['message']['content'])\n"
                "try:\n    urllib.request.urlopen(sys.argv[1] + '/models', timeout=10)\n"
                "except urllib.error.HTTPError as e:\n    print(e.code)\n")
        out = subprocess.run([sys.executable, "-c", code, server.url], capture_output=True, text=True, timeout=30)
        assert out.stdout.split() == ["you", "said", "hi", "404"], out.stderr
        assert len(server.requests) == 2  # the 404 is not a chat request


def test_exhausted_script_answers_500():
    with ScriptedLlmServer([Step("one")], repeat_last=False) as server:
        chat = client(server)
        assert chat.chat(MESSAGES).text == "one"
        error = chat_error(chat)
        assert error.kind == "http" and "script exhausted" in error.message
    server.stop()  # idempotent
