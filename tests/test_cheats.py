"""Every cheat in tests/cheats.py is rejected by the evaluator, on KDA 'cpu_small' and on the fake
workload, with a message naming why; probes that try to tell checks from timed calls gain nothing; the
honest engines still pass, and no engine can damage the judge for the engines after it."""
from __future__ import annotations

import math

import pytest

import evaluators.judge.evaluator as evaluator_module
from evaluators.judge.evaluator import Evaluator
from evaluators.settings import EvaluatorSettings
from evo.core.records import INCORRECT, OK, RUNTIME_ERROR
from tests import cheats
from tests import fake_workload as fw

FAST = EvaluatorSettings(warmup=1, repeats=3)

# cheat -> words the rejection message must contain (any of them)
WHY = {
    "zeros": ("all zeros",),
    "constant": ("relative error",),
    "inplace": ("modified its inputs",),
    "memoise": ("shape", "cached or stale result"),  # the first result's shape, or its values at that shape
    "memoise_by_shape": ("cached or stale result",),
    "bf16": ("tolerance 1.0e-05",),
    "fixed_seed": ("relative error",),
    "preset_shape_only": ("error", "all zeros"),  # at T=1 the zeroed last step is the whole output
    "half_written": ("non-finite", "error"),
    "deferred": ("non-finite", "error", "changed after the engine returned"),
    "calls_reference": ("engine called",),
    "calls_reference_swallowed": ("engine called",),
    "calls_baseline": ("engine called", "Permission denied"),  # KDA: its file is not in the view, never loaded
    # the stale answer may come from a call of another shape (the order of calls is shuffled)
    "correct_then_zeros": ("all zeros", "shape"),
    "correct_then_previous": ("cached or stale result", "shape"),
    "cache_by_pointer": ("cached or stale result",),
    "cache_by_slice": ("cached or stale result", "shape"),
    "lazy_output": ("expected a plain torch.Tensor",),
    "patch_comparison": ("all zeros",),
    "patch_timer": ("all zeros",),
    "alias_reference": ("engine called",),
    "lazy_reference": ("expected a plain torch.Tensor", "engine called"),
    "batch1_only": ("error",),
    "heads_upto_preset": ("error",),
}
assert set(WHY) == set(cheats.CHEATS) - {"half_written_stale"}  # caught with poison_memory on, below


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


@pytest.fixture(scope="module")
def kda_honest(kda_ev):
    r = _evaluate(kda_ev, cheats.NONE)
    assert r.status == OK, f"{r.message}\n{r.error}"
    return r


@pytest.mark.parametrize("cheat", sorted(WHY))
def test_kda_cheat_is_rejected(kda_ev, cheat):
    r = _evaluate(kda_ev, cheat)
    # a baseline the engine's process never loaded cannot even be imported there: the call fails
    expected = RUNTIME_ERROR if cheat == "calls_baseline" else INCORRECT
    assert r.status == expected, f"{cheat}: {r.status} {r.message}\n{r.error}"
    assert any(w in r.message for w in WHY[cheat]), r.message
    assert not r.ok and math.isnan(r.latency_ms)


@pytest.mark.parametrize("cheat", sorted(WHY))
def test_fake_cheat_is_rejected(fake_ev, cheat):
    r = _evaluate(fake_ev, cheat)
    assert r.status == INCORRECT, f"{cheat}: {r.status} {r.message}\n{r.error}"
    assert not r.ok


@pytest.mark.parametrize("probe", sorted(cheats.PROBES))
def test_kda_probes_gain_nothing(kda_ev, probe):
    """A probe that thinks a call is timed returns zeros, caught because every call is checked. 'ok'
    therefore means every call was answered honestly; the clock is the judge's (a probe that slows the
    engine process's clock 100x changes nothing the judge reads)."""
    r = _evaluate(kda_ev, probe)
    if r.status == OK:
        assert r.max_rel_error <= 1e-5, (probe, r.message)
        assert r.latency_ms > r.roofline_floor_ms, (probe, r.latency_ms)
    else:
        assert r.status == INCORRECT and "all zeros" in r.message, r.message


def test_with_poisoning_on_a_stale_block_and_the_flag_probe_are_caught_too():
    """poison_memory on (for the engine process's whole life): an output left unwritten reads NaN even
    where the allocator hands back the block that held the answer; and the flag probe sees constant
    flags, so it computes honestly on every call."""
    ev = Evaluator("tests.cheats", "cpu_small", EvaluatorSettings(warmup=1, repeats=3, poison_memory=True),
                   seed=5, name="cheat-kda")
    stale = _evaluate(ev, "half_written_stale")
    assert stale.status == INCORRECT and "non-finite" in stale.message, stale.message
    probe = _evaluate(ev, "probe_flags")
    assert probe.status == OK and probe.max_rel_error <= 1e-5, probe.message


def test_a_patching_engine_does_not_outlive_itself(fake_ev):
    """After engines that patch the judge's comparison, reference, timer and floor, a wrong engine is
    still wrong and an honest one still right, with a sane latency."""
    for cheat in ("patch_comparison", "patch_timer"):
        assert _evaluate(fake_ev, cheat).status == INCORRECT
    assert _evaluate(fake_ev, "zeros").status == INCORRECT
    honest = _evaluate(fake_ev, cheats.NONE)
    assert honest.status == OK and honest.max_rel_error < 1e-5, honest.message
    assert honest.latency_ms > 0.001


def test_honest_engines_pass_through_the_same_path(kda_honest, fake_ev):
    for r in (kda_honest, _evaluate(fake_ev, cheats.NONE)):
        assert r.status == OK, f"{r.message}\n{r.error}"
        assert math.isfinite(r.roofline_floor_ms) and r.roofline_floor_ms > 0


def test_baselines_may_call_what_engines_may_not(kda_ev):
    r = kda_ev.evaluate_baseline("chunk_pairwise_c64")
    assert r.status == OK, r.message
