"""A domain, not a list of points (issue 23, item 6; issue 28, item 3): the declared input domain, the
cases drawn over it on every evaluation, stratified so that every declared band is drawn in every
evaluation (every residue of T modulo the largest chunk, the norm bands of q and k, g and beta at and near
their bounds, llama's prompt and output lengths and vocabulary edges), the engines wrong only on one band
(rejected on every evaluation), and the factored_chunk form at the domain's decay floor."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from evaluators.judge.check import compare_outputs, expected_dtypes
from evaluators.judge.evaluator import Evaluator
from evaluators.settings import EvaluatorSettings
from evo.core.records import INCORRECT, OK
from evo.workloads.base import CheckCase, DeviceInfo, Preset, Workload
from evo.workloads.domain import AxisRange, InputDomain
from evo.workloads.kda import WORKLOAD as KDA
from evo.workloads.kda import domain as kda_domain
from evo.workloads.kda import inputs as kda_inputs
from evo.workloads.kda.inputs import LOG_DECAY_FLOOR, MAX_BATCH, NEAR_EDGE, QK_MAX
from evo.workloads.llama import WORKLOAD as LLAMA
from evo.workloads.llama import inputs as llama_inputs
from tests import cheats
from tests import fake_workload as fw

PRESETS = KDA.presets()
SMALL = PRESETS["cpu_small"]
FAST = EvaluatorSettings(warmup=1, repeats=3)
PLANS = 300  # evaluations' worth of draws for the coverage tests
SEEDS = (0, 1, 2)  # evaluations whose drawn inputs the band tests draw in full
# evaluator runs per domain cheat: every evaluation's draws reach every cheat's band by construction
# (test_every_evaluation_draws_where_each_domain_cheat_is_wrong); these show it through the judge
EVALUATIONS = {"no_norm_eps": 2, "ragged_128_60_62": 2, "correlated_keys": 2, "last_vocab_id": 2}


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
    assert (d.values["q"].lo, d.values["q"].hi) == (d.values["k"].lo, d.values["k"].hi) == (-QK_MAX, QK_MAX)
    specs = {spec.name: spec.bounds for spec in d.bound_specs(KDA.request_specs(p))}  # what Serve refuses past
    assert specs["q"] == specs["k"] == (-QK_MAX, QK_MAX) and specs["v"] == (None, None)


def test_t_is_swept_modulo_the_largest_chunk_of_any_engine():
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


def test_an_axis_range_refuses_nonsense_and_sweeps_every_residue():
    with pytest.raises(ValueError, match="lo <= hi"):
        AxisRange(5, 4)
    r = AxisRange(1, 600, modulus=128)
    rng = np.random.default_rng(0)
    sweep = r.residue_sweep(rng)
    assert sorted(sweep) == list(range(128)) and sweep != sorted(sweep)  # every residue once, shuffled
    assert AxisRange(1, 9).residue_sweep(rng) == [0]  # no modulus: one value, anywhere
    for residue in (0, 1, 60, 127):
        values = {r.with_residue(rng, residue, 1, 256) for _ in range(100)}
        assert all(v % 128 == residue and 1 <= v <= 256 for v in values) and len(values) == 2
    assert r.with_residue(rng, 0, 1, 300) in (128, 256)
    assert r.with_residue(rng, 88, 500) == 600  # the only one in [500, 600]
    with pytest.raises(ValueError, match="no value of \\[1, 100\\] is 101 modulo 128; widen"):
        r.with_residue(rng, 101, hi=100)
    assert InputDomain({"T": r}).outside({"T": 601}) == "T=601 is outside the verified range [1, 600]"


# ---- the draws ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_drawn_case_lies_in_the_domain(name):
    p = PRESETS[name]
    d = KDA.domain(p)
    for cases in _draws(p, 50):
        assert len(cases) == kda_domain.LARGEST_CHUNK
        for case in cases:
            assert d.outside(case.shape, p.shape) is None, case
            kda_inputs.parse_distribution(case.distribution)  # a known distribution and norm band


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_evaluation_draws_every_shape_band(name):
    """Per evaluation, by construction: every residue of T mod 128 (so every ragged last chunk of every
    chunk size), every distribution x norm band x initial state, and the shape bands no fixed case reaches."""
    p = PRESETS[name]
    Tp, combinations = p.shape["T"], set(kda_domain.COMBINATIONS)
    for plan in _draws(p):
        assert sorted(c.shape["T"] % 128 for c in plan) == list(range(128))
        drawn = [(*kda_inputs.parse_distribution(c.distribution), c.with_initial_state) for c in plan]
        assert combinations <= set(drawn)
        assert any(3 <= c.shape["B"] <= MAX_BATCH - 1 and c.shape["T"] > 128 for c in plan)
        assert any(c.distribution.startswith("decay_floor") and c.shape["T"] >= 128 for c in plan)
        assert any(kda_domain.SWEEP_T < c.shape["T"] <= 4 * Tp for c in plan)
        assert any(c.shape["T"] > 4 * Tp for c in plan)
        assert {c.name for c in plan} == {*kda_domain.SHAPED, "draw_sweep"}
        cheap = [c for c in plan if c.name == "draw_sweep"]
        assert all(c.shape["B"] == c.shape["H"] == 1 and c.shape["T"] <= kda_domain.SWEEP_T for c in cheap)


def test_over_many_evaluations_the_draws_reach_every_edge_of_the_shape_domain():
    d, Tp = KDA.domain(SMALL), SMALL.shape["T"]
    cases = [c for plan in _draws(SMALL) for c in plan]
    T = [c.shape["T"] for c in cases]
    assert {c.shape["B"] for c in cases} == set(range(1, MAX_BATCH + 1))
    assert {c.shape["H"] for c in cases} == set(range(1, SMALL.shape["H"] + 2))
    assert min(T) == 1 and max(T) > 7 * Tp and set(range(1, 257)) <= set(T)  # every T of the sweep's window
    assert all(d.outside(c.shape, SMALL.shape) is None for c in cases)


def _band_hits(x: dict) -> set[str]:
    """The value bands one draw reaches."""
    hits = set()
    for n in ("q", "k"):
        norms = x[n].double().norm(dim=-1)
        hits |= {f"{n}_zero"} if (norms == 0).any() else set()
        hits |= {f"{n}_near_zero"} if ((norms >= 1e-4) & (norms <= 1e-2)).any() else set()
        hits |= {f"{n}_ordinary"} if ((norms > 1) & (norms < 1e2)).any() else set()
        hits |= {f"{n}_large"} if (norms >= 1e2).any() else set()
        hits |= {f"{n}_at_bound"} if (x[n].abs() == QK_MAX).any() else set()
    g, beta = x["g"], x["beta"]
    for name, where in (("g_floor", g == LOG_DECAY_FLOOR), ("g_zero", g == 0),
                        ("g_near_floor", (g > LOG_DECAY_FLOOR) & (g <= LOG_DECAY_FLOOR + NEAR_EDGE)),
                        ("g_near_zero", (g < 0) & (g >= -NEAR_EDGE)),
                        ("beta_zero", beta == 0), ("beta_one", beta == 1),
                        ("beta_near_zero", (beta > 0) & (beta <= NEAR_EDGE)),
                        ("beta_near_one", (beta < 1) & (beta >= 1 - NEAR_EDGE))):
        hits |= {name} if where.any() else set()
    hits.add("correlated_keys" if cheats._consecutive_cosine(x["k"]) > 0.9 else "uncorrelated_keys")
    hits.add("initial_state" if x.get("initial_state") is not None else "no_initial_state")
    return hits


VALUE_BANDS = {f"{n}_{band}" for n in ("q", "k") for band in ("zero", "near_zero", "ordinary", "large", "at_bound")} | {
    "g_floor", "g_zero", "g_near_floor", "g_near_zero", "beta_zero", "beta_one", "beta_near_zero", "beta_near_one",
    "correlated_keys", "uncorrelated_keys", "initial_state", "no_initial_state"}


@pytest.fixture(scope="module")
def drawn_inputs() -> dict[int, list[tuple[CheckCase, dict]]]:
    """The inputs of every drawn case of a few evaluations (as the judge draws them, one seed per call)."""
    return {seed: [(c, KDA.make_inputs(c, SMALL.dtype, "cpu", 1000 * seed + i))
                   for i, c in enumerate(KDA.draw_cases(SMALL, np.random.default_rng(seed)))] for seed in SEEDS}


def test_every_evaluation_draws_every_value_band(drawn_inputs):
    """q and k at every norm band (exact zeros, 1e-4..1e-2, ordinary, large, the bound itself), g and beta
    exactly at and within NEAR_EDGE of each bound, keys correlated and not, with and without a state; all
    inside the domain's value bounds."""
    d = KDA.domain(SMALL)
    for seed, draws in drawn_inputs.items():
        hits = set()
        for case, x in draws:
            hits |= _band_hits(x)
            for name, bound in d.values.items():
                assert bound.lo <= float(x[name].min()) and float(x[name].max()) <= bound.hi, (case, name)
        assert hits == VALUE_BANDS, (seed, VALUE_BANDS - hits)


