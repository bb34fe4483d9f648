"""The accuracy contract (evaluators/judge/accuracy.py): the figures read off tokens, the budget's tests, the
config's rules; then the judge's full path (tests/accuracy_cheats.py): an engine that steers near ties or is wrong
on one prompt class fails a budget that an honest bfloat16-weights engine passes, and the exact rule rejects it."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import pytest

from evaluators.judge import accuracy
from evaluators.judge.accuracy import Budget, Marks, Tally, binomial_tail, clustered_interval, mark, wilson
from evaluators.settings import EvaluatorSettings, accuracy_mode
from evo.workloads import sampling


@dataclass(frozen=True)
class _Request:
    id: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


def _marks(agree, gap, tie=None) -> Marks:
    agree = np.asarray(agree, bool)
    return Marks(agree, np.asarray(gap, float), np.zeros(len(agree), bool) if tie is None else np.asarray(tie, bool))


BUDGET = Budget(min_agreement=0.9, max_mean_gap=0.05, max_gap=0.3, tie_window=0.15)


# ------------------------------------------------------------------------------------------------ figures
def test_binomial_tail_and_wilson_match_their_definitions():
    for n, k, p in [(10, 7, 0.5), (20, 0, 0.3), (5, 5, 0.1), (40, 3, 0.02)]:
        exact = sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))
        assert binomial_tail(k, n, p) == pytest.approx(exact, rel=1e-9, abs=1e-300)
    low, high = wilson(90, 100)
    assert 0.82 < low < 0.9 < high < 0.95
    assert wilson(100, 100)[1] == pytest.approx(1.0) and wilson(100, 100)[0] > 0.96


def test_the_clustered_interval_widens_when_one_request_holds_the_loss():
    spread = clustered_interval(np.array([1.0] * 10), np.array([10.0] * 10))
    lumped = clustered_interval(np.array([10.0] + [0.0] * 9), np.array([10.0] * 10))
    assert spread[0] == pytest.approx(0.1) == pytest.approx(spread[1])  # same loss in every request: no doubt
    assert lumped[0] < 0.1 < lumped[1] and lumped[1] - lumped[0] > 0.1


def test_marks_read_the_rule_pick_gap_and_ties_off_the_reference_row():
    row = np.array([1.0, 3.0, 2.95, -1.0])
    m = mark(_Request(), [1, 2, 0], np.stack([row] * 3), window=0.1)
    assert m.agree.tolist() == [True, False, False]
    assert m.gap.tolist() == pytest.approx([0.0, 0.05, 2.0])
    assert m.tie.all()  # the runner-up is 0.05 below the pick at every step
    sampled = _Request(temperature=0.7, top_p=0.5, seed=3)
    pick = sampling.choose(row, 0.7, 0.5, 3, 0)
    m = mark(sampled, [pick, 3], np.stack([row, row]), window=0.1)
    assert m.agree[0] and m.gap[0] == 0.0
    assert m.gap[1] >= 3.0  # token 3 lies outside the top_p 0.5 nucleus ({1}): at least 3 logits below its edge


# ------------------------------------------------------------------------------------------------ the budget
def _tally(*requests: Marks) -> Tally:
    tally = Tally(0.15)
    for i, marks in enumerate(requests):
        tally.add(f"request {i}", marks)
    return tally


def test_an_honest_loss_passes_the_budget():
    rng = np.random.default_rng(0)
    requests = []
    for _ in range(40):  # ~2% of tokens off by a small gap, spread over requests; ties taken the short way
        agree = rng.random(12) > 0.02
        tie = rng.random(12) < 0.3
        requests.append(_marks(agree, np.where(agree, 0.0, 0.05), tie & agree | (~agree)))
    tally = _tally(*requests)
    flips = tally.figures()
    assert BUDGET.breach(tally) == "", flips


@pytest.mark.parametrize("requests, says", [
    ([_marks([True] * 11 + [False], [0] * 11 + [0.5])] * 10, r"0.5 logits below the reference's pick, beyond"),
    ([_marks([True] * 7 + [False] * 5, [0.0] * 7 + [0.01] * 5)] * 20, r"top-1 agreement .* below the budget's 90.0%"),
    ([_marks([True] * 8 + [False] * 2, [0.0] * 8 + [0.29] * 2)] * 40, r"mean gap .* over the budget's 0.01"),
    ([_marks([True] * 40 + [False] * 2, [0.0] * 40 + [0.01] * 2, [False] * 40 + [True] * 2)] * 12,
     r"near ties steered: .* 24 of 24 near ties"),
    ([_marks([True] * 12, [0.0] * 12)] * 60 + [_marks([False] * 12, [0.1] * 12)],
     r"12 of 12 tokens not the reference's pick: .* not spread over requests"),
])
def test_each_kind_of_loss_beyond_the_budget_is_named(requests, says):
    budget = Budget(0.7, 0.01, 0.3, 0.15) if "mean gap" in says else BUDGET  # a mean gap alone past 90% agreement
    why = budget.breach(_tally(*requests))
    assert re.search(says, why), why


def test_a_short_context_has_its_own_largest_gap():
    @dataclass(frozen=True)
    class Prompted(_Request):
        prompt: tuple = (7, 8)

    row = np.array([1.0, 3.0, 2.95, -2.0])
    marks = mark(Prompted(), [3, 3, 3], np.stack([row] * 3), window=0.1)  # 5 logits below the pick at each step
    assert marks.context.tolist() == [2, 3, 4]  # the prompt and the tokens before each step
    budget = Budget(0.0, 10.0, 0.3, 0.15, short_max_gap=((2, 6.0), (3, 1.0)))
    assert budget.largest_gaps(marks.context, 3).tolist() == [6.0, 1.0, 0.3]
    why = budget.breach(_tally(marks))
    assert why == ("request 0 step 2: a token 5 logits below the reference's pick, beyond the budget's largest gap "
                   "0.3 at a context of 4 tokens"), why  # the step past its band's bound by most is named, its context too
    assert Budget(0.0, 10.0, 0.3, 0.15, short_max_gap=((4, 6.0),)).breach(_tally(marks)) == ""
    assert "largest gap 4 at a context of 2 tokens" in Budget(0.0, 10.0, 0.3, 0.15, short_max_gap=((4, 4.0),)).breach(
        _tally(marks))
    assert "beyond the budget's largest gap 0.3" in BUDGET.breach(_tally(_marks([False], [5.0])))  # context unknown


def test_a_step_past_the_largest_gap_is_held_to_an_honest_execution_of_its_own_context(monkeypatch):
    @dataclass(frozen=True)
    class Prompted(_Request):
        prompt: tuple = (7,)

    exact = np.array([[3.0, 0, 0, 0], [2.0, 1.0, 0, 0], [3.0, 0, 0, 0]])
    honest = np.array([[3.0, 0, 0, 0], [1.0, 1.6, 0, 0], [3.0, 0, 0, 0]])  # ill-conditioned at step 1 only
    calls = []

    def row_of(rows):
        def row(prompt, context):
            assert tuple(prompt) == (7,)
            calls.append(len(context))
            return rows[len(context) - 1]  # the row predicting context[-1]
        return row

    budget = Budget(0.0, 10.0, 0.3, 0.15, recheck="bfloat16", factor=2.0)
    tally = _tally(mark(Prompted(), [0, 1, 3], exact, window=0.1))  # gaps 0, 1 and 3: steps 1 and 2 past 0.3
    assert budget.over_largest_gap(tally) == [("request 0", 2), ("request 0", 1)]  # the furthest past first
    accuracy.recheck(tally, budget, row_of(exact), row_of(honest))
    error = accuracy._logprob_errors(exact[1:2], honest[1:2])[0]
    assert tally.rechecked == {("request 0", 2): 0.0, ("request 0", 1): pytest.approx(2 * max(1.0, 2 * error))}
    assert budget.breach(tally) == ("request 0 step 2: a token 3 logits below the reference's pick, beyond the "
                                    "budget's largest gap 0.3 at a context of 3 tokens (rechecked against an honest "
                                    "bfloat16 execution of its context)")  # honest arithmetic is exact there
    honest_engine = _tally(mark(Prompted(), [0, 1, 0], exact, window=0.1))
    accuracy.recheck(honest_engine, budget, row_of(exact), row_of(honest))
    accuracy.recheck(honest_engine, budget, row_of(exact), row_of(honest))  # rechecked once: nothing more to do
    assert budget.breach(honest_engine) == "" and calls == [3, 3, 2, 2, 2, 2]
    assert "largest gap 0.3 at a context of 2 tokens" in budget.breach(_tally(mark(Prompted(), [0, 1, 0], exact, 0.1)))

    monkeypatch.setattr(accuracy, "MAX_RECHECKS", 1)  # past the cap, the rest are held to max_gap
    capped = _tally(mark(Prompted(), [0, 1, 3], exact, window=0.1))
    accuracy.recheck(capped, budget, row_of(exact), row_of(honest))
    assert list(capped.rechecked) == [("request 0", 2)]


def test_the_calibration_bounds_short_contexts_apart_and_a_configs_max_gap_everywhere():
    from evo.workloads import get_workload

    workload = get_workload("llama_serve")
    preset = workload.presets()["cpu_small"]
    calibrated = accuracy.resolve({"mode": "budget"}, workload, preset).budget
    assert [band for band, _ in calibrated.short_max_gap] == list(accuracy.SHORT_CONTEXTS)
    assert all(gap > 0 for _, gap in calibrated.short_max_gap) and "contexts of <= 1 tokens" in calibrated.basis
    assert calibrated.recheck == "bfloat16" and calibrated.factor == 2.0  # a calibrated max_gap is rechecked past
    set_by_config = accuracy.resolve({"mode": "budget", "max_gap": 0.5}, workload, preset).budget
    assert set_by_config.short_max_gap == () and set_by_config.recheck == ""  # a config's max_gap holds everywhere


def test_a_request_marked_again_replaces_its_prefix():
    tally = Tally(0.15)
    tally.add("request 1", _marks([True], [0.0]))
    tally.add("request 1", _marks([True, False], [0.0, 0.1]))
    assert tally.steps == 2 and tally.figures().agreement == 0.5


# ------------------------------------------------------------------------------------------------ the config
def test_the_mode_defaults_by_the_preset_dtype_and_bad_settings_are_named():
    assert accuracy_mode({}, "float32") == "exact" and accuracy_mode({}, "bfloat16") == "budget"
    assert accuracy_mode({"mode": "budget"}, "float32") == "budget"
    for bad, says in [({"mode": "fast"}, "mode 'fast' is not one of"), ({"min_agreement": 1.5, "mode": "budget"},
                      "min_agreement must be in"), ({"mode": "exact", "factor": 2}, "mode exact takes no budget"),
                      ({"tolerance": 1}, r"unknown keys \['tolerance'\]"), ({"mode": "budget", "against": "int8"},
                      "calibrate against")]:
        with pytest.raises(ValueError, match=says):
            EvaluatorSettings(accuracy=bad)


def test_an_explicit_budget_needs_no_calibration():
    from evo.workloads import get_workload

    workload = get_workload("llama_serve")
    contract = accuracy.resolve({"mode": "budget", "min_agreement": 0.95, "max_mean_gap": 0.01, "max_gap": 0.2},
                                workload, workload.presets()["cpu_small"])
    assert contract.budget == Budget(0.95, 0.01, 0.2, 0.2, basis="config")
    assert accuracy.resolve({}, workload, workload.presets()["cpu_small"]).budget is None


# ------------------------------------------------------------------------------------------------ the judge's full path
def _evaluator(workload: str, preset: str, accuracy_settings: dict, name: str):
    from evaluators.judge.evaluator import Evaluator

    settings = EvaluatorSettings(replays=1, build_timeout_s=120, eval_timeout_s=240, accuracy=accuracy_settings)
    return Evaluator(workload, preset, settings, seed=39, name=name)


def _genome(evaluator, values: dict) -> str:
    return evaluator.workload.gene_space(evaluator.preset, evaluator.device_info()).make(values).to_json()


@pytest.fixture(scope="module")
def budget_judge():
    """llama_serve `cpu_small` (float32) in budget mode, calibrated against an honest bfloat16 execution x 2."""
    evaluator = _evaluator("tests.accuracy_cheats", "cpu_small", {"mode": "budget"}, "budget-judge")
    yield evaluator
    evaluator.close()


@pytest.mark.parametrize("values", [{"weight_dtype": "bfloat16", "kv_dtype": "bfloat16"}, {"weight_quant": "int8"},
                                    {"cheat": "picker"}])
def test_honest_lossy_engines_pass_the_calibrated_budget_and_carry_their_loss(budget_judge, values):
    result = budget_judge.evaluate(_genome(budget_judge, values))
    assert result.status == "ok", result.message
    loss = result.accuracy
    assert loss["mode"] == "budget" and loss["budget"]["basis"].startswith("calibrated: 2 x an honest bfloat16")
    assert loss["steps"] >= 100 and 0.95 <= loss["agreement"] <= 1.0
    assert loss["agreement_ci"][0] <= loss["agreement"] <= loss["agreement_ci"][1]
    assert loss["max_gap"] <= max([loss["budget"]["max_gap"], *(gap for _, gap in loss["budget"]["short_max_gap"])])


@pytest.mark.parametrize("cheat, says", [
    ("steer", r"the accuracy budget: .*(beyond the budget's largest gap|top-1 agreement|near ties steered)"),
    ("class_wrong", r"the accuracy budget: .*(beyond the budget's largest gap|not spread over requests|agreement)"),
])
def test_engines_that_choose_their_outputs_fail_the_budget(budget_judge, cheat, says):
    result = budget_judge.evaluate(_genome(budget_judge, {"cheat": cheat}))
    assert result.status == "incorrect" and re.search(says, result.message), result.message
    assert result.accuracy["agreement"] < 1.0  # what it lost is on the record too


def test_the_exact_rule_rejects_a_lossy_engine_at_float32():
    evaluator = _evaluator("llama_serve", "cpu_small", {}, "exact-judge")
    try:
        genome = _genome(evaluator, {"weight_dtype": "bfloat16", "kv_dtype": "bfloat16"})
        # ~1.5% of its tokens are not float64's: one evaluation of ~200 tokens may see none; three in a row, ~1e-4
        statuses = []
        for _ in range(3):
            result = evaluator.evaluate(genome)
            statuses.append(result.status)
            if result.status == "incorrect":  # a greedy token past the tolerance, or a sampled one out of the nucleus
                assert re.search(r"beyond the near-tie tolerance|outside the top_p .* nucleus", result.message), \
                    result.message
                break
        assert "incorrect" in statuses, statuses
    finally:
        evaluator.close()


def test_the_honest_bfloat16_kimi_linear_engine_passes_its_bfloat16_preset():
    evaluator = _evaluator("kimi_linear", "cpu_small_bf16", {}, "kimi-bf16-judge")  # bfloat16: budget by default
    try:
        result = evaluator.evaluate(_genome(evaluator, {}))
        assert result.status == "ok", result.message
        assert result.accuracy["mode"] == "budget"
        budget = result.accuracy["budget"]
        assert result.accuracy["max_gap"] <= max([budget["max_gap"], *(gap for _, gap in budget["short_max_gap"])])
    finally:
        evaluator.close()


def test_a_checkpoint_with_a_tokenizer_is_measured_on_real_text():
    """The Zen of Python (read from the standard library), every prefix a one-token request: the engine's
    next-token accuracy beside the float64 reference's and its perplexity, worded in the claim."""
    import shutil
    import uuid
    from pathlib import Path

    from evo.evidence.claims import loss_words
    from evo.workloads.llama_serve.checkpoint import world_readable, write_checkpoint
    from evo.workloads.llama_serve.presets import PRESETS
    from evo.workloads.real_text import zen_of_python

    assert zen_of_python().splitlines()[2] == "Beautiful is better than ugly."
    root = Path(__file__).resolve().parents[1] / "runs" / f".real-text-{uuid.uuid4().hex[:8]}"
    folder = write_checkpoint(PRESETS["cpu_small"], root / "small")
    root.chmod(0o755)
    world_readable(folder)
    evaluator = _evaluator("llama_serve", f"hf:{folder},R=4,P=48,N=8", {}, "real-text-judge")
    try:
        result = evaluator.evaluate(_genome(evaluator, {}))
        assert result.status == "ok", result.message
        quality = result.accuracy["real_text"]
        assert quality["text"] == "the Zen of Python" and quality["positions"] == 48
        assert quality["agreement"] == 1.0 and quality["engine_top1"] == quality["reference_top1"]  # exact engine
        assert quality["reference_perplexity"] > 1
        assert "on the Zen of Python (48 positions): next-token accuracy" in loss_words(result.accuracy)
    finally:
        evaluator.close()
        shutil.rmtree(root, ignore_errors=True)
