"""`python -m evo loadtest`: the metrics math on synthetic timestamps, flag validation, the dataset and the
arrivals, the table and the JSON, and end to end against our own tiny stdlib SSE test server (not a
real engine: it streams OpenAI-shaped chunks on 127.0.0.1 so the client path is exercised)."""
from __future__ import annotations

import json
import math
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from evo.bench.loadtest import (LoadtestError, LoadtestOptions, Tokenizer, arrival_offsets, check_url, loadtest,
                                main, random_dataset, validate)
from evo.bench.loadtest_report import (RequestRecord, compute_metrics, parse_goodput, percentile_key, render_table,
                                       write_result)


# ---- the metrics math --------------------------------------------------------------------------------------

def _record(index, start, chunks, end, *, tokens=None, asked=None, error=None, input_len=10):
    return RequestRecord(index=index, start=start, end=end, chunk_times=tuple(chunks), input_len=input_len,
                         output_len=asked if asked is not None else (tokens or len(chunks)),
                         completion_tokens=tokens, error=error)


def test_per_request_ttft_tpot_itl_e2el():
    r = _record(0, 1.0, [1.2, 1.25, 1.35, 1.4], 1.5)
    assert r.ttft == pytest.approx(0.2)
    assert r.e2el == pytest.approx(0.5)
    assert r.itls == pytest.approx([0.05, 0.1, 0.05])
    assert r.output_tokens == 4  # no usage: chunks
    assert r.tpot == pytest.approx((0.5 - 0.2) / 3)
    with_usage = _record(1, 0.0, [0.1, 0.2], 0.3, tokens=5)  # the server's usage wins over the chunk count
    assert with_usage.output_tokens == 5 and with_usage.tpot == pytest.approx(0.2 / 4)
    single = _record(2, 0.0, [0.1], 0.1)
    assert single.tpot is None and single.itls == []
    empty = _record(3, 0.0, [], 0.4, tokens=0)  # a stream with no content: its whole latency is TTFT
    assert empty.ttft == pytest.approx(0.4)


def test_aggregate_metrics_and_percentiles():
    records = [_record(i, 0.1 * i, [0.1 * i + 0.05 * (i + 1) + 0.01 * k for k in range(4)],
                       0.1 * i + 0.05 * (i + 1) + 0.04, asked=4) for i in range(10)]
    m = compute_metrics(records, 2.0, metric_percentiles=(50, 99, 99.9))
    ttfts = np.array([0.05 * (i + 1) for i in range(10)]) * 1000
    assert m["completed"] == 10 and m["failed"] == 0 and m["first_error"] is None
    assert m["mean_ttft_ms"] == pytest.approx(ttfts.mean())
    assert m["median_ttft_ms"] == pytest.approx(np.median(ttfts))
    assert m["p99_ttft_ms"] == pytest.approx(np.percentile(ttfts, 99))
    assert m["p99.9_ttft_ms"] == pytest.approx(np.percentile(ttfts, 99.9))
    assert m["median_itl_ms"] == pytest.approx(10.0)
    e2el = np.array([(0.05 * (i + 1) + 0.04) * 1000 for i in range(10)])
    assert m["p50_e2el_ms"] == pytest.approx(np.percentile(e2el, 50))
    tpot = (e2el - ttfts) / 3
    assert m["mean_tpot_ms"] == pytest.approx(tpot.mean())
    assert m["total_output_tokens"] == 40 and m["total_input_tokens"] == 100
    assert m["request_throughput"] == pytest.approx(5.0)
    assert m["output_throughput"] == pytest.approx(20.0)
    assert m["total_token_throughput"] == pytest.approx(70.0)
    assert m["output_len_mismatch"] == 0
    assert percentile_key(99) == "p99" and percentile_key(99.9) == "p99.9"


