"""A generation engine kept open for serving (evaluators.served.generator): checked in the strict sandbox,
then one engine loop serving many callers at once. Concurrent callers get, each on its own stream, the
tokens the float64 reference's greedy decode gives; bounds are refused naming the field; a full queue is
refused at once; a cancelled stream gets nothing more while the others go on; closing kills the engine; request
ids continue the judge's check's sequence. (What it is held to while it serves: tests/test_serve_guards.py.)"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from evaluators.served.generator import Overloaded, RequestError, ServedGenerator, ServedGeneratorError
from evaluators.settings import EvaluatorSettings
from evo.workloads import get_workload

W = get_workload("llama_serve")
PRESET = W.presets()["cpu_small"]


def greedy(prompt, n):
    """The float64 reference's greedy continuation (near ties aside: the toy's top two are ~0.2 apart)."""
    tokens = []
    for _ in range(n):
        tokens.append(int(np.argmax(W.reference_logits(PRESET, prompt, [*tokens, 0])[-1])))
    return tokens


@pytest.fixture(scope="module")
def served():
    # two steps per exchange (the gene steps_per_exchange): the judge's check and the serving loop both ask for two
    genome = W.gene_space(PRESET, _info()).make({"steps_per_exchange": 2}).to_json()
    engine = ServedGenerator("llama_serve", "cpu_small", genome, settings=EvaluatorSettings(replays=1),
                             max_waiting=12)
    yield engine
    engine.close()


def _info():
    from evaluators.machine import device as devices

    return devices.device_info("cpu", 1)


def test_concurrent_callers_each_get_the_references_tokens_from_one_engine_loop(served):
    assert served.exchange_steps == 2  # the genome's, as the judge's check replay ran it
    rng = np.random.default_rng(5)
    asks = [(rng.integers(0, 256, int(rng.integers(1, 25))).tolist(), int(rng.integers(1, 13))) for _ in range(8)]
    got: dict[int, list] = {}

    def client(i: int) -> None:
        got[i] = list(served.submit(*asks[i]))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i, (prompt, n) in enumerate(asks):
        assert [t.token for t in got[i]] == greedy(prompt, n), i
        assert [t.finished for t in got[i]] == [False] * (n - 1) + [True]
        assert all(a.at_s <= b.at_s for a, b in zip(got[i], got[i][1:]))
    assert served.running == 0 and served.failure is None


def test_requests_outside_the_verified_domain_are_refused_naming_the_field(served):
    for args, says in ((([],), "prompt: 1 to 24"), (([1] * 25,), "prompt: 1 to 24"), (([256],), r"prompt: token ids"),
                       (([1.5],), "prompt: token ids"), (([1], 13), "max_tokens: 1 to 12"), (([1], 0), "max_tokens"),
                       (([1], 2, [999]), "stop: token ids")):
        with pytest.raises(RequestError, match=says):
            served.submit(*args) if len(args) > 1 else served.submit(args[0], 2)


def test_a_full_queue_is_refused_at_once_and_a_cancelled_stream_gets_nothing_more(served):
    streams = [served.submit([1, 2, 3], 12) for _ in range(12)]  # the engine runs 4 at a time (max_running)
    streams[-1].cancel()  # the last waits behind two rounds of 12 steps: cancelled before its first token
    with pytest.raises(Overloaded, match="12 requests"):
        served.submit([1], 1)
    for stream in streams[:-1]:
        assert len(list(stream)) == 12
    assert list(streams[-1]) == []  # its stream ends when the engine finishes it, with nothing in it
    deadline = time.monotonic() + 60  # a canary (one per 8 requests) may still be decoding
    while served.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served.running == 0


def test_a_closed_engine_serves_no_more():
    # two steps per exchange (the gene steps_per_exchange): the judge's check and the serving loop both ask for two
    genome = W.gene_space(PRESET, _info()).make({"steps_per_exchange": 2}).to_json()
    engine = ServedGenerator("llama_serve", "cpu_small", genome, settings=EvaluatorSettings(replays=1))
    stream = engine.submit([1, 2], 12)
    engine.close()
    with pytest.raises(ServedGeneratorError, match="closed"):
        engine.submit([1], 1)
    try:
        tokens = list(stream)
    except ServedGeneratorError:  # told why, not left waiting
        tokens = None
    assert tokens is None or len(tokens) == 12  # or it had finished before the close
    assert engine._process is None


def test_sampled_requests_are_served_once_the_engine_passed_the_check(served):
    """The judge's check replay covers seeded sampling; a sampled request's tokens are the draw the judge checks
    (re-scored here against the float64 reference), and the same seed draws them again. Its ids continue the
    check's sequence (no negative or restarting ids mark the replica's own requests)."""
    assert served.sampling and served.sampling_check == ""
    assert served.ids is served.judge.generation.request_ids(served._process)
    first, second = (served.submit([1], 1) for _ in range(2))
    assert first.request.id > 0 and 1 <= second.request.id - first.request.id <= 3  # canaries may take ids between
    list(first), list(second)
    runs = [[t.token for t in served.submit([5, 9, 200], 12, temperature=0.9, top_p=0.8, seed=7)] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 12
    request = served.submit([5, 9, 200], 12, temperature=0.9, top_p=0.8, seed=7).request
    assert served.rescore(request, runs[0]) == ("", 0.0)
    assert served.rescore(request, greedy([5, 9, 200], 12))[0] != ""  # greedy is not this draw
    with pytest.raises(RequestError, match="temperature"):
        served.submit([1], 2, temperature=-1.0)


def test_a_cancelled_running_request_is_aborted_and_frees_its_slot(served):
    """Four long requests fill the engine's rows (max_running 4); one is cancelled after its first token: it gets
    nothing more, the engine aborts it (its row freed: the engine-level test checks the rows), and a fifth
    request is served. On a loaded machine the loop may finish the request before it sees the cancel: tried
    until one cancel lands mid-request."""
    aborted = served.stats["aborted"]
    for _ in range(5):
        streams = [served.submit([1, 2, 3], 12) for _ in range(4)]
        first = next(iter(streams[0]))
        streams[0].cancel()
        fifth = served.submit([4, 5], 3)
        assert [t.token for t in fifth] == greedy([4, 5], 3)
        rest = list(streams[0])
        assert first.token == greedy([1, 2, 3], 1)[0]
        for stream in streams[1:]:
            assert [t.token for t in stream] == greedy([1, 2, 3], 12)
        if len(rest) < 11:
            break
    assert served.stats["aborted"] > aborted and len(rest) < 11
    assert served.running == 0 and served.failure is None
