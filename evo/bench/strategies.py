"""Search strategies compared at the same budget: the agents, random search, Optuna's TPE.

Each strategy spends up to `budget` evaluations (distinct genomes) of one gene space through one
evaluator and returns its trajectory: every evaluated genome in order with its result. All start by
evaluating the gene space's default genome, so they begin level. Pure: no Ray, no MLflow; the
evaluator is any object with `evaluate(genome_json) -> EvalResult` (the real one, the synthetic
one, or `evo.bench.compare.CachedEvaluator`). Given a `judge` (an evaluator that re-times paired,
`evo.bench.paired`), the agents intensify as in a run: their challengers are re-timed against the
incumbent or their parent before a win counts; the re-timings are kept on the trajectory.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from evo.core.genome import GeneSpace, Genome
from evo.core.lessons import Lessons, from_search
from evo.core.loop import run_search
from evo.core.optuna_study import GenomeStudy
from evo.core.records import EvalResult
from evo.core.retiming import PairedTiming
from evo.core.search import Search, SearchSettings
from evo.core.seeds import derive_seed


@dataclass(frozen=True)
class Step:
    """One evaluation of a trajectory."""

    genome_hash: str
    status: str
    latency_ms: float  # nan unless ok
    eval_s: float  # what this evaluation cost when it was measured (cached results keep their cost)
    source: str  # who proposed it: an agent, "seed", "random", "tpe"


@dataclass(frozen=True)
class Trajectory:
    strategy: str
    seed: int
    steps: tuple[Step, ...]
    propose_s: float  # the strategy's own time (proposing, learning), evaluations and re-timings excluded
    lessons: Lessons | None = None  # what an agents run learned (for a warm-started run after it)
    retimings: tuple[PairedTiming, ...] = ()  # the agents' intensification: challengers re-timed paired
    retime_s: float = 0.0  # their wall time
    incumbent: str = ""  # the agents' best confirmed by paired re-timing (intensifying), else ""

    def best_so_far(self, budget: int) -> np.ndarray:
        """Best latency after each of `budget` evaluations (inf before the first ok; the last value
        carried on if the strategy stopped early)."""
        best, out = math.inf, []
        for step in self.steps[:budget]:
            if step.status == "ok" and math.isfinite(step.latency_ms):
                best = min(best, step.latency_ms)
            out.append(best)
        out += [best] * (budget - len(out))
        return np.array(out)

    def best_hash(self, budget: int) -> str:
        """The genome with the best single timing within `budget` evaluations (the first of equals); ""
        when none passed."""
        ok = [s for s in self.steps[:budget] if s.status == "ok" and math.isfinite(s.latency_ms)]
        return min(ok, key=lambda s: s.latency_ms).genome_hash if ok else ""

    def evals_to_reach(self, target_ms: float) -> float:
        """Evaluations until the best is <= target_ms (1-based); inf if never."""
        for i, step in enumerate(self.steps, 1):
            if step.status == "ok" and step.latency_ms <= target_ms:
                return float(i)
        return math.inf

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "seed": self.seed, "propose_s": self.propose_s,
                "steps": [dataclasses.asdict(s) for s in self.steps], "incumbent": self.incumbent,
                "retime_s": self.retime_s, "retimings": [t.to_dict() for t in self.retimings]}


class _Recording:
    """Wraps an evaluator: times the calls so a strategy's own time can be told apart, keeps the order."""

    def __init__(self, evaluator) -> None:
        self.evaluator, self.steps, self.eval_wall = evaluator, [], 0.0

    def evaluate(self, genome: Genome, source: str) -> EvalResult:
        started = time.perf_counter()
        result = self.evaluator.evaluate(genome.to_json())
        self.eval_wall += time.perf_counter() - started
        self.steps.append(Step(genome.hash, result.status, result.latency_ms if result.ok else math.nan,
                               result.eval_s, source))
        return result


