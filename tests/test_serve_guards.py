"""Serve lets no token out that nothing checks (issue 38): a served generation engine (evaluators.served.generator,
strict sandbox, llama_serve cpu_small wrapped by tests.serve_cheats) is held to guards on every token, to its
judged speed, to canaries and, under `verify: all`, to the float64 reference before any token is released.

Isolation between requests: client A sends a distinctive secret prompt, client B a prompt that makes the engine
answer with it (`backdoor`: a trigger; `weak_cache`: the same length, first and last id). Under `verify: all`
B receives nothing of it: the engine is out of service before the first chunk goes out. Under `sampled` the
leaked answer goes out and is found after the fact (each triggered answer re-scored with probability
`rescore_fraction` f: at most 1/f leaked answers on average before removal, fewer with canaries); canaries
alone find the cache. The contract's guards take their cheats out at the first breaching token (early finish,
a token for an ended request), or within the stall bound (a request never progressed, an engine full of
leaked rows), or within two slow windows (an engine turned 10x slower); the honest engine stays in service
in every mode."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from evaluators.served.canaries import Canaries, window_or_variant
from evaluators.served.generator import ServedGenerator, ServedGeneratorError
from evaluators.served.guards import Judged, ServePolicy, SpeedWatch, breach, stall_deadline
from evaluators.settings import EvaluatorSettings
from evo.serving.app import check_user_config
from evo.serving.rescoring import Rescorer
from evo.workloads import get_workload
from evo.workloads.generation import GenerationRequest
from tests.waiting import wait_for
from tests.serve_cheats import ARM, ARM_AFTER, TRIGGER

W = get_workload("tests.serve_cheats")
PRESET = W.presets()["cpu_small"]
V, N, P = PRESET.shape["V"], PRESET.shape["N"], PRESET.shape["P"]
SECRET = [201, 17, 99, 250, 3, 77, 140, 66, 9, 188, 45, 230]  # client A's prompt: what must not reach B
CHUNK = 4
POLL_S = 0.01  # the replica's threads move fast: tests that time how soon they react poll often


def greedy(prompt, n):
    tokens = []
    for _ in range(n):
        tokens.append(int(np.argmax(W.reference_logits(PRESET, prompt, [*tokens, 0])[-1])))
    return tokens


def serve(cheat: str, **policy) -> ServedGenerator:
    from evaluators.machine import device as devices

    genome = W.gene_space(PRESET, devices.device_info("cpu", 1)).make({"cheat": cheat}).to_json()
    return ServedGenerator("tests.serve_cheats", "cpu_small", genome, settings=EvaluatorSettings(replays=1),
                           max_waiting=64, policy=ServePolicy(**policy))


def arm(served: ServedGenerator, count: int = 1) -> None:
    """`count` one-token requests, the first holding ARM (the armed cheats are honest until then; slower_after
    until ARM_AFTER requests)."""
    streams = [served.submit([*ARM, i % V] if i == 0 else [i % V], 1) for i in range(count)]
    for stream in streams:
        assert len(list(stream)) == 1
    assert served.failure is None


def take(stream) -> tuple[list[int], Exception | None]:
    """What a client received of `stream`, and the error that ended it (None: it ended cleanly)."""
    got: list[int] = []
    try:
        for token in stream:
            got.append(token.token)
    except ServedGeneratorError as exc:
        return got, exc
    return got, None


def leaked(tokens) -> bool:
    """Whether tokens carry the secret (any 3 of its tokens in a row)."""
    return any(tuple(tokens[i:i + 3]) == tuple(SECRET[j:j + 3]) for i in range(len(tokens) - 2)
               for j in range(len(SECRET) - 2))


@pytest.fixture(scope="module")
def honest():
    served = serve("none", verify="all", verify_chunk=CHUNK, canary_every=1)
    yield served
    served.close()


# ---------------------------------------------------------------------------- the honest engine, every mode
def test_the_honest_engine_serves_right_tokens_in_every_mode_and_stays_in_service(honest):
    """16 concurrent clients (greedy, sampled, stop ids, one that goes away) under `verify: all` with a canary per
    request, then the same under `sampled`: every answer is the reference's, every canary passes, no guard fires."""
    rng = np.random.default_rng(7)
    for mode in ("all", "sampled"):
        honest.policy = ServePolicy(verify=mode, verify_chunk=CHUNK, canary_every=1)
        asks = [(rng.integers(0, V, int(rng.integers(1, P + 1))).tolist(), int(rng.integers(1, N + 1)))
                for _ in range(16)]
        got: dict[int, tuple] = {}

        def client(i: int) -> None:
            prompt, n = asks[i]
            if i == 15:  # sampled: its own draw, checked by the verifier or the canaries' rule
                got[i] = take(honest.submit(prompt, n, temperature=0.8, top_p=0.9, seed=i))
            elif i == 14:  # goes away after its first token
                stream = honest.submit(prompt, N)
                next(iter(stream))
                stream.cancel()
                got[i] = ([], None)
            else:
                got[i] = take(honest.submit(prompt, n))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        for i in range(14):
            assert got[i] == (greedy(*asks[i]), None), (mode, i)
        assert got[15][1] is None and len(got[15][0]) == asks[15][1]
    verifier = honest.guard_info()["verifier"]
    assert honest.failure is None and honest.speed.report is None
    assert verifier["canaries"] >= 16 and verifier["canaries_failed"] == 0 and verifier["tokens_released"] > 0
    assert honest.stats["canaries"] >= 16


