"""Search strategies compared at the same budget: the agents, random search, Optuna's TPE.

Each strategy spends up to `budget` evaluations (distinct genomes) of one gene space through one
evaluator and returns its trajectory: every evaluated genome in order with its result. All start by
evaluating the gene space's default genome, so they begin level. Given `wall_s`, a run is also held to
a wall budget by its `Meter`: it is charged what each evaluation cost when it was measured (a cached
result keeps its cost, so every strategy pays the same for the same genome), the wall time of the
paired re-timings it runs itself and its own time (proposing, learning); nothing starts once the
charge reaches `wall_s`, and what started before finishes and counts. Pure: no Ray, no MLflow; the
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
    cost_s: float = math.nan  # what the run was charged for it: eval_s, or its wall time here when that is unknown
    charged_s: float = math.nan  # the run's charge (`Meter`) when it finished


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
    charged_s: float = math.nan  # its charge (`Meter`) at the end of its last evaluation or re-timing

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

    def best_by_charge(self, seconds: np.ndarray) -> np.ndarray:
        """Best latency once the run's charge reached each of `seconds` (inf before the first ok)."""
        ends = np.array([s.charged_s for s in self.steps], dtype=float)
        ms = np.array([s.latency_ms if s.status == "ok" and math.isfinite(s.latency_ms) else math.inf
                       for s in self.steps], dtype=float)
        best = np.minimum.accumulate(ms) if len(ms) else ms
        done = np.searchsorted(ends, seconds, side="right")  # evaluations finished by then
        return np.array([best[n - 1] if n else math.inf for n in done])

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "seed": self.seed, "propose_s": self.propose_s, "charged_s": self.charged_s,
                "steps": [dataclasses.asdict(s) for s in self.steps], "incumbent": self.incumbent,
                "retime_s": self.retime_s, "retimings": [t.to_dict() for t in self.retimings]}


class Meter:
    """A run's charge in seconds: what its evaluations cost when they were measured, the wall time of the
    re-timings it ran itself, and its own time (everything else since it started). An evaluation or
    re-timing starts only while the charge is under `wall_s`; between `begin` and `end` the clock is
    the item's, so the charge after it is the charge when it began plus its cost."""

    def __init__(self, wall_s: float = math.inf) -> None:
        self.wall_s = wall_s
        self._started = time.perf_counter()
        self._inside = 0.0  # wall time spent in evaluations and re-timings
        self._costs = 0.0  # what they were charged
        self._item = math.nan  # when the item under way began
        self.charged_s = 0.0  # the charge at the end of the last item

    def now(self) -> float:
        return self._costs + self.own_s

    @property
    def own_s(self) -> float:
        """The run's own time so far (proposing, learning, bookkeeping)."""
        return time.perf_counter() - self._started - self._inside

    @property
    def spent(self) -> bool:
        return self.now() >= self.wall_s

    def begin(self) -> bool:
        """Whether an evaluation or re-timing may start now; when it may, its clock starts."""
        if self.spent:
            return False
        self._item = time.perf_counter()
        return True

    def end(self, cost_s: float = math.nan) -> float:
        """The item under way finished: charge `cost_s` (its wall time here when not finite); returns the cost."""
        wall = time.perf_counter() - self._item
        cost = cost_s if math.isfinite(cost_s) else wall
        self._inside += wall
        self._costs += cost
        self.charged_s = self.now()
        return cost


class _Recording:
    """Wraps an evaluator: charges each call to the run's meter, keeps the order."""

    def __init__(self, evaluator, meter: Meter) -> None:
        self.evaluator, self.meter, self.steps = evaluator, meter, []

    def evaluate(self, genome: Genome, source: str) -> EvalResult | None:
        """The genome's result; None, evaluating nothing, once the run's wall budget is spent."""
        if not self.meter.begin():
            return None
        result = self.evaluator.evaluate(genome.to_json())
        cost = self.meter.end(result.eval_s)
        self.steps.append(Step(genome.hash, result.status, result.latency_ms if result.ok else math.nan,
                               result.eval_s, source, cost, self.meter.charged_s))
        return result