def run_agents(space: GeneSpace, evaluator, budget: int, seed: int, settings: SearchSettings,
               lessons: Lessons | None = None, name: str = "agents", judge=None) -> Trajectory:
    """The project's search (`evo.core.search.Search` with in-process agents) at this budget; with a
    `judge`, intensifying (`search.intensify`) through paired re-timings in it."""
    from evo.bench.paired import LocalRetimer
    from operators.team import LocalTeam

    settings = dataclasses.replace(settings, seed=seed, max_evaluations=budget, generations=10 ** 6,
                                   max_wall_s=math.inf)
    recording = _Recording(evaluator)

    class _Executor:
        def run(self, proposals):
            for proposal in proposals:
                yield proposal, recording.evaluate(proposal.genome, proposal.agent)

    retimer = LocalRetimer(judge) if judge is not None else None
    started = time.perf_counter()
    search = Search(space, settings, LocalTeam(list(settings.agents), space, seed), lessons=lessons, retimer=retimer)
    run_search(search, _Executor())
    wall = time.perf_counter() - started
    device = next((s for s in search.known.values() if s.result.device), None)
    learned = from_search(search, space.workload, "", device.result.device if device else "", f"{name}:seed{seed}")
    retime_s = retimer.wall_s if retimer else 0.0
    incumbent = search.incumbent.proposal.hash if search.intensifying and search.incumbent else ""
    return Trajectory(name, seed, tuple(recording.steps), wall - recording.eval_wall - retime_s, learned,
                      tuple(retimer.timings) if retimer else (), retime_s, incumbent)


def run_random(space: GeneSpace, evaluator, budget: int, seed: int) -> Trajectory:
    """Uniform random legal genomes (the default first), never one twice."""
    rng = np.random.default_rng(derive_seed(seed, "strategy:random"))
    recording, seen = _Recording(evaluator), set()
    started = time.perf_counter()
    genome = space.default()
    for _ in range(100 * budget):
        if len(recording.steps) >= budget:
            break
        if genome.hash not in seen:
            seen.add(genome.hash)
            recording.evaluate(genome, "random")
        genome = space.sample(rng)
    return Trajectory("random", seed, tuple(recording.steps), time.perf_counter() - started - recording.eval_wall)


def run_optuna(space: GeneSpace, evaluator, budget: int, seed: int, sampler: str = "tpe") -> Trajectory:
    """An Optuna sampler through ask/tell (the default genome enqueued first). Illegal combinations
    are told as infeasible and cost no evaluation; a genome asked again is told its known result."""
    study = GenomeStudy(space, derive_seed(seed, f"strategy:{sampler}"), sampler)
    study.study.enqueue_trial(dict(space.default().values()))
    recording, known = _Recording(evaluator), {}
    started = time.perf_counter()
    for _ in range(50 * budget):
        if len(recording.steps) >= budget:
            break
        trial, genome = study.ask()
        if genome is None:
            continue
        if genome.hash not in known:
            known[genome.hash] = recording.evaluate(genome, sampler)
        study.tell(trial, known[genome.hash])
    return Trajectory(sampler, seed, tuple(recording.steps), time.perf_counter() - started - recording.eval_wall)


def strategies(settings: SearchSettings, judge=None) -> dict[str, Callable[..., Trajectory]]:
    """Name -> run(space, evaluator, budget, seed). `agents` is the search as configured (learning on);
    `agents-basic` the same without learning; `agents+optuna` adds the Optuna agent to the team. With a
    `judge`, the agents strategies intensify (`run_agents`)."""
    def agents(learning: bool, extra: tuple[str, ...], name: str):
        configured = dataclasses.replace(settings, learning=learning,
                                         agents=tuple(dict.fromkeys((*settings.agents, *extra))))
        return lambda space, ev, budget, seed: run_agents(space, ev, budget, seed, configured, name=name, judge=judge)

    return {
        "agents": agents(True, (), "agents"),
        "agents-basic": agents(False, (), "agents-basic"),
        "agents+optuna": agents(True, ("optuna",), "agents+optuna"),
        "random": run_random,
        "tpe": lambda space, ev, budget, seed: run_optuna(space, ev, budget, seed, "tpe"),
    }
