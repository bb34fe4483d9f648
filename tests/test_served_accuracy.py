"""Serve checks the accuracy contract its engine's run declared (evaluators.served.estimate; strict sandbox,
llama_serve cpu_small engines of tests.accuracy_cheats that pick tokens from float32 logits).

In budget mode no checked token is held to the rule on its own: every check the replica makes (verified prefixes
under `verify: all`, re-scored requests under `sampled`) marks one running estimate, judged by the budget after
each check. The honest picker keeps serving and /v1/engine reports its estimate; an engine that steers near ties
too rarely for one check replay to tell (the budget's tie window is narrow: a few such ties per check replay)
passes the judge's check, then its running estimate breaks the budget within a few dozen requests and it is taken
out of service naming the budget. In exact mode every checked token is still held to the rule. The mode reaches
Serve from the engine's record (`evo.serving.generation.run_accuracy`)."""
from __future__ import annotations

import json
import math
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from evaluators.judge import accuracy
from evaluators.judge.accuracy import AccuracyContract, Budget, Marks, Tally
from evaluators.served.estimate import RunningEstimate
from evaluators.served.generator import ServedGenerator, ServedGeneratorError
from evaluators.served.guards import ServePolicy
from evaluators.settings import EvaluatorSettings
from evo.serving.generation import LoadedGenerator, run_accuracy
from evo.serving.openai_api import Limits
from evo.serving.rescoring import Rescorer
from evo.workloads import get_workload
from tests.accuracy_cheats import STEER
from tests.waiting import wait_for

W = get_workload("tests.accuracy_cheats")
PRESET = W.presets()["cpu_small"]
V, N, P = PRESET.shape["V"], PRESET.shape["N"], PRESET.shape["P"]
# Lax on agreement and gaps (steer keeps ~64% of picks, its gaps below STEER), strict on steering: the toy model has
# a runner-up within 0.005 at ~2% of steps, so a check replay (~110 steps) holds two or three such ties, too few to
# tell (10 flipped of 10 is p < 1e-3), and a few dozen served requests hold enough.
BUDGET = {"mode": "budget", "min_agreement": 0.5, "max_mean_gap": 0.05, "max_gap": 0.3, "tie_window": 0.005}
MAX_REQUESTS = 240  # steer breaks the budget after ~30 to ~60 requests; this bounds a wrong test's time


def serve(cheat: str, contract: dict, **policy) -> ServedGenerator:
    from evaluators.machine import device as devices

    genome = W.gene_space(PRESET, devices.device_info("cpu", 1)).make({"cheat": cheat}).to_json()
    return ServedGenerator("tests.accuracy_cheats", "cpu_small", genome,
                           settings=EvaluatorSettings(replays=1, accuracy=contract), max_waiting=64,
                           policy=ServePolicy(**policy))


def prompts(rng: np.random.Generator, k: int) -> list[list[int]]:
    return [rng.integers(0, V, P).tolist() for _ in range(k)]


def answered(served: ServedGenerator, asks: list[list[int]]) -> list[list[int] | None]:
    """Each prompt's N tokens, the requests sent at once (the engine batches them); None where it failed."""
    streams = [served.submit(prompt, N) for prompt in asks]
    got = []
    for stream in streams:
        try:
            got.append([t.token for t in stream])
        except ServedGeneratorError:
            got.append(None)
    return got


def steered(prompt: list[int]) -> list[int]:
    """What `steer` answers, read off the float64 reference: the runner-up wherever it lies within STEER."""
    tokens: list[int] = []
    for _ in range(N):
        row = W.reference_logits(PRESET, prompt, [*tokens, 0])[-1]
        first, second = np.argsort(-row, kind="stable")[:2]
        tokens.append(int(second if row[first] - row[second] < STEER else first))
    return tokens


def greedy(prompt: list[int]) -> list[int]:
    tokens: list[int] = []
    for _ in range(N):
        tokens.append(int(np.argmax(W.reference_logits(PRESET, prompt, [*tokens, 0])[-1])))
    return tokens


def reported(served: ServedGenerator, judged: dict | None = None) -> dict:
    """/v1/engine's `accuracy` for `served` (`LoadedGenerator.info`), through strict JSON as the app answers it."""
    record = SimpleNamespace(accuracy=judged) if judged is not None else SimpleNamespace()
    loaded = LoadedGenerator(record, served, Limits("m", P, N, V), "cpu", "", 0.0)
    return json.loads(json.dumps(loaded.info()["accuracy"], allow_nan=False))


