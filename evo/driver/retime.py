"""Paired re-timing for a run: the search's challenges and the final comparison with the baselines,
timed by the evaluator pool (`evaluators.pool.EvaluatorPool.retime`, `evaluators.paired`).

`PoolRetimer` is the search's `evo.core.retiming.Retimer`: the core decides what to re-time, the pool
times it in its evaluators, each challenge in one evaluator, several at once across them.
"""
from __future__ import annotations

from evaluators.pool import EvaluatorPool, RetimeJob
from evo.core.records import EvalResult, Evaluated
from evo.core.retiming import Challenge, IntensifySettings, PairedTiming


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
