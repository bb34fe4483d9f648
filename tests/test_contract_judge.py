"""The generation judge exercises the whole contract on traffic an engine cannot tell from a user's
(evaluators.judge.traffic, evaluators.judge.generation), through the Evaluator's full path: engines wrong only
with stop ids, for sampled tokens past the eighth, beside an aborted row, leaking a row per abort, when queued,
above R + 2 held requests, or honest only on the old judge's traffic (tests/contract_cheats.py; each was judged
ok by the judge before issue 38) are incorrect at every evaluation; one that holds each request's first token
until its last cannot win a TPOT objective, which needs a TTFT bound; the honest engine stays ok. Paired
re-timing gives A and B of a round the same freshly drawn trace, each engine its own id sequence."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from evaluators.judge.evaluator import Evaluator
from evaluators.judge.generation import GenerationJudge
from evaluators.judge.traffic import LONG, SAMPLING, check_sends, draw_timed, stop_case, timed_sends
from evaluators.settings import EvaluatorSettings
from evo.core.records import INCORRECT, OK
from evo.core.retiming import FAILED
from evo.core.stream_metrics import RequestTimeline, Slo, serving_metrics
from evo.core.trace import TraceSpec
from evo.workloads import get_workload

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = EvaluatorSettings(replays=1, build_timeout_s=120, eval_timeout_s=240)
TTFT_BOUND_MS = 2000.0  # the honest engine's TTFT p99 here: ~7 ms, 0.5 s at worst seen (loaded): a wide margin
WRONG = r"step \d+: token|without a stop id|not marked finished"  # a wrong token, a stop id missed or run past


@pytest.fixture(scope="module")
def judge():
    evaluator = Evaluator("tests.contract_cheats", "cpu_small", SETTINGS, seed=38, name="contract-judge")
    yield evaluator
    evaluator.close()


def _genome(judge, cheat: str) -> str:
    return judge.workload.gene_space(judge.preset, judge.device_info()).make({"cheat": cheat}).to_json()


def test_the_honest_engine_is_ok_on_the_whole_contract(judge):
    result = judge.evaluate(_genome(judge, "none"))
    assert result.status == OK, result.message
    assert re.search(r"\d+ requests of 1 timed replays and \d+ of a check replay", result.message)
    assert result.serving["requests"] == result.serving["completed"] == judge.preset.trace.count  # abort left out


@pytest.mark.parametrize("cheat, says", [
    ("stop_ids", WRONG),
    ("sampled_late", r"step ([89]|1\d): token|without a stop id|not marked finished"),
    ("abort_hole", WRONG),  # the request added after it may have stop ids: a wrong token may end it wrongly
    ("abort_leak", r"no token in \d+ steps while the engine held it"),
    ("queued", WRONG),
    ("truncates", r"without a stop id"),
    ("judge_shaped", WRONG),
])
def test_an_engine_wrong_in_a_corner_of_the_contract_is_incorrect_every_time(judge, cheat, says):
    for _ in range(2):
        result = judge.evaluate(_genome(judge, cheat))
        assert result.status == INCORRECT, (cheat, result.status, result.message)
        assert re.search(says, result.message) and "request" in result.message, result.message


def test_a_tpot_objective_is_scored_under_a_ttft_bound_so_holding_tokens_back_does_not_win():
    settings = EvaluatorSettings(replays=1, build_timeout_s=120, eval_timeout_s=240, objective="tpot_median_ms",
                                 slo={"ttft_ms": TTFT_BOUND_MS})
    evaluator = Evaluator("tests.contract_cheats", "cpu_small", settings, seed=5, name="tpot-judge")
    try:
        honest = evaluator.evaluate(_genome(evaluator, "none"))
        assert honest.status == OK, honest.message
        assert honest.latency_ms == pytest.approx(honest.serving["tpot_ms"]["median"])
        held = evaluator.evaluate(_genome(evaluator, "held_first"))  # its TPOT ~0: it would have won
        assert held.status == INCORRECT, held.message
        assert re.search(rf"objective tpot_median_ms is scored under slo.ttft_ms: TTFT p99 [\d.]+ ms over "
                         rf"{TTFT_BOUND_MS:g}: not ranked", held.message), held.message
    finally:
        evaluator.close()


@pytest.mark.parametrize("objective, bound", [("tpot_median_ms", "ttft_ms"), ("tpot_p99_ms", "ttft_ms"),
                                              ("ttft_p99_ms", "tpot_ms")])
def test_an_objective_holding_tokens_could_game_is_refused_without_its_bound(objective, bound):
    from evo.driver.config import ConfigError, load_config

    with pytest.raises(ValueError, match=rf"objective='{objective}' needs slo\.{bound} \(ms\)"):
        EvaluatorSettings(objective=objective, slo={"e2e_ms": 100})
    assert EvaluatorSettings(objective=objective, slo={bound: 100}).objective == objective
    with pytest.raises(ConfigError, match=rf"needs slo\.{bound}"):
        load_config(ROOT / "configs" / "llama_serve_smoke.yaml", [f"evaluator.objective={objective}"])


def test_a_ttft_objective_is_not_ranked_past_its_tpot_bound():
    workload = get_workload("llama_serve")
    settings = EvaluatorSettings(objective="ttft_p99_ms", slo={"tpot_ms": 5.0})
    judge = GenerationJudge(SimpleNamespace(workload=workload, preset=workload.presets()["cpu_small"],
                                            settings=settings))
    # a first token at once, then one token every 10 ms: a TTFT to win with, a TPOT of 10 ms
    crawl = [RequestTimeline(0.0, tuple(0.001 + 0.01 * i for i in range(5)), 3)] * 4
    problem = judge._bound(serving_metrics(crawl, 1.0, Slo(tpot_ms=5.0)), "timed replay 1")
    assert problem[0] == INCORRECT and "objective ttft_p99_ms is scored under slo.tpot_ms: TPOT p99 10 ms over 5" \
        in problem[1]
    brisk = [RequestTimeline(0.0, tuple(0.001 + 0.002 * i for i in range(5)), 3)] * 4
    assert judge._bound(serving_metrics(brisk, 1.0), "timed replay 1") is None


def _fake_prefix(request, k):
    return [7] * k  # the reference's first k tokens, as far as these shape tests care


def test_the_check_replay_covers_the_contract_with_fresh_shapes_every_time():
    shape = {"R": 16, "P": 256, "N": 128, "V": 4096}
    draws = [check_sends(shape, np.random.default_rng(seed), _fake_prefix) for seed in (1, 2)]
    for sends in draws:
        burst = [s for s in sends if s.after is None]
        victims = [s for s in sends if s.abort_after]
        assert len(burst) >= 2 * 16 + 2 and all(s.arrival_s == 0.0 for s in burst)  # no cap: the engine queues
        assert len(victims) == 2 * 16 + 1 and all(1 <= s.abort_after < s.request.max_tokens for s in victims)
        assert len(sends) - len(burst) == len(victims)  # every abort followed by a new request
        for i, send in enumerate(burst):  # a burst's aborted request is never the last added, and its neighbour
            if send.abort_after:  # outlives the abort
                assert burst[i + 1].request.max_tokens >= LONG and not burst[i + 1].request.stop_ids
        sampled = {(s.request.temperature, s.request.top_p) for s in sends if s.request.max_tokens >= 9}
        assert set(SAMPLING) <= sampled
        assert any(7 in s.request.stop_ids for s in sends)  # a stop id the reference hits
        lengths = [len(s.request.prompt) for s in sends]
        assert 1 in lengths and 256 in lengths
    assert [len(s.request.prompt) for s in draws[0]] != [len(s.request.prompt) for s in draws[1]]
    greedy = check_sends(shape, np.random.default_rng(1), _fake_prefix, greedy_only=True)
    assert all(s.request.greedy for s in greedy) and len(greedy) == len(draws[0])  # a greedy-only baseline


def test_a_timed_shape_is_drawn_fresh_and_mixes_in_the_contracts_cases():
    spec = TraceSpec("poisson", count=12, concurrency=4, rate=50.0, prompt_len=(1, 24), output_len=(1, 12), seed=0)
    a, b = draw_timed(spec, np.random.default_rng(1)), draw_timed(spec, np.random.default_rng(2))
    assert a.trace != b.trace  # the trace's seed fixes nothing
    sends = timed_sends(a, np.random.default_rng(3), 256, stop_case(a, np.random.default_rng(5), 256, _fake_prefix))
    again = timed_sends(a, np.random.default_rng(4), 256, stop_case(a, np.random.default_rng(6), 256, _fake_prefix))
    assert len(sends) == 13 and [s.arrival_s for s in sends] == [s.arrival_s for s in again]  # one shape,
    assert [s.request.prompt for s in sends] != [s.request.prompt for s in again]  # fresh prompts
    assert sum(bool(s.abort_after) for s in sends) == 1 and sum(not s.request.greedy for s in sends) == 1
    assert sum(bool(s.request.stop_ids) for s in sends) == 1


def test_paired_rounds_share_a_fresh_trace_and_each_engine_keeps_its_own_request_ids(judge, monkeypatch):
    seen = []
    original = GenerationJudge._timed_replay

    def spy(self, generator, shape, stop, held, deadline, what):
        one, problem = original(self, generator, shape, stop, held, deadline, what)
        seen.append((generator.process, shape, [r.id for r in one.result.requests] if one is not None else []))
        return one, problem

    monkeypatch.setattr(GenerationJudge, "_timed_replay", spy)
    honest = _genome(judge, "none")
    record = judge.compare(honest, honest, calls=6, warmup=1)
    assert record.verdict != FAILED, record.message
    assert judge.generation.held_metrics.completed > judge.preset.shape["R"]  # the last hold's check replay
    processes = list(dict.fromkeys(process for process, _, _ in seen))
    a, b = ([(shape, ids) for process, shape, ids in seen if process is p] for p in processes)
    assert len(a) == len(b) == 7
    assert all(shape_a is shape_b for (shape_a, _), (shape_b, _) in zip(a, b))  # one shape a round
    assert len({tuple(t.max_tokens for t in shape.trace) for shape, _ in a}) > 1  # drawn afresh each round
    for calls in (a, b):
        ids = [i for _, replay_ids in calls for i in replay_ids]
        assert ids == list(range(ids[0], ids[0] + len(ids))) and ids[0] > 1_000_000  # one sequence, continued