# ---------------------------------------------------------------------------- budget mode
def test_in_budget_mode_the_honest_engine_keeps_serving_and_its_running_estimate_is_reported():
    served = serve("picker", BUDGET, verify="all", verify_chunk=4, canary_every=0)
    rng = np.random.default_rng(3)
    try:
        asks = prompts(rng, 12)
        assert all(got is not None and len(got) == N for got in answered(served, asks))
        served.policy = ServePolicy(verify="sampled", canary_every=1)  # canaries: checked whole, same estimate
        assert all(got is not None for got in answered(served, prompts(rng, 4)))
        wait_for(lambda: served.idle, 30, "the canaries' checks", poll_s=0.01)
        prompt = next(p for p in prompts(rng, 50) if steered(p) != greedy(p))
        stream = served.submit(prompt, N)
        assert [t.token for t in stream] == greedy(prompt)
        assert served.rescore(stream.request, steered(prompt)) == ("", 0.0)  # no token held to the rule alone
        assert served.failure is None
        info = reported(served, judged={"mode": "budget", "agreement": 0.99, "mean_gap": math.nan})
        assert info["mode"] == "budget" and info["breach"] is None
        assert info["budget"] == {**{k: v for k, v in BUDGET.items() if k != "mode"}, "tie_alpha": 1e-3,
                                  "request_alpha": 1e-3, "basis": "config", "short_max_gap": [],
                                  "recheck": "", "factor": 2.0}  # a config's max_gap: held at every step
        assert info["requests_in_estimate"] >= 12 + 4 + 1  # every request under `all`, the canaries, the re-scored
        assert info["figures"]["requests"] == info["requests_in_estimate"]
        assert info["figures"]["steps"] >= 17 * N and 0.9 < info["figures"]["agreement"] < 1.0
        assert info["judged"] == {"mode": "budget", "agreement": 0.99, "mean_gap": None}  # NaN: null in JSON
    finally:
        served.close()


def test_under_verify_all_a_steering_engine_passes_the_check_and_its_running_estimate_takes_it_out():
    served = serve("steer", BUDGET, verify="all", verify_chunk=N, canary_every=0)
    told: list[str] = []
    served.on_failure = told.append
    rng = np.random.default_rng(5)
    try:
        sent = 0
        while served.failure is None and sent < MAX_REQUESTS:
            answered(served, prompts(rng, 8))
            sent += 8
        assert served.failure is not None, served.estimate.info()
        why = str(served.failure)
        assert "running estimate" in why and "the accuracy budget: near ties steered" in why, why
        assert "tolerance" not in why  # no token was held to the exact rule
        assert wait_for(lambda: told, 10, "the replica told", poll_s=0.01) == [why]  # it takes the engine out
        info = reported(served)
        assert info["breach"] and info["figures"]["tie_flips"] == info["figures"]["ties"] >= 10
        with pytest.raises(ServedGeneratorError, match="near ties steered"):
            served.submit([1], 1)
    finally:
        served.close()


def test_under_sampled_rescoring_a_steering_engine_is_taken_out_by_its_running_estimate():
    """The replica's live re-scoring (every answer sampled here) feeds the same estimate."""
    served = serve("steer", BUDGET, verify="sampled", canary_every=0)
    removed: list[str] = []
    done = threading.Event()
    rescorer = Rescorer(lambda loaded, why: (removed.append(why), done.set()))
    rescorer.fraction = 1.0
    loaded = SimpleNamespace(engine=served, record=SimpleNamespace(genome=SimpleNamespace(hash=served.label)))
    rng = np.random.default_rng(7)
    try:
        sent = 0
        while not done.is_set() and sent < MAX_REQUESTS:
            asks = prompts(rng, 8)
            streams = [served.submit(prompt, N) for prompt in asks]
            rescorer.offer(loaded, [(s.request, [t.token for t in s]) for s in streams])
            rescorer.wait_idle()
            sent += 8
        assert removed and "answered a served call wrongly: its running estimate" in removed[0], removed
        assert "the accuracy budget: near ties steered" in removed[0]
        assert served.estimate.info()["requests_in_estimate"] <= sent
    finally:
        served.close()


