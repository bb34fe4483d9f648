"""An Optuna study over a gene space, driven by ask/tell: Optuna's TPE sampler proposes genomes.

Every gene is a categorical parameter with the gene's legal values. A combination the gene space
forbids is never evaluated and never silently redrawn: the trial is told to the study as infeasible
(constraint `legal` > 0, state PRUNED) with the `GenomeError` message as a user attribute, so the
sampler learns to avoid it. A genome that was evaluated and failed (incorrect, build error, ...) is
infeasible too (constraint `ok` > 0). Results found by others (agents, a warm start) join the study
with `add`. Pure of Ray and MLflow.
"""
from __future__ import annotations

import math
import warnings
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import Trial, TrialState, create_trial

from evo.core.genome import GeneSpace, Genome, GenomeError
from evo.core.records import EvalResult

optuna.logging.set_verbosity(optuna.logging.WARNING)
# CMA-ES is left out: every gene is categorical, which CMA-ES does not model (Optuna would fall back
# to an independent sampler for all of them).
SAMPLERS = ("tpe", "random")


def make_sampler(kind: str, seed: int, n_startup_trials: int = 10) -> optuna.samplers.BaseSampler:
    """A seeded Optuna sampler."""
    if kind not in SAMPLERS:
        raise ValueError(f"unknown Optuna sampler {kind!r}; allowed: {list(SAMPLERS)}")
    seed %= 2 ** 32  # numpy's legacy RandomState, which Optuna seeds, takes 32 bits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if kind == "tpe":
            # multivariate TPE models genes jointly (the gene space has interactions); the library's own TPE
            return optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=n_startup_trials)
        return optuna.samplers.RandomSampler(seed=seed)


class GenomeStudy:
    """A minimising Optuna study whose parameters are the genes of `space`."""

    def __init__(self, space: GeneSpace, seed: int, sampler: str = "tpe", n_startup_trials: int = 10) -> None:
        self.space = space
        self.distributions = {g.name: CategoricalDistribution(list(g.values)) for g in space.genes}
        self.study = optuna.create_study(direction="minimize",
                                         sampler=make_sampler(sampler, seed, n_startup_trials))
        self.illegal = 0  # trials the gene space rejected (told as infeasible, never evaluated)

    def ask(self) -> tuple[Trial, Genome | None]:
        """A trial and its genome; None when the combination is illegal (already told as infeasible)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            trial = self.study.ask(self.distributions)
        try:
            return trial, self.space.make(dict(trial.params))
        except GenomeError as exc:
            trial.set_constraint("legal", 1.0)
            trial.set_user_attr("illegal", str(exc))
            self.study.tell(trial, state=TrialState.PRUNED)
            self.illegal += 1
            return trial, None

    def tell(self, trial: Trial, result: EvalResult) -> None:
        """The one result of a legal trial's genome: its latency, or infeasible when it failed."""
        trial.set_constraint("legal", 0.0)
        trial.set_constraint("ok", 0.0 if result.ok else 1.0)
        trial.set_user_attr("status", result.status)
        if result.ok:
            self.study.tell(trial, result.latency_ms)
        else:
            trial.set_user_attr("message", result.message[:500])
            self.study.tell(trial, state=TrialState.PRUNED)

    def drop(self, trial: Trial) -> None:
        """A legal trial that will not be evaluated (the budget ran out): FAIL, which samplers ignore."""
        self.study.tell(trial, state=TrialState.FAIL)

    def add(self, genome: Genome, result: EvalResult) -> None:
        """A result the study did not ask for (another agent's, an earlier run's)."""
        params: dict[str, Any] = {k: v for k, v in genome.values().items() if k in self.distributions}
        if set(params) != set(self.distributions):
            return  # a genome of another gene space: nothing to learn here
        ok = result.ok and math.isfinite(result.latency_ms)
        self.study.add_trial(create_trial(
            state=TrialState.COMPLETE if ok else TrialState.PRUNED, value=result.latency_ms if ok else None,
            params=params, distributions=self.distributions, constraints={"legal": 0.0, "ok": 0.0 if ok else 1.0},
            user_attrs={"status": result.status}))

    def add_illegal(self, params: dict[str, Any], message: str) -> None:
        """A combination the gene space rejected in an earlier batch: infeasible, never evaluated."""
        self.study.add_trial(create_trial(state=TrialState.PRUNED, params=params, distributions=self.distributions,
                                          constraints={"legal": 1.0}, user_attrs={"illegal": message}))

    def use_sampler(self, sampler: str, seed: int, n_startup_trials: int = 10) -> None:
        """Reseed: a sampler made from (seed, history) proposes the same after a restore as before."""
        self.study.sampler = make_sampler(sampler, seed, n_startup_trials)
