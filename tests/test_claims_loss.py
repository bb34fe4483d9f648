"""Every claim carries its loss (issue 39): a generation engine's accuracy against the float64 reference
(`EvalResult.accuracy`, evaluators/judge/accuracy.py) flows from its evaluation into the summary and is worded
by evo.evidence.claims wherever the claim is: the terminal and `evo report`, MLflow's run and version, the
engine record behind `/v1/engine` and `evo serve`. A call engine's claim is unchanged. No Ray, no MLflow store."""
from __future__ import annotations

import dataclasses
import json

from evaluators.judge.synthetic import SyntheticEvaluator
from evo.core.loop import LocalExecutor, run_search
from evo.core.records import EvalResult
from evo.core.search import Search, SearchSettings
from evo.evidence.claims import claim_lines, claim_sentence, short_claim
from evo.evidence.engine_record import EngineRecord, record_from_summary
from evo.evidence.mlflow.describe import run_description, version_tags
from evo.evidence.summary import Summary, make_summary
from evo.serving.source import resolve
from operators.team import LocalTeam
from tests.test_records import LOSS
from tests.toy_space import toy_space

EXACT = {"mode": "exact", "steps": 208, "requests": 38, "agreement": 0.998, "agreement_ci": [0.993, 0.999],
         "mean_gap": 0.0002, "mean_gap_ci": [0.0, 0.0005], "max_gap": 0.01, "max_gap_at": "request 2 step 7",
         "ties": 3, "tie_flips": 1, "tie_p": 0.875}
ENGINE = resolve("default:llama_serve/cpu_small")  # a generation engine's genome
SUMMARY = Summary(workload="llama_serve", preset="cpu_small", best_hash=ENGINE.genome.hash,
                  best_genome=ENGINE.genome.to_dict(), best_latency_ms=2.0, best_latency_spread_ms=0.1, device="cpu",
                  speedups={"hf_static": 2.2}, speedup_paired={"hf_static": 1.9}, speedup_ci={"hf_static": [1.7, 2.1]},
                  baselines={"hf_static": {"status": "ok", "latency_ms": 4.4}}, accuracy={"best": LOSS})
PAIRED = f"{ENGINE.genome.hash} is 1.90x faster than hf_static (paired, 95% [1.70, 2.10])"


def test_a_budget_mode_claim_says_what_it_lost_everywhere_it_is_worded():
    budget = "top-1 agreement 99.4% [99.1, 99.6], mean gap 0.003 logits (budget mode)"
    assert claim_sentence(SUMMARY, code="") == f"{PAIRED} at {budget}"
    assert short_claim(SUMMARY) == "1.90x vs hf_static [1.70, 2.10] paired at 99.4% top-1"
    lines = claim_lines(SUMMARY)
    assert lines[0] == f"{PAIRED} at {budget}"
    assert "  accuracy (budget mode): top-1 agreement 99.4% [99.1, 99.6], mean gap 0.003 [0.001, 0.005] logits, " \
           "largest gap 0.12 at request 5 step 3" in lines
    assert any("the other token in 10 of 65 near ties" in line and "208 steps of 38 requests" in line for line in lines)
    assert "    budget: top-1 agreement >= 90.0%, mean gap <= 0.05, largest gap <= 0.3 logits, near ties within 0.15 " \
           "not steered (p >= 0.001); config" in lines
    assert not any("every request's tokens those of the float64 reference" in line for line in lines)
    banded = dataclasses.replace(SUMMARY, accuracy={"best": {**LOSS, "budget": {**LOSS["budget"], "short_max_gap": [[2, 17.8]]}}})
    assert any("largest gap <= 0.3 logits, <= 18 after <= 2 tokens, near ties" in line for line in claim_lines(banded))
    rechecked = dataclasses.replace(SUMMARY, accuracy={"best": {**LOSS, "budget": {**LOSS["budget"], "recheck": "bfloat16",
                                                                                  "factor": 2.0}}})
    assert any("largest gap <= 0.3 logits (past it: 2 x an honest bfloat16 execution of its context), near ties" in line
               for line in claim_lines(rechecked))
    tags = version_tags(SUMMARY, "r1", "/runs/x")
    assert tags["accuracy_mode"] == "budget" and tags["accuracy"] == budget and tags["claim"].endswith(budget)
    first, second = run_description(SUMMARY, "/runs/x").splitlines()[:2]
    assert first == f"**`{ENGINE.genome.hash}` is 1.90x faster than hf_static (paired, 95% [1.70, 2.10]) at {budget}.**"
    assert second.endswith(f", {budget}.") and "max relative error" not in second