def test_failures_goodput_and_selected_metrics():
    records = [_record(0, 0.0, [0.1, 0.2, 0.3], 0.3, asked=3),  # ttft 100, tpot 100, e2el 300
               _record(1, 0.0, [0.5, 0.51], 0.52, asked=2),  # ttft 500
               _record(2, 0.0, [0.05], 0.05, asked=8),  # one token (ended early): tpot counts as 0 for goodput
               _record(3, 0.0, [], 0.2, error="HTTP 500: boom"),
               _record(4, 0.0, [], 0.1, error="ReadTimeout: slow")]
    slos = parse_goodput(["ttft:200", "tpot:150"])
    m = compute_metrics(records, 1.0, percentile_metrics=("ttft",), metric_percentiles=(99,), goodput=slos)
    assert m["completed"] == 3 and m["failed"] == 2
    assert m["first_error"] == "request 4: ReadTimeout: slow"  # the earliest to fail, by its end time
    assert m["request_goodput"] == pytest.approx(2.0)  # requests 0 and 2 meet both SLOs
    assert m["output_len_mismatch"] == 1
    assert "p99_ttft_ms" in m and "p99_itl_ms" not in m and "median_itl_ms" in m
    assert compute_metrics([], 1.0)["mean_ttft_ms"] is None  # nothing measured is None, not 0
    for bad in (["ttft"], ["speed:3"], ["ttft:-1"], ["ttft:x"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_table_and_json(tmp_path):
    records = [_record(i, 0.0, [0.1, 0.2], 0.2, asked=2) for i in range(3)] + [
        _record(3, 0.0, [], 0.1, error="HTTP 400: prompt too long")]
    m = compute_metrics(records, 1.0, metric_percentiles=(50, 99), goodput={"e2el": 1000})
    table = render_table(m, metric_percentiles=(50, 99), max_concurrency=4, label="ours")
    for line in ("Serving Benchmark Result (ours)", "Successful requests:                     3",
                 "Failed requests:                         1", "Output token throughput (tok/s):",
                 "Request goodput (req/s):", "Time to First Token", "P99 TTFT (ms):", "P50 ITL (ms):",
                 "Median E2EL (ms):", "first error: request 3: HTTP 400: prompt too long"):
        assert line in table, line
    path = tmp_path / "r.json"
    write_result(str(path), {**m, "request_rate": math.inf, "nested": {"x": [math.nan, 1.0]}})
    data = json.loads(path.read_text())
    assert data["completed"] == 3 and data["request_rate"] is None and data["nested"]["x"] == [None, 1.0]


# ---- flags -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, flag", [
    ({"random_input_len": 0}, "--random-input-len"), ({"random_output_len": -3}, "--random-output-len"),
    ({"num_prompts": 0}, "--num-prompts"), ({"max_concurrency": 0}, "--max-concurrency"),
    ({"random_range_ratio": 1.0}, "--random-range-ratio"), ({"request_rate": 0.0}, "--request-rate"),
    ({"burstiness": 0.0}, "--burstiness"), ({"endpoint": "/v1/embeddings"}, "--endpoint"),
    ({"dataset_name": "sharegpt"}, "--dataset-name"), ({"percentile_metrics": "ttft,speed"}, "--percentile-metrics"),
    ({"metric_percentiles": "50,100"}, "--metric-percentiles"), ({"metric_percentiles": "p99"}, "--metric-percentiles"),
    ({"goodput": ("ttft=3",)}, "--goodput"), ({"extra_body": "{nope"}, "--extra-body"),
    ({"extra_body": "[1]"}, "--extra-body"), ({"endpoint": "/v1/chat/completions"}, "--tokenizer"),
    ({"tokenizer": "/no/such/folder"}, "--tokenizer"), ({"result_filename": "x.json"}, "--save-result"),
    ({"random_vocab_size": 0}, "--random-vocab-size"), ({"request_timeout": 0.0}, "--request-timeout"),
])
def test_bad_flags_name_the_flag(change, flag):
    options = LoadtestOptions(url="http://127.0.0.1:8000", **change)
    with pytest.raises(LoadtestError, match=flag) as info:
        validate(options)
    assert "allowed" in str(info.value) or "needs" in str(info.value) or "add" in str(info.value)


def test_urls_loopback_only_unless_allowed():
    assert check_url("http://127.0.0.1:8000/v1/", False) == "http://127.0.0.1:8000"
    assert check_url("http://localhost:9", False) == "http://localhost:9"
    assert check_url("http://[::1]:9", False) == "http://[::1]:9"
    assert check_url("http://127.0.0.5:9", False) == "http://127.0.0.5:9"
    for url in ("http://10.1.2.3:8000", "http://example.com", "http://192.168.0.2:80"):
        with pytest.raises(LoadtestError, match="loopback.*--allow-remote"):
            check_url(url, False)
    assert check_url("http://10.1.2.3:8000", True) == "http://10.1.2.3:8000"
    with pytest.raises(LoadtestError, match="URL"):
        check_url("ftp://127.0.0.1", False)


