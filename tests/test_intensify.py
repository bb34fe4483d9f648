"""Intensification in the search core: a candidate is credited (incumbent, agent win, lessons) only when
a paired re-timing confirms it faster by the minimum effect. Deterministic: the synthetic evaluator and
fake retimers (no Ray, no timing)."""
from __future__ import annotations

import math

from evaluators.judge.synthetic import SyntheticEvaluator
from evo.core.lessons import from_search
from evo.core.loop import LocalExecutor, run_search
from evo.core.retiming import EQUAL, FASTER, Challenge, IntensifySettings, PairedTiming, decide, paired_timing
from evo.core.search import Search, SearchSettings
from operators.team import LocalTeam
from tests.toy_space import toy_space


class EqualRetimer:
    """Every challenger comes back equal within noise (its single timing was luck)."""

    def __init__(self) -> None:
        self.challenges: list[Challenge] = []

    def retime(self, challenges: list[Challenge], settings: IntensifySettings) -> list[PairedTiming]:
        self.challenges += challenges
        return [PairedTiming("x", "y", EQUAL, 1.0, 0.97, 1.03, settings.min_effect) for _ in challenges]


class TrueRetimer(EqualRetimer):
    """The synthetic latencies are the truth: the paired ratio is theirs, its interval +-1%."""

    def retime(self, challenges: list[Challenge], settings: IntensifySettings) -> list[PairedTiming]:
        self.challenges += challenges
        out = []
        for c in challenges:
            ratio = c.challenger.fitness / c.holder.fitness
            low, high = ratio * 0.99, ratio * 1.01
            out.append(PairedTiming("x", "y", decide(low, high, settings.min_effect), ratio, low, high,
                                    settings.min_effect))
        return out


def make_search(retimer=None, seed: int = 0, **intensify) -> Search:
    settings = SearchSettings(seed=seed, generations=50, offspring=6, max_evaluations=40,
                              agents=("fusion", "scheduling", "memory", "integration"),
                              intensify=IntensifySettings(**{"budget_share": 0.5, **intensify}))
    space = toy_space()
    return Search(space, settings, LocalTeam(list(settings.agents), space, settings.seed), retimer=retimer)


def test_a_candidate_equal_within_noise_is_never_credited_nor_written_as_a_lesson():
    retimer = EqualRetimer()
    search = make_search(retimer)
    reports = run_search(search, LocalExecutor(SyntheticEvaluator()))
    assert retimer.challenges, "nothing looked faster: the test proves nothing"
    first = next(r.best for r in reports if r.best is not None)
    # the first correct engine holds: no challenger was confirmed, whatever its single timing said
    assert all(r.best is first for r in reports if r.best is not None)
    assert search.best() is first and search.population.best().fitness < first.fitness
    assert all(wins == 0 for _, wins in search.yields.values())
    assert all(wins == 0 for state in search.team.state().values() for _, wins in state["stats"].values())
    lessons = from_search(search, "toy", "cpu", "cpu:test", "run")
    assert lessons.best[0] == (first.proposal.genome.to_dict(), first.fitness)  # the incumbent, not the lucky one
    assert all(v["beat_parent"] == 0 for v in lessons.to_dict()["agents"].values())
    assert all(t.verdict == EQUAL for r in reports for t in r.retimings)


def test_confirmed_wins_move_the_incumbent_and_count_for_their_agent():
    retimer = TrueRetimer()
    search = make_search(retimer)
    reports = run_search(search, LocalExecutor(SyntheticEvaluator()))
    incumbents = [r.best for r in reports if r.best is not None]
    assert len({i.proposal.hash for i in incumbents}) > 1, "the incumbent never moved"
    for before, after in zip(incumbents, incumbents[1:]):
        assert after.fitness <= before.fitness  # the best never gets worse
        if after is not before:  # moved only by a paired win against the incumbent it replaced
            timing = next(t for r in reports for t in r.retimings if t.a == after.proposal.hash)
            assert timing.verdict == FASTER and timing.reason == "incumbent" and timing.b == before.proposal.hash
    wins = sum(w for _, w in search.yields.values())
    confirmed = [t for t in search.retimings if t.verdict == FASTER]
    agents = {search.known[t.a].proposal.agent for t in confirmed}
    assert wins == sum(1 for t in confirmed if search.known[t.a].proposal.agent in search.yields) > 0
    assert agents <= set(search.yields) | {"seed"}


def test_re_timings_stay_within_their_budget_fastest_looking_first():
    retimer = EqualRetimer()
    search = make_search(retimer, budget_share=0.1)  # 4 of 40
    run_search(search, LocalExecutor(SyntheticEvaluator()))
    assert len(search.retimings) == len(retimer.challenges) <= 4
    for c in retimer.challenges:
        assert c.challenger.fitness < c.holder.fitness and c.reason in ("parent", "incumbent")
        assert c.challenger.proposal.generation == c.generation
    by_generation = {}
    for c in retimer.challenges:
        by_generation.setdefault(c.generation, []).append(c.challenger.fitness)
    assert all(f == sorted(f) for f in by_generation.values())