def test_an_exact_mode_claim_says_so_and_a_call_engines_is_unchanged():
    exact = dataclasses.replace(SUMMARY, accuracy={"best": EXACT})
    assert claim_sentence(exact, code="") == \
        f"{PAIRED} (exact mode: every token the float64 reference's, near ties allowed)"
    assert short_claim(exact).endswith("paired, exact tokens")
    assert any(line.startswith("  accuracy (exact mode: every token the float64 reference's pick or a near tie): "
                               "top-1 agreement 99.8% [99.3, 99.9]") for line in claim_lines(exact))
    assert not any("budget:" in line for line in claim_lines(exact))
    assert version_tags(exact, "r1", "/x")["accuracy_mode"] == "exact"
    call = dataclasses.replace(SUMMARY, accuracy={})
    assert claim_sentence(call, code="") == PAIRED and short_claim(call) == "1.90x vs hf_static [1.70, 2.10] paired"
    assert not any("accuracy" in line for line in claim_lines(call))
    tags = version_tags(call, "r1", "/x")
    assert tags["accuracy_mode"] == "tolerance" and "accuracy" not in tags
    unscored = dataclasses.replace(SUMMARY, accuracy={"best": {**LOSS, "agreement": None, "steps": 0}})
    assert claim_sentence(unscored).endswith("at no step scored (budget mode)")  # JSON's null for NaN


def test_the_engine_record_carries_the_loss_to_its_claim_and_engine_json():
    record = record_from_summary(SUMMARY, "runs/x")
    claim = record.claim()
    assert claim["accuracy_mode"] == "budget" and claim["loss"].startswith("top-1 agreement 99.4%")
    assert claim["text"] == ("1.90x [1.70, 2.10] vs hf_static (paired re-timing, 95% interval) at top-1 agreement "
                             "99.4% [99.1, 99.6], mean gap 0.003 logits (budget mode)")
    lossy = dataclasses.replace(record, accuracy={**LOSS, "max_gap": float("inf"), "tie_p": float("nan")})
    saved = json.loads(json.dumps(lossy.to_dict(), allow_nan=False))  # engine.json and /v1/engine: strict JSON
    assert saved["accuracy"]["max_gap"] is None and EngineRecord.from_dict(saved, "y").claim() == claim
    old = {k: v for k, v in saved.items() if k != "accuracy"}  # an engine.json written before the loss
    before = EngineRecord.from_dict(old, "y")
    assert before.accuracy == {} and "accuracy_mode" not in before.claim()


class _Lossy(SyntheticEvaluator):
    """The synthetic evaluator, each of its results with the loss a generation judge records."""

    def evaluate(self, genome_json: str, sources=None) -> EvalResult:
        return dataclasses.replace(super().evaluate(genome_json), accuracy=LOSS)


def test_the_summary_takes_each_engines_loss_from_its_evaluation_and_reads_older_files():
    settings = SearchSettings(seed=0, generations=1, offspring=2, max_evaluations=3, agents=("fusion",))
    space = toy_space()
    search = Search(space, settings, LocalTeam(list(settings.agents), space, settings.seed))
    run_search(search, LocalExecutor(_Lossy()))
    baselines = {"hf_static": EvalResult("baseline:hf_static", "ok", latency_ms=5.0, accuracy=EXACT),
                 "call_like": EvalResult("baseline:call_like", "ok", latency_ms=6.0)}
    summary = make_summary(search, baselines, None, "toy", "cpu", 1.0)
    assert summary.accuracy == {"best": LOSS, "hf_static": EXACT}  # as `serving`: only engines that have one
    back = Summary.from_dict(json.loads(json.dumps(summary.to_dict())))
    assert back.accuracy == summary.accuracy
    old = {k: v for k, v in summary.to_dict().items() if k != "accuracy"}  # summary.json before the loss
    assert Summary.from_dict(old).accuracy == {}


def test_the_claim_says_how_the_best_was_chosen_without_calling_zero_re_timings_confirmed():
    from evo.evidence.claims import _how_chosen

    assert _how_chosen({}) == "chosen by single timing: paired re-timing was off"
    assert _how_chosen({"retimings": 0, "budget": 2}) == "chosen by single timing: paired re-timing was on but ran no re-timing"
    assert _how_chosen({"retimings": 3}) == "its wins confirmed by 3 paired re-timing(s)"
