"""Multi-fidelity screening and the run's reserved end (evo.core.fidelity, evo.core.reserve): a search with a wall
budget starts no generation that would leave its final race and re-timing no room, races what waits within
it, names what it could not race with the time it would have needed, and a stop keeps what was measured.
Deterministic: the synthetic evaluator, fake retimers and a fake clock (no Ray, no timing)."""
from __future__ import annotations

import math
import types
from dataclasses import replace
from pathlib import Path

import pytest

import evo.core.search as search_module
from evo.core.fidelity import SCREEN, ScreenSettings
from evo.core.loop import LocalExecutor, run_search
from evo.core.records import OK, EvalResult
from evo.core.reserve import EndReserve
from evo.core.retiming import NOT_TIMED, IntensifySettings, failed_timing, not_timed
from evo.core.search import Search, SearchSettings
from evo.driver.retime import final_estimate_s, full_replay_s, retime_estimate_s
from operators.team import LocalTeam
from tests.test_intensify import NoisyEvaluator, PairedTruthRetimer
from tests.toy_space import toy_space

ROOT = Path(__file__).resolve().parents[1]
EVAL_S, RETIME_S, FINAL_S = 5.0, 40.0, 30.0


class Clock:
    """The search's clock, moved by hand: each evaluation and each paired re-timing costs a fixed time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class TimedEvaluator(NoisyEvaluator):
    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    def evaluate(self, genome_json: str):
        self.clock.now += EVAL_S
        return super().evaluate(genome_json)


class TimedRetimer(PairedTruthRetimer):
    """Paired truth; `parallel` re-timings at once, each RETIME_S; from `stop_after` challenges on, a stop."""

    def __init__(self, clock: Clock, parallel: int, stop_after: int | None = None) -> None:
        super().__init__()
        self.clock, self.parallel, self.stop_after = clock, parallel, stop_after

    def retime(self, challenges, settings):
        done = len(self.challenges)
        answers = super().retime(challenges, settings)
        self.clock.now += math.ceil(len(challenges) / self.parallel) * RETIME_S
        return [failed_timing("x", "y", NOT_TIMED, settings.min_effect)
                if self.stop_after is not None and done + i >= self.stop_after else replace(t, wall_s=RETIME_S)
                for i, t in enumerate(answers)]


def timed_search(monkeypatch, max_wall_s: float, parallel: int = 2, stop_after: int | None = None,
                 reserved: bool = True):
    clock = Clock()
    monkeypatch.setattr(search_module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    settings = SearchSettings(seed=0, generations=50, offspring=6, max_evaluations=200, max_wall_s=max_wall_s,
                              agents=("fusion", "scheduling", "memory", "integration"),
                              intensify=IntensifySettings(budget_share=0.06, final_race=30, race_rounds=2,
                                                          race_wall_s=1e9))
    space = toy_space()
    retimer = TimedRetimer(clock, parallel, stop_after)
    search = Search(space, settings, LocalTeam(list(settings.agents), space, settings.seed), retimer=retimer,
                    reserve=EndReserve(parallel, lambda: RETIME_S, lambda: FINAL_S) if reserved else None)
    run_search(search, LocalExecutor(TimedEvaluator(clock)))
    return search, clock


def test_a_search_with_a_wall_budget_keeps_its_end_in_it_and_names_what_it_could_not_race(monkeypatch):
    search, clock = timed_search(monkeypatch, max_wall_s=600)
    assert "would overrun search.max_wall_s = 600 s" in search.stopped_for_end
    assert len(search.generation_walls) >= 2  # it ran generations, then stopped for its end
    waiting = search.unexamined()
    assert waiting, "nothing waits for the race: the test proves nothing"
    race = search.final_race()
    # the race raced what fit in the budget left once the final re-timing's share is set aside
    assert clock.now - 1000.0 + FINAL_S <= 600 + RETIME_S, "the race overran the wall budget"
    raced, named = set(race.contenders), {u.hash for u in race.unexamined}
    assert raced | named >= {e.proposal.hash for e in waiting}  # every candidate that looked faster: raced or named
    assert all("search.max_wall_s (600 s) ran out" in u.reason and "would have needed about" in u.reason
               for u in race.unexamined if "places" not in u.reason)


def test_without_a_reserve_the_search_spends_the_budget_and_its_race_runs_over(monkeypatch):
    search, clock = timed_search(monkeypatch, max_wall_s=600, reserved=False)
    assert not search.stopped_for_end and clock.now - 1000.0 > 600 - 6 * EVAL_S  # it searched to the end
    race = search.final_race()
    assert race.contenders and clock.now - 1000.0 + FINAL_S > 600 + RETIME_S  # its end overran the budget


def test_a_stop_during_the_final_race_keeps_the_rounds_it_finished_and_names_the_rest(monkeypatch):
    search, _ = timed_search(monkeypatch, max_wall_s=1e6, parallel=2)
    retimer = search.retimer
    waiting = search.unexamined()
    if len(waiting) < 2:
        pytest.skip("fewer than two candidates wait for the race: nothing to split")
    retimer.stop_after = len(retimer.challenges) + 1  # the race's first contender is timed, the rest are not
    race = search.final_race()
    assert len(race.contenders) == 1 and race.contenders[0] == waiting[0].proposal.hash
    stopped = [u for u in race.unexamined if u.reason == "the run was stopped during its final race"]
    assert stopped and not {u.hash for u in stopped} & set(race.contenders)
    assert set(race.contenders) | {u.hash for u in race.unexamined} >= {e.proposal.hash for e in waiting}
    assert not any(not_timed(t) for t in search.retimings)  # nothing undone counts as examined


def test_a_stop_during_the_final_retiming_keeps_the_figures_it_has_and_says_which_are_missing():
    from evo.core.retiming import paired_timing
    from evo.evidence.claims import claim_lines
    from evo.evidence.summary import Summary, with_final_retimings

    summary = Summary(workload="toy", preset="cpu", best_hash="abc", best_genome={"x": 1}, best_latency_ms=1.0,
                      baselines={"a": {"status": "ok"}, "b": {"status": "ok"}}, best_fidelity=SCREEN)
    done = paired_timing("abc", "baseline:a", [1.0] * 4 + [1.1] * 4, [2.0] * 4 + [2.1] * 4, 0.02)
    summary = with_final_retimings(summary, [done, failed_timing("abc", "baseline:b", NOT_TIMED, 0.02)])
    assert set(summary.speedup_ci) == {"a"} and summary.final_missing == {
        "b": "the run was stopped before its paired re-timing finished"}
    text = "\n".join(claim_lines(Summary.from_dict(summary.to_dict())))
    assert "missing: no paired figure against b" in text and "at screen fidelity" in text


def test_screen_settings_and_the_end_estimates_from_replay_times():
    with pytest.raises(ValueError, match="count must be an integer >= 0"):
        ScreenSettings(count=-1)
    assert ScreenSettings().to_evaluator() is None and ScreenSettings(16, 2).to_evaluator() == {"count": 16,
                                                                                                  "replays": 2}
    screened = EvalResult("a", OK, latency_ms=1.0, eval_s=10.0, fidelity=SCREEN,
                          serving={"duration_s": 2.0, "requests": 16})
    full = EvalResult("b", OK, latency_ms=1.0, eval_s=20.0, serving={"duration_s": 5.0, "requests": 64})
    assert full_replay_s(screened, 64) == pytest.approx(8.0) and full_replay_s(full, 64) == pytest.approx(5.0)
    intensify = IntensifySettings(calls=8, warmup=1)
    # two builds and checks (eval_s less its timed replays) + 2 x 9 whole replays
    assert retime_estimate_s([screened], intensify, 64, 1, 2) == pytest.approx(2 * 8.0 + 18 * 8.0)
    baselines = {"slow": replace(full, genome_hash="baseline:slow"), "failed": EvalResult("baseline:f", "timeout")}
    assert final_estimate_s(screened, baselines, intensify, 64, 1, 2, 2) == pytest.approx(8.0 + 10.0 + 9 * (8 + 5))
    assert math.isnan(EndReserve(2).race_s(3, [])) and EndReserve(2, lambda: 10.0).race_s(3, []) == 20.0
    assert EndReserve(2, lambda: 10.0).fitting(5, 25.0, []) == 4 and EndReserve(2).fitting(5, 1.0, []) == 5


def test_a_config_that_screens_nothing_or_screens_a_call_workload_is_refused():
    from evo.driver.config import ConfigError, load_config
    from evo.driver.rundir import check_config

    with pytest.raises(ConfigError, match="search.screen.count: 12 requests screen nothing: the run's trace has 12"):
        check_config(load_config(ROOT / "configs" / "llama_serve_smoke.yaml", ["search.screen.count=12"]))
    with pytest.raises(ConfigError, match="screening on shorter replays applies to generation workloads only"):
        check_config(load_config(ROOT / "configs" / "kda_smoke.yaml", ["search.screen.count=4"]))
    with pytest.raises(ConfigError, match="promote must be a share in"):
        load_config(ROOT / "configs" / "llama_serve_smoke.yaml", ["search.screen.promote=0"])
    for name in ("llama_serve_cpu", "kimi_linear_cpu"):  # the README's configs screen, and pass their checks
        config = load_config(ROOT / "configs" / f"{name}.yaml")
        check_config(config)
        assert config.search.screen.enabled and config.search.intensify.final_race >= 8
