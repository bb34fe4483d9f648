"""The judge of generation engines (evaluators.judge.generation), through the Evaluator's full path: the
engine built in the strict sandbox, replayed as a client, every request scored on its own tokens against
the float64 reference. An engine that reads ahead, answers from a one-shot forward, depends on its batch
mates, stops early or runs past max_tokens is incorrect; one that sleeps and bursts gets the TTFT a client
sees; the honest engine is ok, its latency the objective read off the judge's own clock."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from evaluators.judge.evaluator import Evaluator
from evaluators.settings import EvaluatorSettings
from evo.core.records import INCORRECT, OK

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = EvaluatorSettings(replays=1, build_timeout_s=120, eval_timeout_s=240)


@pytest.fixture(scope="module")
def judge():
    evaluator = Evaluator("tests.serve_cheats", "cpu_small", SETTINGS, seed=30, name="generation-judge")
    yield evaluator
    evaluator.close()


def _genome(judge, cheat: str) -> str:
    return judge.workload.gene_space(judge.preset, judge.device_info()).make({"cheat": cheat}).to_json()


@pytest.fixture(scope="module")
def honest(judge):
    return judge.evaluate(_genome(judge, "none"))


def test_the_honest_engine_is_ok_and_its_latency_is_the_objective_on_the_judges_clock(honest, judge):
    assert honest.status == OK, honest.message
    serving = honest.serving
    assert serving["objective"] == "ms_per_output_token" and serving["requests"] == judge.preset.trace.count
    assert serving["completed"] == judge.preset.trace.count
    assert honest.latency_ms == pytest.approx(1e3 * serving["duration_s"] / serving["total_output_tokens"])
    assert serving["output_throughput"] == pytest.approx(1e3 / honest.latency_ms)
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(serving[name]) == {"mean", "median", "p90", "p99"} and math.isfinite(serving[name]["median"])
    assert "check replay" in honest.message


# a wrong token (greedy or sampled: "step 3: token 17, ..."); a stop id missed (the end marked where the right
# token was one), or run past (the right token was not)
WRONG_TOKEN = (r"step \d+: token \d+", "without a stop id", "not marked finished")


@pytest.mark.parametrize("cheat, says", [
    ("one_shot", WRONG_TOKEN),
    ("precog", ("never sent",)),
    ("batch_mate", WRONG_TOKEN),
    ("early_stop", ("without a stop id",)),
    ("past_max", ("after its last",)),
])
def test_an_engine_that_does_not_decode_its_own_tokens_is_incorrect(judge, cheat, says):
    result = judge.evaluate(_genome(judge, cheat))
    assert result.status == INCORRECT, (cheat, result.status, result.message)
    assert any(re.search(s, result.message) for s in says) and "request" in result.message, result.message


def test_an_engine_that_sleeps_and_bursts_gets_the_ttft_a_client_sees(judge, honest):
    burst = judge.evaluate(_genome(judge, "sleep_burst"))
    assert burst.status == OK, burst.message  # its tokens are right: only its timing shows
    ttft, e2e = burst.serving["ttft_ms"]["median"], burst.serving["e2el_ms"]["median"]
    assert ttft == pytest.approx(e2e)  # every token arrived with the last
    assert ttft > 2 * honest.serving["ttft_ms"]["median"]
    assert burst.serving["itl_ms"]["median"] == pytest.approx(0.0, abs=1e-3)


def test_a_trace_past_the_presets_verified_bounds_is_refused_naming_them():
    from evo.driver.config import ConfigError, load_config
    from evo.driver.rundir import check_config

    with pytest.raises(ValueError, match=r"concurrency 9 > 4"):
        Evaluator("llama_serve", "cpu_small", EvaluatorSettings(trace={"concurrency": 9}), seed=1)
    for override, says in (("evaluator.trace.rps=3", r"unknown trace key\(s\) \['rps'\]"),
                           ("evaluator.trace.output_len=[1,99]", r"output_len high 99 > 12"),
                           ("evaluator.trace.arrival=poisson", r"rate must be a number")):
        with pytest.raises(ConfigError, match=says):
            check_config(load_config(ROOT / "configs" / "llama_serve_smoke.yaml", [override]))
    with pytest.raises(ConfigError, match="generation workloads only"):
        check_config(load_config(ROOT / "configs" / "kda_smoke.yaml", ["evaluator.trace.count=3"]))
