"""A domain, not a list of points (issue 23, item 6): the declared input domain, the cases drawn over it
on every evaluation, the engines wrong only where no fixed check case reaches (rejected), and the
factored_chunk form at the domain's decay floor."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from evaluators.check import compare_outputs, expected_dtypes
from evaluators.evaluator import Evaluator
from evaluators.settings import EvaluatorSettings
from evo.core.records import INCORRECT, OK
from evo.workloads.base import CheckCase, DeviceInfo, Preset, Workload
from evo.workloads.domain import AxisRange, InputDomain
from evo.workloads.kda import WORKLOAD as KDA
from evo.workloads.kda import domain as kda_domain
from evo.workloads.kda.inputs import LOG_DECAY_FLOOR, MAX_BATCH
from tests import cheats
from tests import fake_workload as fw

PRESETS = KDA.presets()
SMALL = PRESETS["cpu_small"]
FAST = EvaluatorSettings(warmup=1, repeats=3)
PLANS = 300  # evaluations' worth of draws for the coverage tests


def _draws(preset: Preset, plans: int = PLANS, workload: Workload = KDA) -> list[list[CheckCase]]:
    return [workload.draw_cases(preset, np.random.default_rng(seed)) for seed in range(plans)]


# ---- the declared domain --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_kda_domain_spans_its_free_axes_and_declares_its_value_ranges(name):
    p = PRESETS[name]
    d = KDA.domain(p)
    assert (d.axes["B"].lo, d.axes["B"].hi) == (1, MAX_BATCH)
    assert d.axes["T"].lo == 1 and d.axes["T"].hi > 4 * p.shape["T"]  # beyond the longest fixed case
    assert (d.axes["H"].lo, d.axes["H"].hi) == (1, p.shape["H"] + 1)
    for axis, values in KDA.free_axes(p).items():
        assert all(v in d.axes[axis] for v in values), axis
    for stage in KDA.check_cases(p):
        for case in stage:
            assert d.outside(case.shape, p.shape) is None, case
    assert (d.values["g"].lo, d.values["g"].hi) == (LOG_DECAY_FLOOR, 0.0)
    assert (d.values["beta"].lo, d.values["beta"].hi) == (0.0, 1.0)


def test_t_is_drawn_near_multiples_of_the_largest_chunk_of_any_engine():
    sizes = set()
    for device in (DeviceInfo("cpu", "cpu", 4), DeviceInfo("cuda", "gpu")):
        for p in PRESETS.values():
            sizes |= set(KDA.gene_space(p, device).gene("chunk_size").values)
    assert KDA.domain(SMALL).axes["T"].modulus == max(sizes) == kda_domain.LARGEST_CHUNK
    assert all(kda_domain.LARGEST_CHUNK % c == 0 for c in sizes)  # a residue mod 128 is one mod every size


def test_the_default_domain_is_what_the_free_axes_span():
    p = fw.WORKLOAD.presets()["cpu"]
    d = fw.WORKLOAD.domain(p)
    assert {a: (r.lo, r.hi) for a, r in d.axes.items()} == {"B": (1, 2), "T": (8, 64), "D": (16, 17)}
    assert dict(d.values) == {}
    assert cheats.CheatWorkload(KDA, "x").domain(SMALL) == KDA.domain(SMALL)  # the cheats' workload delegates

    class Fixed(Workload):  # no free axes: the preset's shape only, nothing to draw
        def timing_case(self, preset):
            return CheckCase("t", dict(preset.shape), "normal")

    fixed = Preset("p", {"B": 2, "T": 8}, "float32", "cpu")
    assert Fixed().domain(fixed).outside({"B": 2, "T": 9}) is not None
    assert Fixed().draw_cases(fixed, np.random.default_rng(0)) == []


def test_the_default_draws_stay_in_the_default_domain_and_vary():
    p = fw.WORKLOAD.presets()["cpu"]
    d = fw.WORKLOAD.domain(p)
    draws = _draws(p, PLANS, fw.WORKLOAD)
    assert all(d.outside(c.shape, p.shape) is None for cases in draws for c in cases)
    assert {c.shape["T"] for cases in draws for c in cases} >= {8, 9, 63, 64}
    assert len({tuple(tuple(sorted(c.shape.items())) for c in cases) for cases in draws}) > 50


def test_an_axis_range_refuses_nonsense_and_draws_near_its_multiples():
    with pytest.raises(ValueError, match="lo <= hi"):
        AxisRange(5, 4)
    r = AxisRange(1, 600, modulus=128)
    rng = np.random.default_rng(0)
    past = {r.near_multiple(rng, (1, 7), most=300) for _ in range(300)}
    before = {r.near_multiple(rng, (1, 15), before=True) for _ in range(300)}
    assert all(t % 128 in range(1, 8) and t <= 300 for t in past)
    assert all(128 - t % 128 in range(1, 16) and t <= 600 for t in before)
    assert InputDomain({"T": r}).outside({"T": 601}) == "T=601 is outside the verified range [1, 600]"


# ---- the draws ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_drawn_case_lies_in_the_domain(name):
    p = PRESETS[name]
    d = KDA.domain(p)
    for cases in _draws(p):
        for case in cases:
            assert d.outside(case.shape, p.shape) is None, case
            assert case.distribution in kda_domain.PLAIN + kda_domain.EDGES


def test_over_many_evaluations_the_draws_reach_every_edge_of_the_domain():
    d, Tp = KDA.domain(SMALL), SMALL.shape["T"]
    cases = [c for plan in _draws(SMALL) for c in plan]
    B = {c.shape["B"] for c in cases}
    T = [c.shape["T"] for c in cases]
    assert B == set(range(1, MAX_BATCH + 1))
    assert {c.shape["H"] for c in cases} == set(range(1, SMALL.shape["H"] + 2))
    assert min(T) == 1 and max(T) > 7 * Tp and any(4 * Tp < t for t in T)
    assert {t % 128 for t in T if t > 128} >= set(range(1, 16)) | set(range(113, 128))  # ragged last chunks
    assert any(c.shape["B"] > 2 and c.shape["T"] > 77 for c in cases)
    assert {c.distribution for c in cases} == set(kda_domain.PLAIN + kda_domain.EDGES)
    assert {c.with_initial_state for c in cases} == {True, False}
    assert all(d.outside(c.shape, SMALL.shape) is None for c in cases)


def test_every_evaluation_draws_each_part_no_fixed_case_reaches():
    """Per evaluation, not only over many: B in 3..7 at T > 77, T % 64 in 1..12, beyond 4T, and each edge."""
    Tp = SMALL.shape["T"]
    for plan in _draws(SMALL):
        assert any(3 <= c.shape["B"] <= 7 and c.shape["T"] > 77 and 1 <= c.shape["T"] % 64 <= 12 for c in plan)
        assert any(c.shape["T"] > 4 * Tp for c in plan)
        assert set(kda_domain.EDGES) <= {c.distribution for c in plan}
        assert any(c.distribution == "decay_floor" and c.shape["T"] >= 128 for c in plan)


def test_the_draws_differ_between_evaluations_and_keep_the_reference_cheap():
    plans = _draws(SMALL, 50)
    shapes = {tuple(tuple(sorted(c.shape.items())) for c in plan) for plan in plans}
    assert len(shapes) == len(plans)
    # float64 reference cost ~ T steps per case: bounded next to the fixed cascade's (~2.7k steps on cpu_small)
    steps = [sum(c.shape["T"] for c in plan) for plan in _draws(SMALL)]
    assert np.mean(steps) < 3_000 and max(steps) <= 4 * SMALL.shape["T"] + 8 * SMALL.shape["T"] + 4 * 271


@pytest.mark.parametrize("distribution", kda_domain.EDGES)
def test_the_edge_distributions_reach_their_edges_and_stay_in_the_value_domain(distribution):
    d = KDA.domain(SMALL)
    case = CheckCase("edge", {**SMALL.shape, "B": 3, "T": 150}, distribution, True)
    x = KDA.make_inputs(case, "float32", "cpu", 5)
    g, beta, k = x["g"], x["beta"], x["k"]
    assert g.min() >= d.values["g"].lo and g.max() <= d.values["g"].hi
    assert beta.min() >= 0 and beta.max() <= 1
    if distribution == "beta_edges":
        assert (beta == 0).any() and (beta == 1).any() and (beta[:, 0] == 0).all()
    if distribution == "decay_floor":
        assert (g == LOG_DECAY_FLOOR).float().mean() > 0.3 and (g == 0).any()
    if distribution == "correlated_keys":
        assert cheats._consecutive_cosine(k) > 0.9
    else:
        assert cheats._consecutive_cosine(k) < 0.5
    again = KDA.make_inputs(case, "float32", "cpu", 5)
    assert all(torch.equal(x[n], again[n]) for n in ("q", "k", "v", "g", "beta"))  # a seed, the same draw


def test_the_default_distributions_never_pass_the_floor():
    for distribution in kda_domain.PLAIN:
        x = KDA.make_inputs(CheckCase("d", {**SMALL.shape, "B": 2}, distribution, False), "float32", "cpu", 3)
        assert x["g"].min() >= LOG_DECAY_FLOOR


# ---- in the evaluator -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kda_ev():
    return Evaluator("tests.cheats", "cpu_small", FAST, seed=23, name="domain-kda")


def test_each_plan_holds_the_fixed_cases_and_fresh_draws(kda_ev):
    fixed = sum(len(stage) for stage in kda_ev.workload.check_cases(kda_ev.preset))
    plans = [kda_ev._plan(np.random.default_rng(seed)) for seed in (1, 2)]
    drawn = [[c.case for c in plan if c.where.startswith("drawn case")] for plan in plans]
    for plan, cases in zip(plans, drawn):
        assert sum(c.where.startswith("check case") for c in plan) == fixed
        assert len(cases) == 6
    assert [c.shape for c in drawn[0]] != [c.shape for c in drawn[1]]
    assert not any(c.where.startswith("drawn case") for c in kda_ev._plan(np.random.default_rng(3), checks=False))


def test_a_workload_that_draws_outside_its_own_domain_is_a_programming_error(kda_ev, monkeypatch):
    outside = CheckCase("too_long", {**SMALL.shape, "T": 100 * SMALL.shape["T"]}, "standard")
    monkeypatch.setattr(kda_ev.workload, "draw_cases", lambda preset, rng: [outside])
    with pytest.raises(ValueError, match="outside its own domain: T=25600"):
        kda_ev._plan(np.random.default_rng(0))


@pytest.mark.parametrize("cheat", sorted(cheats.DOMAIN_CHEATS))
def test_engines_wrong_only_where_no_fixed_case_reaches_are_incorrect(kda_ev, cheat):
    r = kda_ev.evaluate(cheats.genome_json(kda_ev.workload, "cpu_small", cheat, kda_ev.device_info()))
    assert r.status == INCORRECT, f"{cheat}: {r.status} {r.message}\n{r.error}"
    assert "drawn case" in r.message and "error" in r.message, r.message
    assert not r.ok and math.isnan(r.latency_ms)


def test_the_honest_engine_passes_the_draws(kda_ev):
    r = kda_ev.evaluate(cheats.genome_json(kda_ev.workload, "cpu_small", cheats.NONE, kda_ev.device_info()))
    assert r.status == OK, f"{r.message}\n{r.error}"
    checked = int(r.message.split("passed ")[1].split()[0])
    fixed = sum(len(stage) for stage in kda_ev.workload.check_cases(kda_ev.preset))
    assert checked >= 1 + fixed + 6 + FAST.warmup + FAST.repeats  # the first call, fixed, drawn, timed
    assert r.max_rel_error < 1e-5


# ---- factored_chunk at the decay floor --------------------------------------------------------------------------
def _run(genes: dict, g_value: float | None, distribution: str = "standard") -> tuple[str, float, dict]:
    device = DeviceInfo("cpu", "cpu", 2)
    space = KDA.gene_space(SMALL, device)
    engine = KDA.build(space.make({**space.default().values(), **genes}), SMALL, device)
    x = KDA.make_inputs(CheckCase("floor", {**SMALL.shape, "B": 2, "T": 3 * 16 + 5}, distribution, True),
                        "float32", "cpu", 9)
    if g_value is not None:
        x["g"] = torch.full_like(x["g"], g_value)
    with torch.no_grad():
        out = engine(**x)
    problem, rel = compare_outputs(out, KDA.reference(x), expected_dtypes(KDA, SMALL), 1e-5, 100.0)
    return problem, rel, out


def test_factored_chunk_at_chunk_16_is_finite_and_right_at_the_domain_floor():
    """exp(-G) over a chunk overflows float32 once chunk_size x |g| passes ~88.7: at chunk_size 16 that is
    g < -5.54, below the domain's floor (-5), which Serve refuses; so this gene combination is right on
    the whole domain (g at the floor on every channel and step included)."""
    assert 16 * -LOG_DECAY_FLOOR < math.log(torch.finfo(torch.float32).max)
    genes = {"chunk_size": 16, "sub_chunk_size": 16, "exponent_form": "factored_chunk"}
    for g_value, distribution in ((LOG_DECAY_FLOOR, "standard"), (None, "decay_floor"), (None, "strong_decay")):
        problem, rel, out = _run(genes, g_value, distribution)
        assert problem == "" and rel < 1e-5, (g_value, distribution, problem)
        assert all(torch.isfinite(t).all() for t in out.values())
    _, _, below = _run(genes, -5.6)  # one step past the floor it overflows: why the floor is a bound
    assert not torch.isfinite(below["o"]).all()


@pytest.mark.parametrize("chunk_size", [32, 64, 128])
def test_factored_chunk_at_larger_chunks_fails_the_decay_floor_draw(chunk_size):
    """Where the domain reaches its overflow (chunk_size x 5 > 88) the drawn decay_floor case catches it."""
    problem, _, _ = _run({"chunk_size": chunk_size, "sub_chunk_size": 16, "exponent_form": "factored_chunk"},
                         None, "decay_floor")
    assert "non-finite" in problem
