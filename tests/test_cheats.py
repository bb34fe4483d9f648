"""Every cheat in tests/cheats.py is rejected by the evaluator, on KDA 'cpu_small' and on the fake
workload, with a message naming why; the honest engines still pass."""
from __future__ import annotations

import math

import pytest

import evaluators.evaluator as evaluator_module
from evaluators.check import forbid_calls, forbidden_targets
from evaluators.evaluator import Evaluator
from evaluators.settings import EvaluatorSettings
from evo.records import INCORRECT, OK
from evo.workloads.kda import WORKLOAD as KDA
from evo.workloads.kda import baselines as kda_baselines
from evo.workloads.kda import reference as kda_reference
from tests import cheats
from tests import fake_workload as fw

FAST = EvaluatorSettings(warmup=1, repeats=2, input_sets=2)

# cheat -> words the rejection message must contain
WHY = {
    "zeros": "all zeros",
    "constant": "relative error",
    "inplace": "modified its inputs",
    "memoise": "shape",  # the first result has the preset's shape; the first check case does not
    "memoise_by_shape": "cached or stale result",
    "bf16": "tolerance 1.0e-05",
    "fixed_seed": "relative error",
    "preset_shape_only": "error",
    "half_written": "non-finite",
    "half_written_stale": "non-finite",
    # the re-read after settle_s sees the change; a thread slower than that leaves NaN at the first read
    "deferred": ("changed after the engine returned", "non-finite"),
    "calls_reference": "engine called",
    "calls_reference_swallowed": "engine called",
    "calls_baseline": "engine called",
}
assert set(WHY) == set(cheats.CHEATS)


@pytest.fixture(scope="module")
def kda_ev():
    return Evaluator("tests.cheats", "cpu_small", FAST, seed=11, name="cheat-kda")


@pytest.fixture
def fake_ev(monkeypatch):
    workload = cheats.CheatWorkload(fw.WORKLOAD, "fake_cheats")
    monkeypatch.setattr(evaluator_module, "get_workload", lambda name: workload)
    return Evaluator("fake_cheats", "cpu", FAST, seed=11, name="cheat-fake")


def _evaluate(ev: Evaluator, cheat: str):
    return ev.evaluate(cheats.genome_json(ev.workload, ev.preset.name, cheat, ev.device_info()))


@pytest.mark.parametrize("cheat", sorted(cheats.CHEATS))
def test_kda_cheat_is_rejected(kda_ev, cheat):
    r = _evaluate(kda_ev, cheat)
    assert r.status == INCORRECT, f"{cheat}: {r.status} {r.message}\n{r.error}"
    words = WHY[cheat] if isinstance(WHY[cheat], tuple) else (WHY[cheat],)
    assert any(w in r.message for w in words), r.message
    assert not r.ok and math.isnan(r.latency_ms)


@pytest.mark.parametrize("cheat", sorted(cheats.CHEATS))
def test_fake_cheat_is_rejected(fake_ev, cheat):
    r = _evaluate(fake_ev, cheat)
    assert r.status == INCORRECT, f"{cheat}: {r.status} {r.message}\n{r.error}"
    assert not r.ok


def test_honest_engines_pass_through_the_same_path(kda_ev, fake_ev):
    for ev in (kda_ev, fake_ev):
        r = _evaluate(ev, cheats.NONE)
        assert r.status == OK, f"{r.message}\n{r.error}"
        assert math.isfinite(r.roofline_floor_ms) and r.roofline_floor_ms > 0


def test_output_written_after_return_is_caught_by_the_re_read(fake_ev):
    slow = EvaluatorSettings(warmup=1, repeats=2, input_sets=2, settle_s=0.2)
    ev = Evaluator("fake_cheats", "cpu", slow, seed=3, name="cheat-fake")
    r = _evaluate(ev, "deferred")
    assert r.status == INCORRECT and "changed after the engine returned" in r.message, r.message


def test_baselines_may_call_what_engines_may_not(kda_ev):
    r = kda_ev.evaluate_baseline("chunk_pairwise_c64")
    assert r.status == OK, r.message


def test_guards_are_restored_even_when_the_engine_raises():
    originals = {(o, a): getattr(o, a) for o, a in forbidden_targets(KDA)}
    with pytest.raises(ZeroDivisionError):
        with forbid_calls(forbidden_targets(KDA)) as calls:
            with pytest.raises(RuntimeError, match="engine called"):
                kda_reference.reference({})
            1 / 0
    assert calls == ["evo.workloads.kda.reference.reference"]
    assert all(getattr(o, a) == f for (o, a), f in originals.items())  # bound methods: equal, not identical
    assert "reference" not in vars(KDA)  # the method is unshadowed, not copied onto the instance
    assert kda_baselines.chunk_pairwise.__name__ == "chunk_pairwise"
