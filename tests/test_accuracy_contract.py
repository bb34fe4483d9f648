"""The accuracy contract (evaluators/judge/accuracy.py): the figures read off tokens, the budget's tests, the
config's rules; then the judge's full path (tests/accuracy_cheats.py): an engine that steers near ties or is wrong
on one prompt class fails a budget that an honest bfloat16-weights engine passes, and the exact rule rejects it."""
from __future__ import annotations

import math
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
    assert m.gap[1] == math.inf  # token 3 lies far outside the top_p 0.5 nucleus


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
    import re
    budget = Budget(0.7, 0.01, 0.3, 0.15) if "mean gap" in says else BUDGET  # a mean gap alone past 90% agreement
    why = budget.breach(_tally(*requests))
    assert re.search(says, why), why


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