def test_without_a_retimer_a_single_timing_decides_as_before():
    search = make_search(None)
    reports = run_search(search, LocalExecutor(SyntheticEvaluator()))
    assert not search.intensifying and search.best() is search.population.best()
    assert all(r.retimings == () for r in reports) and sum(w for _, w in search.yields.values()) > 0


def test_a_restored_search_replays_its_re_timings_to_the_same_incumbent_and_yields():
    original = make_search(TrueRetimer())
    run_search(original, LocalExecutor(SyntheticEvaluator()))
    restored = make_search(TrueRetimer())
    items = sorted(original.known.values(), key=lambda e: (e.proposal.generation, e.proposal.index))
    restored.restore(items, original.generation, original.retimings)
    assert restored.best().proposal.hash == original.best().proposal.hash
    assert restored.yields == original.yields and len(restored.retimings) == len(original.retimings)


def test_paired_timing_of_noisy_samples_feeds_the_same_rule():
    """An end-to-end check of the rule on numbers: 10% faster with 3% noise is a win; 1% faster is not."""
    import numpy as np

    rng = np.random.default_rng(7)
    base = 10 * np.exp(rng.normal(0, 0.03, 16))
    win = paired_timing("a", "b", 0.9 * base * np.exp(rng.normal(0, 0.03, 16)), base, 0.02)
    tie = paired_timing("a", "b", 0.99 * base * np.exp(rng.normal(0, 0.03, 16)), base, 0.02)
    assert win.verdict == FASTER and tie.verdict == EQUAL and math.isfinite(tie.low)


# -- evidence: the summary's speedup_ci, the re-timings on disk ------------------------------------
def test_summary_speedup_ci_comes_from_the_final_paired_re_timing_and_round_trips():
    import json

    from evo.core.records import EvalResult
    from evo.evidence.summary import Summary, make_summary, with_final_retimings

    search = make_search(TrueRetimer())
    run_search(search, LocalExecutor(SyntheticEvaluator()))
    baselines = {"slow": EvalResult("baseline:slow", "ok", latency_ms=40.0), "broken": EvalResult("baseline:broken", "incorrect")}
    summary = make_summary(search, baselines, None, "toy", "cpu", 1.0)
    assert summary.intensification["retimings"] == len(search.retimings) > 0
    assert summary.intensification["faster"] == sum(t.verdict == FASTER for t in search.retimings)
    best = search.best().proposal.hash
    final = [PairedTiming(best, "baseline:slow", FASTER, 0.25, 0.2, 0.3, 0.02, reason="baseline"),
             PairedTiming(best, "d3fa017", FASTER, 0.5, 0.4, 0.625, 0.02, reason="default")]
    summary = with_final_retimings(summary, final)
    assert summary.speedup_ci == {"slow": [1 / 0.3, 1 / 0.2]} and summary.speedup_paired == {"slow": 4.0}
    # the run's default genome is no baseline: its paired figure is kept apart, as what the search earned
    assert summary.vs_default == {"hash": "d3fa017", "speedup": [2.0, 1.6, 2.5], "figures": {}}
    again = Summary.from_dict(json.loads(json.dumps(summary.to_dict())))
    assert again.speedup_ci == {"slow": [1 / 0.3, 1 / 0.2]} and again.intensification == summary.intensification
    assert again.vs_default == summary.vs_default
    assert Summary.from_dict({}).speedup_ci == {} and Summary.from_dict({}).vs_default == {}  # written before


def test_re_timings_are_journaled_with_their_parquet_and_trimmed_on_resume(tmp_path):
    import pyarrow.parquet as pq

    from evo.evidence.journal import RETIMINGS_FILE, DiskEvidence, read_retimings

    search = make_search(TrueRetimer())
    disk = DiskEvidence(tmp_path)
    reports = run_search(search, LocalExecutor(SyntheticEvaluator()), [disk])
    disk.close()
    written = read_retimings(tmp_path)
    assert [t.to_dict() for t in written] == [t.to_dict() for r in reports for t in r.retimings] and written
    for r in reports:
        if r.retimings:
            table = pq.read_table(tmp_path / "retimings" / f"gen_{r.generation:04d}.parquet")
            assert table.column("a").to_pylist() == [t.a for t in r.retimings]
    cut = max(t.generation for t in written)
    DiskEvidence(tmp_path, resumed_at=cut).close()  # a run resumed at generation `cut` times it again
    assert read_retimings(tmp_path) == [t for t in written if t.generation < cut]
    assert (tmp_path / RETIMINGS_FILE).exists()


