"""Paired re-timing for a run: the search's challenges and the final comparison with the baselines,
timed by the evaluator pool (`evaluators.pool.actors.EvaluatorPool.retime`, `evaluators.judge.paired`).

`PoolRetimer` is the search's `evo.core.retiming.Retimer`: the core decides what to re-time, the pool
times it in its evaluators, each challenge in one evaluator, several at once across them.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

from evaluators.pool.actors import EvaluatorPool, RetimeJob
from evo.core.fidelity import SCREEN
from evo.core.genome import Genome
from evo.core.records import EvalResult, Evaluated
from evo.core.retiming import DEFAULT_REASON, Challenge, IntensifySettings, PairedTiming
from evo.evidence.engine_record import EngineRecord


class PoolRetimer:
    """The search's challenges, re-timed by the pool; counts what it did for the run's report."""

    def __init__(self, pool: EvaluatorPool) -> None:
        self.pool = pool

    def retime(self, challenges: list[Challenge], settings: IntensifySettings) -> list[PairedTiming]:
        jobs = [RetimeJob((c.challenger.proposal.genome.to_json(), c.holder.proposal.genome.to_json()),
                          {**self.pool.sources_of(c.holder.proposal), **self.pool.sources_of(c.challenger.proposal)},
                          settings.calls, settings.warmup, settings.min_effect, c.reason, c.generation)
                 for c in challenges]
        return [answers[0] for answers in self.pool.retime(jobs)]


def final_retiming(pool: EvaluatorPool, best: Evaluated, baselines: dict[str, EvalResult],
                   settings: IntensifySettings, default: Genome | None = None) -> list[PairedTiming]:
    """The best engine against each correct baseline, paired (so every speedup of the summary comes with its 95%
    interval), and against `default`, the run's default genome when the search found another (reason "default":
    what the search, not the default, earned): one job each, spread over the evaluators, so a stop keeps the ones
    that finished (the others answer `evo.core.retiming.NOT_TIMED`)."""
    names = [name for name, result in baselines.items() if result.ok]
    others = [(f"baseline:{n}", "baseline") for n in names]
    if default is not None:
        others.append((default.to_json(), DEFAULT_REASON))
    jobs = [RetimeJob((best.proposal.genome.to_json(), other), pool.sources_of(best.proposal),
                      settings.calls, settings.warmup, settings.min_effect, reason) for other, reason in others]
    return [answers[0] for answers in pool.retime(jobs)]


def full_replay_s(result: EvalResult, full_count: int) -> float:
    """One replay of the run's whole trace by this engine, in seconds, from its evaluation (a screening one
    scaled by requests); nan where it has no replay figures (a call engine, a failure)."""
    serving = result.serving or {}
    duration, requests = serving.get("duration_s"), serving.get("requests")
    if not (result.ok and duration and requests):
        return math.nan
    return float(duration) * (full_count / requests if result.fidelity == SCREEN else 1.0)


def fixed_s(result: EvalResult, screen_replays: int, replays: int) -> float:
    """What an evaluation cost besides its timed replays (build, check replay, scoring), in seconds: `replays`
    of them at full fidelity, `screen_replays` at screen fidelity."""
    duration = (result.serving or {}).get("duration_s")
    timed = screen_replays if result.fidelity == SCREEN else replays
    return max(0.0, result.eval_s - timed * float(duration)) if duration else math.nan


def retime_estimate_s(results: Iterable[EvalResult], settings: IntensifySettings, full_count: int,
                      screen_replays: int, replays: int) -> float:
    """One paired re-timing of two candidates at full fidelity, before any was measured: each engine built and
    checked as in its evaluation, then (warmup + calls) whole replays of each (the median over `results`)."""
    each = [2 * fixed_s(r, screen_replays, replays)
            + 2 * (settings.warmup + settings.calls) * full_replay_s(r, full_count) for r in results]
    each = [x for x in each if math.isfinite(x)]
    return statistics.median(each) if each else math.nan


def final_estimate_s(best: EvalResult | None, baselines: dict[str, EvalResult], settings: IntensifySettings,
                     full_count: int, screen_replays: int, replays: int, parallel: int,
                     default: EvalResult | None = None) -> float:
    """The final paired re-timing (`final_retiming`): one job a baseline (and one against the `default` genome's
    engine, when it is not the best), `parallel` at a time."""
    if best is None:
        return 0.0
    mine = full_replay_s(best, full_count)
    mine_fixed = fixed_s(best, screen_replays, replays)
    calls = settings.warmup + settings.calls
    others = [r for r in baselines.values() if r.ok] + ([default] if default is not None and default.ok else [])
    jobs = [mine_fixed + fixed_s(r, screen_replays, replays) + calls * (mine + full_replay_s(r, full_count))
            for r in others]
    jobs = [x for x in jobs if math.isfinite(x)]
    return max(max(jobs, default=0.0), sum(jobs) / max(1, parallel))


def champion_race(pool: EvaluatorPool, settings: IntensifySettings):
    """The registry's race (`evo.evidence.mlflow.registry.Race`): a new engine against the registered champion,
    both built from their records, paired in one evaluator of the run's pool; None when re-timing is off."""

    def race(new: EngineRecord, champion: EngineRecord) -> PairedTiming | None:
        if not settings.enabled:
            return None
        job = RetimeJob((new.genome.to_json(), champion.genome.to_json()), {**champion.sources, **new.sources},
                        settings.calls, settings.warmup, settings.min_effect, "champion")
        return pool.retime([job])[0][0]

    return race