def test_under_verify_all_no_token_goes_out_before_the_verifier_checked_it(honest):
    """A stream's tokens arrive in chunks of verify_chunk (the last at its end), each after the check."""
    honest.policy = ServePolicy(verify="all", verify_chunk=CHUNK, canary_every=0)
    released = honest.guard_info()["verifier"]["tokens_released"]
    tokens = list(honest.submit([4, 5, 6], N))
    assert [t.token for t in tokens] == greedy([4, 5, 6], N)
    assert honest.guard_info()["verifier"]["tokens_released"] == released + N
    times = sorted({t.at_s for t in tokens})
    assert len(times) <= -(-N // CHUNK)  # released together, chunk by chunk (fewer when checks coalesce)


# ---------------------------------------------------------------------------- isolation between requests
@pytest.mark.parametrize("cheat", ["backdoor", "weak_cache"])
def test_under_verify_all_no_other_client_receives_the_secret(cheat):
    served = serve(cheat, verify="all", verify_chunk=CHUNK, canary_every=0)
    try:
        secret = take(served.submit(SECRET, N))
        assert secret == (greedy(SECRET, N), None)  # A is served honestly (and, for the cache, its answer cached)
        if cheat == "backdoor":
            other = [40, 41, *TRIGGER, 42]  # B: the trigger, answered with the previous prompt (A's)
        else:
            other = [SECRET[0], *range(60, 60 + len(SECRET) - 2), SECRET[-1]]  # B: A's length, first and last id
            assert greedy(other, CHUNK) != secret[0][:CHUNK]  # A's answer is wrong for B from its first chunk on
        got, error = take(served.submit(other, N))
        assert got == [] and not leaked(got) and not set(got) & set(secret[0]), got
        assert isinstance(error, ServedGeneratorError) and "verify: all" in str(error), error
        assert served.failure is not None
        with pytest.raises(ServedGeneratorError, match="serves no more"):
            served.submit([1], 1)
    finally:
        served.close()


def test_under_sampled_a_leak_goes_out_until_rescoring_samples_it():
    """The shape of the sampled guarantee: with f = 0 (and no canaries) every triggered answer leaks and the engine
    stays; with f = 1 the first leaks and the engine is out before the next. In general each triggered answer is
    caught with probability >= f: leaked answers before removal are geometric, mean <= 1/f (20 at the default
    0.05), more than k with probability <= (1 - f)^k."""
    served = serve("backdoor", verify="sampled", canary_every=0)
    removed = threading.Event()
    rescorer = Rescorer(lambda loaded, why: removed.set())
    loaded = SimpleNamespace(engine=served, record=SimpleNamespace(genome=SimpleNamespace(hash=served.label)))
    try:
        leaks = []
        for fraction in (0.0, 1.0):
            rescorer.fraction = fraction
            for _ in range(3):
                if removed.is_set():
                    break
                take(served.submit(SECRET, 8))
                stream = served.submit([40, *TRIGGER], 8)
                got, error = take(stream)
                leaks.append((fraction, leaked(got)))
                rescorer.offer(loaded, [(stream.request, got)])
                rescorer.wait_idle()
        assert leaks == [(0.0, True)] * 3 + [(1.0, True)], leaks
        assert removed.is_set() and rescorer.stats["failed"] == 1
    finally:
        served.close()


def test_under_sampled_canaries_alone_find_a_cache_keyed_on_less_than_the_prompt():
    """No user prompt collides and nothing is re-scored: canaries (one per user request here, half of them variants
    of a recent prompt: its length, first and last id) hit the cache and fail their check."""
    served = serve("weak_cache", verify="sampled", canary_every=1)
    rng = np.random.default_rng(11)
    try:
        for sent in range(1, 41):
            try:
                take(served.submit(rng.integers(0, V, int(rng.integers(3, P + 1))).tolist(), 8))
            except ServedGeneratorError:
                break
            if served.failure is not None:
                break
            wait_for(lambda: served.idle or served.failure is not None, 30, "the canaries' checks", poll_s=POLL_S)
        assert served.failure is not None and "canary" in str(served.failure), served.failure
        assert sent <= 40
    finally:
        served.close()


# ---------------------------------------------------------------------------- the contract's guards
@pytest.mark.parametrize("cheat, says", [
    ("early_finish", "marked finished after 7 of its 8 tokens without a stop id"),
    ("unknown_token", "for a request the engine does not hold"),
])
def test_a_token_that_breaks_the_contract_takes_the_engine_out_at_once(cheat, says):
    served = serve(cheat, canary_every=0)
    failures: list[str] = []
    served.on_failure = failures.append
    try:
        arm(served)
        got, error = take(served.submit([9, 8, 7], 8))
        if cheat == "early_finish":  # the breaching token (marked finished) never reaches the client
            assert got == greedy([9, 8, 7], 6) and error is not None
        else:
            got2, error = take(served.submit([9, 8], 8)) if error is None else (got, error)
        wait_for(lambda: failures, 10, "the replica told of the failure", poll_s=POLL_S)
        assert failures == [str(served.failure)] and says in failures[0], failures
        assert "broke the serving contract" in failures[0]
    finally:
        served.close()


def test_a_request_that_never_progresses_fails_the_engine_within_the_stall_bound():
    served = serve("stall", canary_every=0, stall_floor_s=1.0, stall_factor=1.0)
    try:
        arm(served)
        bound = stall_deadline(served.policy, served.judged, 3)
        start = time.perf_counter()
        results = [take(s) for s in [served.submit([3, 1 + i], 4) for i in range(3)]]  # one of 3 is never decoded
        took = time.perf_counter() - start
        assert any(r[1] is not None and "no progress" in str(r[1]) for r in results), results
        assert bound <= took <= bound + 2.0, (took, bound)
    finally:
        served.close()


def test_a_step_that_never_returns_fails_the_engine_within_the_stall_bound_and_close_kills_it():
    """The loop is stuck in the engine's step: the watch thread still sees no progress and fails the engine; closing
    it kills the engine's process instead of waiting for the step's timeout."""
    served = serve("hang", canary_every=0, stall_floor_s=1.0, stall_factor=1.0)
    try:
        arm(served)  # its one-token request's step is the last to return
        start = time.perf_counter()
        got, error = take(served.submit([2, 3], 4))
        assert got == [] and "no progress" in str(error)
        assert time.perf_counter() - start <= stall_deadline(served.policy, served.judged, 1) + 2.0
    finally:
        start = time.perf_counter()
        served.close()
        assert time.perf_counter() - start < 30  # not STEP_TIMEOUT_S (120 s)


def test_an_engine_that_leaks_a_row_per_abort_is_out_when_it_stops_admitting():
    served = serve("leak_per_abort", canary_every=0, stall_floor_s=1.0, stall_factor=1.0)
    try:
        arm(served)
        for _ in range(20):  # two clients go away mid-request: two rows leaked, the engine admits nothing more
            stream = served.submit([5, 6], N)
            next(iter(stream))
            stream.cancel()
            take(stream)  # its end: aborted, or finished before the loop saw the cancel (a loaded machine)
            if served.stats["aborted"] == 2:
                break
        assert served.stats["aborted"] == 2
        got, error = take(served.submit([7], 3))
        assert got == [] and error is not None and "no progress" in str(error), (got, error)
    finally:
        served.close()


def test_an_engine_turned_ten_times_slower_is_reported_then_removed():
    """After ARM_AFTER requests each step takes ~10x: with slow_window_s 1 it is reported within two windows and
    stays in service (slow_action report); switched to remove, it is out at the next tick."""
    served = serve("slower_after", canary_every=0, slow_window_s=1.0, slow_factor=3.0)
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                streams = [served.submit([i, i + 1], N) for i in range(4)]
                for s in streams:
                    take(s)
            except ServedGeneratorError:
                return

    try:
        arm(served, ARM_AFTER)
        clients = [threading.Thread(target=load) for _ in range(2)]
        start = time.perf_counter()
        for c in clients:
            c.start()
        wait_for(lambda: served.speed.report is not None, 30, "the slow report", poll_s=POLL_S)
        took = time.perf_counter() - start
        assert served.speed.report is not None and took <= 2 * 1.0 + 2.0, (took, served.speed.report)
        assert served.failure is None and "slower than judged" in served.speed.report["message"]
        served.policy = ServePolicy(canary_every=0, slow_window_s=1.0, slow_factor=3.0, slow_action="remove")
        wait_for(lambda: served.failure is not None, 10, "the slow engine's removal", poll_s=POLL_S)
        assert "slower than judged" in str(served.failure) and "slow_action: remove" in str(served.failure)
    finally:
        stop.set()
        served.close()


# ---------------------------------------------------------------------------- rules, draws and config, no engine
def test_the_token_rules():
    request = GenerationRequest(5, (1, 2), 3, (7,))
    assert breach(request, 1, 4, False, V) == "" and breach(request, 3, 4, True, V) == ""
    assert breach(request, 2, 7, True, V) == ""  # a stop id, marked
    assert "outside the vocabulary" in breach(request, 1, V, False, V)
    assert "marked finished after 1 of its 3" in breach(request, 1, 4, True, V)
    assert "not marked finished" in breach(request, 3, 4, False, V)
    assert "(a stop id) not marked" in breach(request, 1, 7, False, V)
    judged = Judged(e2e_p99_s=0.5, itl_median_s=0.01, concurrency=4, source="test")
    policy = ServePolicy(stall_factor=4.0, stall_floor_s=1.0)
    assert stall_deadline(policy, judged, 1) == 2.0 and stall_deadline(policy, judged, 9) == 6.0
    assert stall_deadline(ServePolicy(stall_floor_s=10.0), judged, 1) == 10.0


def test_the_speed_watch_reports_a_whole_slow_window_once():
    watch, judged = SpeedWatch(), Judged(1.0, 0.010, 4, "test")
    policy = ServePolicy(slow_factor=4.0, slow_window_s=1.0)
    for i in range(50):
        watch.record(i * 0.02, 0.012)  # 1.2x: fine
    assert watch.judge(policy, judged, 1.0) == "" and watch.report is None
    for i in range(100):
        watch.record(1.0 + i * 0.02, 0.060)  # 6x
    assert watch.judge(policy, judged, 2.0) == ""  # slow, not yet for a whole window
    assert "6.0x slower than judged" in watch.judge(policy, judged, 3.01)
    assert watch.judge(policy, judged, 3.05) == "" and watch.slow_now  # once per episode
    assert watch.judge(policy, judged, 10.0) == "" and not watch.slow_now  # no tokens: the episode ended


def test_canaries_look_like_recent_user_requests():
    canaries = Canaries(V, P, N)
    first = canaries.draw(10)
    assert 1 <= len(first.prompt) <= P and 1 <= first.max_tokens <= N  # before any user: random ids
    users = [GenerationRequest(i, tuple(range(i, i + 12)), 5, (3,), 0.7, 0.9, i) for i in range(4)]
    for user in users:
        canaries.remember(user)
    kinds = set()
    for i in range(200):
        canary = canaries.draw(100 + i)
        assert canary.id == 100 + i and canary.max_tokens == 5 and canary.stop_ids == (3,)
        assert (canary.temperature, canary.top_p) == (0.7, 0.9)
        kind = next(k for k in (window_or_variant(canary.prompt, u.prompt) for u in users) if k)
        kinds.add(kind)
    assert kinds == {"window", "variant"}
    assert sum(canaries.due(8) for _ in range(4000)) in range(350, 650) and not any(canaries.due(0) for _ in range(99))


@pytest.mark.parametrize("key, value, says", [
    ("verify", "some", r"'verify' must be one of \['sampled', 'all'\], got 'some'"),
    ("verify_chunk", 0, r"'verify_chunk' must be an integer in \[1, 4096\]"),
    ("canary_every", -1, r"'canary_every' must be an integer in \[0, "),
    ("canary_every", 2.5, r"'canary_every' must be an integer"),
    ("slow_action", "kill", r"'slow_action' must be one of \['report', 'remove'\]"),
    ("slow_factor", 1, r"'slow_factor' must be a number in \(1, 1e6\]"),
    ("slow_window_s", 0, r"'slow_window_s' must be seconds in \(0, 3600\]"),
    ("stall_factor", "4", r"'stall_factor' must be a number in \[1, 1e6\]"),
    ("stall_floor_s", True, r"'stall_floor_s' must be seconds"),
])
def test_bad_policy_keys_are_refused_naming_the_key_and_what_it_allows(key, value, says):
    with pytest.raises(ValueError, match=says):
        check_user_config({"engine": "default:llama_serve/cpu_small", key: value})
    config = check_user_config({"engine": "default:llama_serve/cpu_small", "verify": "all", "canary_every": 0})
    assert ServePolicy.from_config(config) == ServePolicy(verify="all", canary_every=0)


def test_a_failing_generation_engine_tells_the_replica_which_takes_it_out_of_service():
    """The engine's own threads call `on_failure`: the replica falls back to the previous engine, or fails its
    health check naming why (no request needed to find out)."""
    from evo.serving.app import EngineServer
    from evo.serving.generation import LoadedGenerator

    def loaded(name: str) -> LoadedGenerator:
        record = SimpleNamespace(genome=SimpleNamespace(hash=name), source=f"test:{name}")
        return LoadedGenerator(record, SimpleNamespace(on_failure=None, close=lambda: None), None, "cpu", "", 0.0)

    server = object.__new__(EngineServer.func_or_class)  # its state and methods, without Serve's wrapper
    bad, good = loaded("bad"), loaded("good")
    server.loaded, server.previous, server.out_of_service, server.last_swap = bad, None, None, None
    server._watch(bad)
    bad.engine.on_failure("request 7: a token for a request the engine does not hold")
    with pytest.raises(RuntimeError, match="taken out of service by the replica's serving checks: request 7"):
        server.check_health()
    server.loaded, server.previous, server.out_of_service = bad, good, None
    bad.engine.on_failure("stalled")
    server.check_health()
    assert server.loaded is good and server.last_swap["reason"] == "stalled"


def test_verify_all_is_refused_for_a_call_engine():
    from evo.serving.app import LoadedEngine, check_batch

    record = SimpleNamespace(genome=SimpleNamespace(hash="call1"))
    call = LoadedEngine(record, None, (), "cpu", "", 0.0, 0.0, max_batch=8)
    with pytest.raises(ValueError, match="'verify' 'all' is for generation engines"):
        check_batch({"max_batch_size": None, "verify": "all"}, call)
    assert check_batch({"max_batch_size": None, "verify": "sampled"}, call)["max_batch_size"] == 8