@pytest.mark.parametrize("cheat", sorted(cheats.DOMAIN_CHEATS))
def test_every_evaluation_draws_where_each_domain_cheat_is_wrong(drawn_inputs, cheat):
    """By construction, not by chance: each evaluation's draws hold a case where the cheat is wrong."""
    for seed, draws in drawn_inputs.items():
        assert any(cheats.WHERE_WRONG[cheat](x, SMALL) for _, x in draws), (cheat, seed)


def test_the_norm_bands_keep_a_seeds_values_and_reach_the_bound():
    case = CheckCase("n", {**SMALL.shape, "B": 2, "T": 40}, "heavy", True)
    plain = KDA.make_inputs(case, "float32", "cpu", 7)
    for band in kda_inputs.NORM_BANDS[1:]:
        x = KDA.make_inputs(CheckCase("n", case.shape, f"heavy+{band}", True), "float32", "cpu", 7)
        assert all(torch.equal(x[n], plain[n]) for n in ("v", "g", "beta", "initial_state"))  # only q, k move
        changed = (x["k"] != plain["k"]).any(-1)  # [B, T, H]
        assert changed[:, 0].all() and not changed.all()  # the first token always, not every token
    with pytest.raises(ValueError, match="unknown distribution 'heavy\\+tiny'"):
        KDA.make_inputs(CheckCase("n", case.shape, "heavy+tiny"), "float32", "cpu", 7)
    bf16 = KDA.make_inputs(CheckCase("n", case.shape, "standard+large", True), "bfloat16", "cpu", 7)
    assert float(bf16["q"].abs().max()) == float(bf16["k"].abs().max()) == QK_MAX  # exact in bfloat16 too