def test_cli_bad_flag_is_one_line_exit_2(capsys):
    from evo.cli import main as cli_main

    assert cli_main(["loadtest", "http://127.0.0.1:9", "--max-concurrency", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --max-concurrency: got 0") and "\n" not in err


# ---- dataset and arrivals ----------------------------------------------------------------------------------

def test_random_token_id_dataset_is_seeded():
    options = LoadtestOptions(url="http://127.0.0.1:1", num_prompts=20, random_input_len=30, random_output_len=10,
                              random_range_ratio=0.5, random_vocab_size=100, seed=7)
    a, b = random_dataset(options, None), random_dataset(options, None)
    assert a == b
    assert random_dataset(LoadtestOptions(**{**options.__dict__, "seed": 8}), None) != a
    assert all(15 <= s.input_len <= 45 and 5 <= s.output_len <= 15 for s in a)
    assert all(isinstance(s.prompt, tuple) and len(s.prompt) == s.input_len and max(s.prompt) < 100 for s in a)
    fixed = random_dataset(LoadtestOptions(url="http://127.0.0.1:1", num_prompts=5, random_input_len=12,
                                           random_output_len=3), None)
    assert {(s.input_len, s.output_len) for s in fixed} == {(12, 3)}


def _tiny_tokenizer(folder):
    from tokenizers import Tokenizer as Fast, decoders, models, pre_tokenizers, trainers

    tok = Fast(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog %d" % i for i in range(200)], trainer)
    folder.mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_text_prompts_through_a_tokenizer(tmp_path):
    folder = _tiny_tokenizer(tmp_path / "tok")
    tokenizer = Tokenizer(str(folder))
    assert 0 not in tokenizer.normal_ids  # the special token is never drawn
    options = LoadtestOptions(url="http://127.0.0.1:1", num_prompts=6, random_input_len=40, random_output_len=4,
                              tokenizer=str(folder))
    specs = random_dataset(options, tokenizer)
    assert specs == random_dataset(options, tokenizer)
    assert all(isinstance(s.prompt, str) for s in specs)
    assert all(s.input_len == len(tokenizer.encode(s.prompt)) for s in specs)
    assert sum(abs(s.input_len - 40) <= 2 for s in specs) >= 5  # re-encoding hits the asked length (nearly)


def test_arrivals():
    assert arrival_offsets(4, math.inf, 1.0, 0) == [0.0] * 4
    a = arrival_offsets(2000, 50.0, 1.0, 3)
    assert a == arrival_offsets(2000, 50.0, 1.0, 3) and a != arrival_offsets(2000, 50.0, 1.0, 4)
    assert a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:]))
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.15)  # exponential: CV 1
    steady = np.diff(arrival_offsets(2000, 50.0, 8.0, 3))
    assert steady.std() / steady.mean() < 0.5


# ---- end to end against our own stdlib SSE test server (not a real engine) ----------------------------------