# -- the final race: nothing that looked faster goes unexamined -------------------------------------
class NoisyEvaluator(SyntheticEvaluator):
    """Single timings noisy on purpose: the synthetic latency times a log-normal factor (sigma 0.4)."""

    def __init__(self, seed: int = 10) -> None:
        import numpy as np

        super().__init__()
        self.noise = np.random.default_rng(seed)

    def evaluate(self, genome_json: str):
        from dataclasses import replace

        result = super().evaluate(genome_json)
        return replace(result, latency_ms=result.latency_ms * float(self.noise.lognormal(0.0, 0.4))) if result.ok else result


class PairedTruthRetimer(EqualRetimer):
    """Paired samples of the true (synthetic) latencies with 3% noise each, decided by the real rule."""

    def __init__(self) -> None:
        import numpy as np

        super().__init__()
        self.truth, self.noise = SyntheticEvaluator(), np.random.default_rng(11)

    def true_ms(self, evaluated) -> float:
        return self.truth.evaluate(evaluated.proposal.genome.to_json()).latency_ms

    def retime(self, challenges: list[Challenge], settings: IntensifySettings) -> list[PairedTiming]:
        self.challenges += challenges
        out = []
        for c in challenges:
            a, b = (self.true_ms(e) * self.noise.lognormal(0.0, 0.03, settings.calls) for e in (c.challenger, c.holder))
            out.append(paired_timing("x", "y", a, b, settings.min_effect))
        return out


def noisy_search(**intensify) -> tuple[Search, PairedTruthRetimer]:
    retimer = PairedTruthRetimer()
    search = make_search(retimer, **{"budget_share": 0.1, **intensify})  # 4 re-timings, 2 kept for the race
    run_search(search, LocalExecutor(NoisyEvaluator()))
    return search, retimer


def test_candidates_that_look_faster_after_the_budget_is_spent_race_the_incumbent_before_the_run_ends():
    search, retimer = noisy_search()
    budget, reserve = search.settings.intensify.budget(40), search.settings.intensify.reserve(40)
    assert (budget, reserve) == (4, 2)
    in_search = list(search.retimings)
    assert len(in_search) <= budget - reserve  # the search left the race its reserve
    waiting = search.unexamined()
    assert waiting, "nothing looked faster unexamined: the test proves nothing"
    before = search.best()
    race = search.final_race()
    assert list(race.contenders) == [e.proposal.hash for e in waiting[:reserve]]  # fastest-looking first
    assert race.before == before.proposal.hash and race.winner == search.best().proposal.hash
    assert all(t.reason == "race" and t.a in race.contenders for t in race.timings)
    assert len(search.retimings) == len(in_search) + len(race.timings) <= budget
    decided = {d.a: d for d in race.decisions}  # each contender's rounds against its last holder, pooled
    assert set(decided) == set(race.contenders)
    leaders = {before.proposal.hash}  # the lead moves only by a paired win over the engine that held it
    for t in race.timings:
        assert t.b in leaders
        if decided[t.a].verdict == FASTER and decided[t.a].b == t.b:
            leaders.add(t.a)
    assert race.winner in leaders and decided[race.winner].verdict == FASTER
    assert race.winner != race.before, "the race confirmed nothing: the test proves less"
    assert retimer.true_ms(search.known[race.winner]) < retimer.true_ms(before)  # confirmed means truly faster
    named = {u.hash for u in race.unexamined}
    assert named == {e.proposal.hash for e in waiting[reserve:]}
    assert all("re-timing budget (4) was spent" in u.reason for u in race.unexamined)
    assert not (set(race.contenders) & {e.proposal.hash for e in search.unexamined()})


def test_a_candidate_the_race_had_no_time_for_is_named_in_the_summary():
    from evo.evidence.claims import claim_lines
    from evo.evidence.summary import Summary, make_summary

    search, _ = noisy_search(race_wall_s=0)
    waiting = [e.proposal.hash for e in search.unexamined()]
    assert waiting
    race = search.final_race()
    assert race.contenders == () and search.best().proposal.hash == race.before
    summary = Summary.from_dict(make_summary(search, {}, None, "toy", "cpu", 1.0, race=race).to_dict())
    assert [u["hash"] for u in summary.unexamined] == waiting
    reserve = search.settings.intensify.reserve(40)
    assert all("wall time ran out" in u["reason"] for u in summary.unexamined[:reserve])
    assert all("budget" in u["reason"] for u in summary.unexamined[reserve:])
    text = "\n".join(claim_lines(summary))
    assert all(f"unexamined: {h}" in text for h in waiting)
    stopped = noisy_search()[0].final_race(not_run="the run was stopped")
    assert stopped.contenders == () and all(u.reason == "the run was stopped" for u in stopped.unexamined)