def test_the_draws_differ_between_evaluations_and_keep_the_calls_cheap():
    plans = _draws(SMALL, 50)
    shapes = {tuple(tuple(sorted(c.shape.items())) for c in plan) for plan in plans}
    assert len(shapes) == len(plans)
    # the judge's work per evaluation ~ B * H * T summed over the drawn cases: 124 cheap ones (B = H = 1,
    # T <= 256) and four shaped ones, bounded next to the fixed cascade's (~6.4k on cpu_small)
    work = [sum(c.shape["B"] * c.shape["H"] * c.shape["T"] for c in plan) for plan in _draws(SMALL)]
    assert np.mean(work) < 25_000 and max(work) <= 124 * 256 + 7 * 3 * 256 + 8 * 3 * 256 + 2 * 1024 + 2048


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
        assert len(cases) == kda_domain.LARGEST_CHUNK
    assert [c.shape for c in drawn[0]] != [c.shape for c in drawn[1]]
    assert not any(c.where.startswith("drawn case") for c in kda_ev._plan(np.random.default_rng(3), checks=False))


def test_a_workload_that_draws_outside_its_own_domain_is_a_programming_error(kda_ev, monkeypatch):
    outside = CheckCase("too_long", {**SMALL.shape, "T": 100 * SMALL.shape["T"]}, "standard")
    monkeypatch.setattr(kda_ev.workload, "draw_cases", lambda preset, rng: [outside])
    with pytest.raises(ValueError, match="outside its own domain: T=25600"):
        kda_ev._plan(np.random.default_rng(0))


