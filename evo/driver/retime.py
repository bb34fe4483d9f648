"""Paired re-timing for a run: the search's challenges and the final comparison with the baselines,
timed by the evaluator pool (`evaluators.pool.actors.EvaluatorPool.retime`, `evaluators.judge.paired`).

`PoolRetimer` is the search's `evo.core.retiming.Retimer`: the core decides what to re-time, the pool
times it in its evaluators, each challenge in one evaluator, several at once across them.
"""
from __future__ import annotations

from evaluators.pool.actors import EvaluatorPool, RetimeJob
from evo.core.records import EvalResult, Evaluated
from evo.core.retiming import Challenge, IntensifySettings, PairedTiming
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
                   settings: IntensifySettings) -> list[PairedTiming]:
    """The best engine against every correct baseline, all interleaved in one evaluator (so every
    speedup of the summary comes with its 95% interval); [] when no baseline passed."""
    names = [name for name, result in baselines.items() if result.ok]
    if not names:
        return []
    job = RetimeJob((best.proposal.genome.to_json(), *(f"baseline:{n}" for n in names)),
                    pool.sources_of(best.proposal), settings.calls, settings.warmup, settings.min_effect, "baseline")
    return pool.retime([job])[0]


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
