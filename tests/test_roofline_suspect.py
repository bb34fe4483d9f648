"""Implausible speedups: a result timed below the roofline floor is 'suspect', never ranked."""
from __future__ import annotations

import math

import pytest

from evaluators.judge.evaluator import Evaluator
from evaluators.settings import EvaluatorSettings
from evo.core.population import Population, PopulationSettings
from evo.core.records import OK, STATUSES, SUSPECT, EvalResult, Evaluated, Proposal
from evo.workloads.base import MachineRates, Roofline
from tests import fake_workload as fw

FAST = EvaluatorSettings(warmup=1, repeats=3)


def test_fast_and_correct_engine_is_ok_and_stamped_with_the_floor(fake):
    r = Evaluator(fake, "cpu", FAST, seed=1, name="ev").evaluate(fw.genome_json("cumsum"))
    assert r.status == OK, r.message
    assert 0 < r.roofline_floor_ms < r.latency_ms


def test_latency_below_the_floor_is_suspect(fake, monkeypatch):
    # a roofline claiming a petaflop of work: a floor of seconds, far above the engine's latency
    monkeypatch.setattr(fw.FakeWorkload, "roofline",
                        lambda self, preset, rates: Roofline(flops=1e15, bytes=0.0, rates=rates))
    ev = Evaluator(fake, "cpu", FAST, seed=1, name="ev")
    r = ev.evaluate(fw.genome_json("cumsum"))
    assert r.status == SUSPECT and SUSPECT in STATUSES
    assert not r.ok and math.isfinite(r.latency_ms) and r.latency_ms < r.roofline_floor_ms
    assert "below the roofline floor" in r.message and f"{r.roofline_floor_ms:.4g} ms" in r.message
    assert "re-verified on fresh inputs" in r.message  # a first median below the floor is timed again
    failed = ev.evaluate(fw.genome_json("zeros"))  # every result carries the floor, failures too
    assert failed.roofline_floor_ms == r.roofline_floor_ms


def test_margin_scales_the_floor(fake, monkeypatch):
    monkeypatch.setattr(fw.FakeWorkload, "roofline", lambda self, preset, rates: Roofline(
        flops=0.0, bytes=1.0, rates=MachineRates(flops_per_s=1.0, bytes_per_s=1e6)))  # floor 1e-3 ms
    assert Evaluator(fake, "cpu", FAST, seed=1).evaluate(fw.genome_json("cumsum")).status == OK
    huge = EvaluatorSettings(warmup=1, repeats=3, roofline_margin=1e6)  # floor x 1e6 = 1 s
    assert Evaluator(fake, "cpu", huge, seed=1).evaluate(fw.genome_json("cumsum")).status == SUSPECT


def test_a_workload_without_a_roofline_marks_nothing_suspect(fake, monkeypatch):
    def broken(self, preset, rates):
        raise NotImplementedError("no roofline")
    monkeypatch.setattr(fw.FakeWorkload, "roofline", broken)
    r = Evaluator(fake, "cpu", FAST, seed=1).evaluate(fw.genome_json("cumsum"))
    assert r.status == OK and math.isnan(r.roofline_floor_ms)


def test_suspects_never_enter_the_population():
    space = fw.WORKLOAD.gene_space(fw.WORKLOAD.presets()["cpu"], None)
    pop = Population(PopulationSettings(size=4, elite=1))
    fast = Evaluated(Proposal(space.make({"impl": "loop"}), (), "seed", "", 0),
                     EvalResult("a", SUSPECT, latency_ms=1e-6, roofline_floor_ms=1.0))
    slow = Evaluated(Proposal(space.default(), (), "seed", "", 0), EvalResult("b", OK, latency_ms=5.0))
    assert fast.fitness == math.inf and not pop.offer(fast)
    assert pop.offer(slow) and pop.best() is slow
    round_trip = EvalResult.from_dict(fast.result.to_dict())
    assert round_trip == fast.result