def run_agents(space: GeneSpace, evaluator, budget: int, seed: int, settings: SearchSettings,
               lessons: Lessons | None = None, name: str = "agents", judge=None,
               wall_s: float = math.inf) -> Trajectory:
    """The project's search (`evo.core.search.Search` with in-process agents) at this budget; with a
    `judge`, intensifying (`search.intensify`) through paired re-timings in it, charged to the run."""
    from evo.bench.paired import LocalRetimer
    from operators.team import LocalTeam

    settings = dataclasses.replace(settings, seed=seed, max_evaluations=budget, generations=10 ** 6,
                                   max_wall_s=math.inf)
    meter = Meter(wall_s)
    recording = _Recording(evaluator, meter)

    class _Executor:  # stops mid-generation once the budget is spent: the generation stays open, run_search ends
        def run(self, proposals):
            for proposal in proposals:
                result = recording.evaluate(proposal.genome, proposal.agent)
                if result is None:
                    return
                yield proposal, result

    retimer = LocalRetimer(judge, meter) if judge is not None else None
    search = Search(space, settings, LocalTeam(list(settings.agents), space, seed), lessons=lessons, retimer=retimer)
    run_search(search, _Executor(), should_stop=lambda: meter.spent)
    device = next((s for s in search.known.values() if s.result.device), None)
    learned = from_search(search, space.workload, "", device.result.device if device else "", f"{name}:seed{seed}")
    incumbent = search.incumbent.proposal.hash if search.intensifying and search.incumbent else ""
    return Trajectory(name, seed, tuple(recording.steps), meter.own_s, learned,
                      tuple(retimer.timings) if retimer else (), retimer.wall_s if retimer else 0.0, incumbent,
                      meter.charged_s)


def run_random(space: GeneSpace, evaluator, budget: int, seed: int, wall_s: float = math.inf) -> Trajectory:
    """Uniform random legal genomes (the default first), never one twice."""
    rng = np.random.default_rng(derive_seed(seed, "strategy:random"))
    meter = Meter(wall_s)
    recording, seen = _Recording(evaluator, meter), set()
    genome = space.default()
    for _ in range(100 * budget):
        if len(recording.steps) >= budget:
            break
        if genome.hash not in seen:
            seen.add(genome.hash)
            if recording.evaluate(genome, "random") is None:
                break
        genome = space.sample(rng)
    return Trajectory("random", seed, tuple(recording.steps), meter.own_s, charged_s=meter.charged_s)


def run_optuna(space: GeneSpace, evaluator, budget: int, seed: int, sampler: str = "tpe",
               wall_s: float = math.inf) -> Trajectory:
    """An Optuna sampler through ask/tell (the default genome enqueued first). Illegal combinations
    are told as infeasible and cost no evaluation; a genome asked again is told its known result."""
    meter = Meter(wall_s)
    study = GenomeStudy(space, derive_seed(seed, f"strategy:{sampler}"), sampler)
    study.study.enqueue_trial(dict(space.default().values()))
    recording, known = _Recording(evaluator, meter), {}
    for _ in range(50 * budget):
        if len(recording.steps) >= budget:
            break
        trial, genome = study.ask()
        if genome is None:
            continue
        if genome.hash not in known:
            result = recording.evaluate(genome, sampler)
            if result is None:
                break
            known[genome.hash] = result
        study.tell(trial, known[genome.hash])
    return Trajectory(sampler, seed, tuple(recording.steps), meter.own_s, charged_s=meter.charged_s)


def strategies(settings: SearchSettings, judge=None) -> dict[str, Callable[..., Trajectory]]:
    """Name -> run(space, evaluator, budget, seed, wall_s=inf). `agents` is the search as configured
    (learning on); `agents-basic` the same without learning; `agents+optuna` adds the Optuna agent to the
    team. With a `judge`, the agents strategies intensify (`run_agents`)."""
    def agents(learning: bool, extra: tuple[str, ...], name: str):
        configured = dataclasses.replace(settings, learning=learning,
                                         agents=tuple(dict.fromkeys((*settings.agents, *extra))))
        return lambda space, ev, budget, seed, wall_s=math.inf: run_agents(
            space, ev, budget, seed, configured, name=name, judge=judge, wall_s=wall_s)

    return {
        "agents": agents(True, (), "agents"),
        "agents-basic": agents(False, (), "agents-basic"),
        "agents+optuna": agents(True, ("optuna",), "agents+optuna"),
        "random": run_random,
        "tpe": lambda space, ev, budget, seed, wall_s=math.inf: run_optuna(space, ev, budget, seed, "tpe", wall_s),
    }