# ---------------------------------------------------------------------------- exact mode
def test_in_exact_mode_every_checked_token_is_held_to_the_rule():
    """The steering engine fails the judge's check replay in exact mode, naming the near-tie tolerance; an honest
    engine serves, and a steered answer re-scored there fails on its own token (budget mode lets the same answer
    by: one request's loss is the budget's to judge, above)."""
    with pytest.raises(ServedGeneratorError, match="beyond the near-tie tolerance"):
        serve("steer", {"mode": "exact"})
    served = serve("picker", {"mode": "exact"}, verify="all", verify_chunk=4, canary_every=0)
    try:
        prompt = next(p for p in prompts(np.random.default_rng(11), 50) if steered(p) != greedy(p))
        request = served.submit(prompt, N).request
        assert [t.token for t in served.submit(prompt, N)] == greedy(prompt)
        problem, _ = served.rescore(request, steered(prompt))
        assert "beyond the near-tie tolerance" in problem, problem
        info = reported(served)
        assert info["mode"] == "exact" and "budget" not in info and info["breach"] is None
        assert info["requests_in_estimate"] >= 2  # exact mode reports the estimate too
    finally:
        served.close()


# ---------------------------------------------------------------------------- the estimate and the mode's way in
def _judge(budget: Budget | None):
    contract = AccuracyContract("budget" if budget else "exact", budget)
    return SimpleNamespace(tally=lambda: Tally(0.15), accuracy=contract,
                           breach=lambda t: f"the accuracy budget: {budget.breach(t)}" if budget and budget.breach(t)
                           else "")


def _checked(name: str, agree: list[bool], gap: list[float]) -> Tally:
    tally = Tally(0.15)
    tally.add(name, Marks(np.array(agree), np.array(gap, float), np.zeros(len(agree), bool)))
    return tally


def test_the_running_estimate_keeps_the_most_recent_requests_and_a_re_marked_prefix_replaces_its_marks():
    estimate = RunningEstimate(_judge(Budget(0.5, 1.0, 0.3, 0.15)), window=3)
    for i in range(4):
        assert estimate.add(_checked(f"request {i}", [True], [0.0])) == ""
    estimate.add(_checked("request 1", [True, True], [0.0, 0.0]))  # a longer prefix: now the most recent
    estimate.add(_checked("request 4", [True], [0.0]))
    info = estimate.info()
    assert info["requests_in_estimate"] == 3 and info["figures"]["steps"] == 4  # requests 3, 1 (2 steps), 4
    why = estimate.add(_checked("request 5", [False], [0.5]))  # the largest gap holds on every token
    assert why.startswith("its running estimate over the 3 requests checked last breaks the accuracy budget: ")
    assert "beyond the budget's largest gap 0.3" in why and estimate.info()["breach"] == why
    exact = RunningEstimate(_judge(None))
    assert exact.add(_checked("request 0", [False], [5.0])) == "" and exact.info()["mode"] == "exact"
    assert RunningEstimate(_judge(None)).info()["figures"]["agreement"] is None  # nothing yet: null, not NaN


def test_serve_judges_an_engine_under_the_contract_its_record_carries(tmp_path):
    """The record's judged contract: its budget's every bound (no recalibration), exact as exact; a run directory
    without one: its config's `evaluator.accuracy`; neither: the preset's default ({})."""
    budget = Budget(0.93, 0.02, 0.25, 0.1, 1e-4, 1e-3, basis="calibrated: 2 x an honest bfloat16 execution")
    judged = {"mode": "budget", "budget": budget.to_dict(), "agreement": 0.97}
    setting = run_accuracy(SimpleNamespace(accuracy=judged, source="models:/x/1"))
    assert accuracy.resolve(EvaluatorSettings(accuracy=setting).accuracy, W, PRESET).budget == Budget(
        0.93, 0.02, 0.25, 0.1, 1e-4, 1e-3, basis="config")
    assert run_accuracy(SimpleNamespace(accuracy={"mode": "exact", "agreement": 1.0}, source="x")) == {"mode": "exact"}
    (tmp_path / "config.yaml").write_text("workload: llama_serve\nevaluator:\n  accuracy: {mode: budget, factor: 3}\n")
    assert run_accuracy(SimpleNamespace(source=str(tmp_path))) == {"mode": "budget", "factor": 3}
    assert run_accuracy(SimpleNamespace(accuracy={}, source="default:llama_serve/cpu_small")) == {}
    (tmp_path / "config.yaml").write_text("evaluator: [unclosed\n")
    with pytest.raises(ValueError, match="config.yaml: cannot read the run's config"):
        run_accuracy(SimpleNamespace(source=str(tmp_path)))