class _TestSseServer:
    """OUR TEST SERVER: streams OpenAI-shaped chunks on 127.0.0.1, one word per token, a first-token and a
    per-token delay; stops after `eos_after` tokens unless the request says ignore_eos; answers 500 to
    every `fail_every`-th completion request; records every body it got."""

    def __init__(self, *, first_s=0.02, token_s=0.004, eos_after=3, fail_every=0, usage=True):
        self.first_s, self.token_s, self.eos_after, self.fail_every, self.usage = (
            first_s, token_s, eos_after, fail_every, usage)
        self.bodies: list[dict] = []
        self.count = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _json(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    return self._json(200, {"object": "list", "data": [{"id": "test-sse", "object": "model",
                                                                         "created": 0, "owned_by": "tests"}]})
                self._json(404, {"error": {"message": "no route"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.bodies.append(body)
                    outer.count += 1
                    n = outer.count
                chat = self.path == "/v1/chat/completions"
                if outer.fail_every and n % outer.fail_every == 0:
                    return self._json(500, {"error": {"message": f"scripted failure {n}", "type": "server_error"}})
                tokens = body["max_tokens"] if body.get("ignore_eos") else min(body["max_tokens"], outer.eos_after)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()

                def send(payload):
                    self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
                    self.wfile.flush()

                base = {"id": f"r{n}", "created": 0, "model": body["model"],
                        "object": "chat.completion.chunk" if chat else "text_completion"}
                if chat:  # vLLM sends the role first, with empty content: not a content chunk
                    send({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                               "finish_reason": None}]})
                time.sleep(outer.first_s)
                for k in range(tokens):
                    if k:
                        time.sleep(outer.token_s)
                    piece = {"delta": {"content": f"w{k} "}} if chat else {"text": f"w{k} "}
                    send({**base, "choices": [{"index": 0, **piece, "finish_reason": None}]})
                end = {"delta": {}} if chat else {"text": ""}
                send({**base, "choices": [{"index": 0, **end, "finish_reason": "length"}]})
                if outer.usage and body.get("stream_options", {}).get("include_usage"):
                    prompt = body.get("prompt")
                    send({**base, "choices": [], "usage": {
                        "prompt_tokens": len(prompt) if isinstance(prompt, list) else 7,
                        "completion_tokens": tokens, "total_tokens": tokens + 7}})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_end_to_end_token_ids_ignore_eos(tmp_path):
    with _TestSseServer() as server:
        result = loadtest(LoadtestOptions(url=server.url, num_prompts=8, random_input_len=5, random_output_len=6,
                                          max_concurrency=4, ignore_eos=True, metric_percentiles="50,99"),
                          log=lambda line: None)
    m = result.metrics
    assert result.model == "test-sse"  # the first id of /v1/models
    assert m["completed"] == 8 and m["failed"] == 0 and m["total_output_tokens"] == 48
    assert m["output_len_mismatch"] == 0
    assert m["median_ttft_ms"] >= 15 and m["median_itl_ms"] >= 2 and m["p99_e2el_ms"] >= m["median_ttft_ms"]
    assert m["total_input_tokens"] == 40  # from usage.prompt_tokens
    assert len(server.bodies) == 9  # the warm-up request is sent but not counted
    body = server.bodies[-1]
    assert body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert isinstance(body["prompt"], list) and len(body["prompt"]) == 5 and body["temperature"] == 0.0
    data = result.as_json()
    assert data["max_concurrency"] == 4 and data["request_rate"] == "inf" and len(data["ttfts"]) == 8
    assert data["environment"]["cpus"] >= 1


def test_end_to_end_without_ignore_eos_counts_short_outputs_and_failures():
    with _TestSseServer(eos_after=2, fail_every=3, usage=False) as server:
        result = loadtest(LoadtestOptions(url=server.url, num_prompts=9, random_input_len=4, random_output_len=5,
                                          request_rate=200.0, seed=1), log=lambda line: None)
    m = result.metrics
    assert m["completed"] + m["failed"] == 9 and m["failed"] == 3
    assert m["first_error"].split(": ", 1)[1].startswith("HTTP 500")
    assert m["total_output_tokens"] == 2 * m["completed"]  # no usage: counted from chunks
    assert m["output_len_mismatch"] == m["completed"]


def test_end_to_end_chat_with_tokenizer_and_cli_json(tmp_path, capsys):
    folder = _tiny_tokenizer(tmp_path / "tok")
    with _TestSseServer() as server:
        status = main(LoadtestOptions(url=server.url, endpoint="/v1/chat/completions", tokenizer=str(folder),
                                      num_prompts=4, random_input_len=12, random_output_len=3, ignore_eos=True,
                                      goodput=("ttft:5000",), save_result=True, result_dir=str(tmp_path),
                                      result_filename="chat.json", label="sse-test"))
        body = server.bodies[-1]
    out = capsys.readouterr().out
    assert status == 0, out
    assert "Serving Benchmark Result (sse-test)" in out and "Request goodput (req/s):" in out
    assert body["messages"][0]["role"] == "user" and isinstance(body["messages"][0]["content"], str)
    data = json.loads((tmp_path / "chat.json").read_text())
    assert data["label"] == "sse-test" and data["backend"] == "openai-chat" and data["completed"] == 4
    assert data["total_output_tokens"] == 12 and data["request_goodput"] > 0
    assert all(len(itl) == 2 for itl in data["itls"])  # the empty role chunk is not a token


def test_unreachable_server_is_one_line_exit_1(capsys):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(LoadtestOptions(url=f"http://127.0.0.1:{port}", num_prompts=1, request_timeout=5.0)) == 1
    assert "is the server up?" in capsys.readouterr().err


# ---- scripts/loadtest_compare.py: a missing or failing server is a row, never a crash -----------------------

def _compare_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "loadtest_compare.py"
    spec = importlib.util.spec_from_file_location("loadtest_compare", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _checkpoint(tmp_path):
    folder = _tiny_tokenizer(tmp_path / "ckpt")
    (folder / "config.json").write_text("{}")
    return folder


def test_compare_interleaves_rounds_and_rows_missing_and_failing_servers(tmp_path, monkeypatch):
    """Our server already running (a URL) loaded for three rounds, after a warm-up, at two concurrencies; a missing
    alternative is a row naming its setup script; a command that exits at once, or one never ready, is a row
    saying so."""
    compare = _compare_module()
    monkeypatch.setattr(compare, "ALT_DIR", tmp_path / "no-alternatives-here")
    ckpt = _checkpoint(tmp_path)
    out = tmp_path / "out"
    with _TestSseServer() as ours:
        status = compare.main(["--checkpoint", str(ckpt), "--ours", ours.url, "--servers", "ours,vllm,llamacpp",
                               "--server-cmd", f"llamacpp={sys.executable} -c pass", "--concurrency", "1,2",
                               "--rounds", "3", "--num-prompts", "1", "--input-len", "8", "--output-len", "6",
                               "--out", str(out), "--ready-timeout", "30"])
        assert status == 0
        table = (out / "compare.md").read_text()
        assert "| ours | 1 | 3 |" in table and "| ours | 2 | 3 |" in table
        assert "| vllm | 1 | 0 |" in table and "setup_vllm.sh" in table
        assert "| llamacpp | 1 | 0 |" in table and "exited with status 0 before it was ready" in table
        assert json.loads((out / "ours-c2-r2.json").read_text())["max_concurrency"] == 2
        assert (out / "ours-c1-warmup.json").exists()
        status = compare.main(["--checkpoint", str(ckpt), "--ours", ours.url, "--servers", "ours,vllm",
                               "--server-cmd", f"vllm={sys.executable} -c \"import time; time.sleep(600)\" {{port}}",
                               "--concurrency", "1", "--rounds", "2", "--num-prompts", "1", "--input-len", "4",
                               "--output-len", "4", "--out", str(tmp_path / "out2"), "--ready-timeout", "3"])
    assert status == 0
    assert "not ready after 3 s" in (tmp_path / "out2" / "compare.md").read_text()


def test_a_ratio_is_the_median_of_paired_rounds_with_its_order_statistic_interval():
    from evo.bench.interleaved import coverage, median_interval, paired_ratios

    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0])[1:] == (pytest.approx(float("nan"), nan_ok=True),
                                                              pytest.approx(float("nan"), nan_ok=True), 0.0)
    assert median_interval([6, 1, 2, 5, 4, 3]) == (3.5, 1, 6, coverage(6, 1))
    assert median_interval(range(12))[1:3] == (2, 9) and coverage(12, 3) >= 0.95 > coverage(12, 4)
    rounds = [{"ours": {"output_throughput": 20.0 + r, "median_tpot_ms": 10.0, "median_ttft_ms": 5.0,
                        "median_e2el_ms": 100.0, "failed": 0},
               "vllm": {"output_throughput": 10.0, "median_tpot_ms": 20.0, "median_ttft_ms": 5.0,
                        "median_e2el_ms": 50.0, "failed": 0}} for r in range(6)]
    rounds.append({"ours": None, "vllm": rounds[0]["vllm"]})  # a failed load drops its round
    by = {r.figure: r for r in paired_ratios("ours", "vllm", 4, rounds)}
    assert len(by["output tok/s"].rounds) == 6 and by["output tok/s"].median == pytest.approx(2.25)
    assert (by["output tok/s"].low, by["output tok/s"].high) == (2.0, 2.5)
    assert by["TPOT p50"].median == 2.0 and by["E2EL p50"].median == 0.5  # > 1: ours better; < 1: worse
    assert by["output tok/s"].cell() == "2.25x [2.00, 2.50]"


def test_compare_flags():
    compare = _compare_module()
    for argv, flag in ((["--concurrency", "0"], "--concurrency"), (["--servers", "sglang"], "--servers"),
                       (["--server-cmd", "vllm"], "--server-cmd"), (["--checkpoint", "/nope"], "--checkpoint")):
        with pytest.raises(SystemExit):
            compare.parse_args(["--checkpoint", "/nope", "--ours", "x", *argv])


def test_an_engine_of_fewer_bits_brings_and_meets_only_its_equal_bits(tmp_path):
    """--ours-16bit adds our engine of 16-bit weights with transformers and llama.cpp at bfloat16; each of ours is
    paired with the alternatives of its own bits, and the lossy ones with the float32 alternatives too."""
    compare = _compare_module()
    args = compare.parse_args(["--checkpoint", str(_checkpoint(tmp_path)), "--ours", "x", "--ours-16bit", "y"])
    assert {"ours_16bit", "transformers_cb_bf16", "llamacpp_bf16"} <= set(args.servers)
    servers = compare.build_servers(args, 2048)
    assert "--dtype bfloat16" in " ".join(servers["transformers_cb_bf16"].argv)
    rounds = [{name: {"output_throughput": 1.0, "median_tpot_ms": 1.0, "median_ttft_ms": 1.0, "median_e2el_ms": 1.0,
                      "failed": 0} for name in servers} for _ in range(6)]
    _, ratios = compare.tables(servers, {4: rounds}, {name: {} for name in servers})
    pairs = {(r.a, r.b) for r in ratios}
    float32 = {"transformers", "transformers_cb", "vllm", "llamacpp"}
    assert {b for a, b in pairs if a == "ours"} == float32
    assert {b for a, b in pairs if a == "ours_16bit"} == {"transformers_cb_bf16", "llamacpp_bf16"} | float32
    assert {b for a, b in pairs if a == "ours_int8"} == {"llamacpp_q8"} | float32


def test_a_request_past_its_timeout_is_a_failure_with_its_partial_stream():
    with _TestSseServer(token_s=0.3, eos_after=100) as server:
        result = loadtest(LoadtestOptions(url=server.url, num_prompts=2, random_input_len=4, random_output_len=2,
                                          request_timeout=1.0), log=lambda line: None)
        assert result.metrics["completed"] == 2  # 2 tokens fit in 1 s
        with pytest.raises(LoadtestError, match="initial test request.*--request-timeout 0.5 s"):
            loadtest(LoadtestOptions(url=server.url, num_prompts=1, random_input_len=4, random_output_len=5,
                                     request_timeout=0.5), log=lambda line: None)


def test_output_tokens_prefer_usage_then_the_retokenized_text_then_chunks():
    base = _record(0, 0.0, [0.1, 0.2], 0.3)
    assert base.output_tokens == 2
    assert RequestRecord(**{**base.__dict__, "text_tokens": 3}).output_tokens == 3
    assert RequestRecord(**{**base.__dict__, "text_tokens": 3, "completion_tokens": 4}).output_tokens == 4


def test_without_usage_the_text_is_retokenized(tmp_path):
    folder = _tiny_tokenizer(tmp_path / "tok")
    with _TestSseServer(usage=False) as server:
        result = loadtest(LoadtestOptions(url=server.url, num_prompts=2, random_input_len=6, random_output_len=4,
                                          ignore_eos=True, tokenizer=str(folder)), log=lambda line: None)
    tokenizer = Tokenizer(str(folder))
    assert all(r.text_tokens == len(tokenizer.encode("w0 w1 w2 w3 ")) for r in result.records)


def test_a_damaged_tokenizer_is_a_flag_error(tmp_path, capsys):
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert main(LoadtestOptions(url="http://127.0.0.1:9", tokenizer=str(tmp_path), num_prompts=1)) == 2
    assert capsys.readouterr().err.startswith("error: --tokenizer: cannot load")