@pytest.mark.parametrize("cheat", sorted(cheats.DOMAIN_CHEATS))
def test_engines_wrong_only_on_one_band_are_incorrect_on_every_evaluation(kda_ev, cheat):
    genome = cheats.genome_json(kda_ev.workload, "cpu_small", cheat, kda_ev.device_info())
    for _ in range(EVALUATIONS.get(cheat, 1)):  # each evaluation draws afresh
        r = kda_ev.evaluate(genome)
        assert r.status == INCORRECT, f"{cheat}: {r.status} {r.message}\n{r.error}"
        assert "drawn case" in r.message and "error" in r.message, r.message
        assert not r.ok and math.isnan(r.latency_ms)


def test_the_honest_engine_passes_the_draws(kda_ev):
    r = kda_ev.evaluate(cheats.genome_json(kda_ev.workload, "cpu_small", cheats.NONE, kda_ev.device_info()))
    assert r.status == OK, f"{r.message}\n{r.error}"
    checked = int(r.message.split("passed ")[1].split()[0])
    fixed = sum(len(stage) for stage in kda_ev.workload.check_cases(kda_ev.preset))
    assert checked >= 1 + fixed + kda_domain.LARGEST_CHUNK + FAST.warmup + FAST.repeats  # first, fixed, drawn, timed
    assert r.max_rel_error < 1e-5


# ---- llama: prompt and output lengths, vocabulary edges -----------------------------------------------------------
LLAMA_SMALL = LLAMA.presets()["cpu_small"]


@pytest.mark.parametrize("name", ["cpu_small", "cpu", "h200"])
def test_every_llama_evaluation_draws_every_length_band_and_both_vocabulary_edges(name):
    p = LLAMA.presets()[name]
    d, V = LLAMA.domain(p), p.shape["V"]
    P_max, N_max = d.axes["P"].hi, d.axes["N"].hi
    for seed in range(PLANS if name == "cpu_small" else 20):
        plan = LLAMA.draw_cases(p, np.random.default_rng(seed))
        assert all(d.outside(c.shape, p.shape) is None for c in plan)
        P = sorted(c.shape["P"] for c in plan)
        assert P[0] == 1 and 2 <= P[1] <= llama_inputs.SHORT_P and P[2] % 2 == 1 and P[3] == P_max
        assert {0, 1, N_max} <= {c.shape["N"] for c in plan}
        edges = [c for c in plan if c.distribution == "vocab_edges"]
        assert len(edges) == 1 and edges[0].shape["P"] >= 2 and edges[0].shape["N"] >= 2
        if name == "cpu_small" and seed < 20:  # the edge ids in every row of both parts
            x = LLAMA.make_inputs(edges[0], "float32", "cpu", seed)
            for part in ("prompt", "continuation"):
                assert ((x[part] == 0).any(1) & (x[part] == V - 1).any(1)).all(), part
                assert int(x[part].min()) >= 0 and int(x[part].max()) <= V - 1
            assert cheats.WHERE_WRONG["last_vocab_id"](x, p)


@pytest.fixture(scope="module")
def llama_ev():
    return Evaluator("tests.llama_cheats", "cpu_small", FAST, seed=28, name="domain-llama")


def test_a_llama_engine_wrong_only_at_the_last_vocabulary_id_is_incorrect_on_every_evaluation(llama_ev):
    honest = llama_ev.evaluate(cheats.genome_json(llama_ev.workload, "cpu_small", cheats.NONE, llama_ev.device_info()))
    assert honest.status == OK, f"{honest.message}\n{honest.error}"
    genome = cheats.genome_json(llama_ev.workload, "cpu_small", "last_vocab_id", llama_ev.device_info())
    for _ in range(EVALUATIONS["last_vocab_id"]):
        r = llama_ev.evaluate(genome)
        assert r.status == INCORRECT and "error" in r.message, f"{r.status} {r.message}\n{r.error}"


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
