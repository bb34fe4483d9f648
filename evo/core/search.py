"""The ask/tell core of the evolutionary search. Pure: no Ray, no MLflow, no torch.

`ask()` returns the next generation's proposals (agents' children of selected parents, or seeds),
deduplicated against every genome already evaluated and trimmed to the evaluation budget.
`tell()` records exactly one result per proposal; `end_generation()` feeds the agents what paid and
returns the generation's report. Who evaluates (in-process, Ray pool) is the caller's business.

Agents are `evo.core.proposer.Proposer`s behind a `Team`, asked by name with a `ProposalRequest`
and told a `Feedback`; the search special-cases none of them (an agent that needs more parents than
the population holds sits the generation out). With `learning` (the default) the search keeps what
the evidence says: per-gene effects of every result (`evo.core.effects`, failures included), passed
to the agents to steer their moves, and each agent's yield (children that improve on their parent,
`evo.core.proposer.improves_on_parent`, the same rule as the agents' own statistics), by which the
offspring are split among the agents. Lessons of earlier runs (`evo.core.lessons`) can seed all
three: best genomes, agent statistics, effects.

Intensification (`search.intensify`, on where a `Retimer` is given: a run's evaluator pool, or
`evo.bench.paired.LocalRetimer` in bench and compare): one timing
is one noisy sample, so a candidate that looks faster than the incumbent (the search's best) or than
its parent is challenged in a paired re-timing against it (`evo.core.retiming`). Only a candidate
whose whole 95% interval is faster by at least `min_effect` becomes the incumbent, counts as a win of
its agent (its yield, its move statistics, "best from") and so reaches the lessons; the others are
recorded as equal within noise (or slower, or failed). Re-timings are bounded by `budget_share` of
`max_evaluations`, fastest-looking candidates first; a candidate left unchallenged is not credited.
So that nothing which looked faster goes unexamined, the run ends with a final race (`final_race`,
its re-timings reserved in that budget): the fastest-looking candidates no re-timing examined race
the incumbent, paired, in rounds; a contender found slower drops out, one equal within noise is timed
again while rounds are left, and the fastest confirmed faster becomes the incumbent (the others go on
against it). Whatever still looks faster and was not raced is named, with why (`RaceResult.unexamined`).
Without a retimer (the synthetic evaluator, tests) a single timing decides, as it always did.
"""
from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from evo.core.effects import GeneEffects
from evo.core.genome import DOMAINS, GeneSpace, Genome
from evo.core.lessons import Lessons
from evo.core.population import Population, PopulationSettings
from evo.core.proposer import Archive, Feedback, ProposalRequest, improves_on_parent
from evo.core.records import STATUSES, EvalResult, Evaluated, Parent, Proposal
from evo.core.fidelity import ScreenSettings
from evo.core.reserve import EndReserve
from evo.core.retiming import (EQUAL, FASTER, Challenge, IntensifySettings, PairedTiming, Retimer, not_timed,
                               pooled)
from evo.core.seeds import derive_seed

# The default team: one agent per genome domain (registered under the domain's name) and recombination.
# Every agent name, these and the others (optuna, code, or a dotted path to a class of your own), is
# resolved by the registry in evo.core.proposer; the config loader checks the names.
DEFAULT_AGENTS: tuple[str, ...] = (*DOMAINS, "integration")


@dataclass(frozen=True)
class SearchSettings:
    """Budget and shape of the search. Each field: default, and what it does."""

    seed: int = 0  # the run seed; every agent's and evaluator's seed derives from it by name
    generations: int = 6  # generations to run (generation 0 is the seeds)
    offspring: int = 8  # proposals per generation
    max_evaluations: int = 60  # genome evaluations in all (baselines not counted)
    max_wall_s: float = 540.0  # no new generation starts after this many seconds; while intensifying, none starts
    # unless it, the final race of what waits and the final re-timing fit in it too (`evo.core.reserve`)
    agents: tuple[str, ...] = DEFAULT_AGENTS  # agents taking part by registered name (also: optuna, code) or
    # dotted path to a Proposer class (package.module:Class)
    parents_per_agent: int = 3  # parents offered to each agent per generation
    seed_genes: dict[str, list] | None = None  # restrict random seeds (not agents), e.g. {backend_intra: [eager]}
    random_seeds: int | None = None  # random genomes in generation 0 beside the default (and a warm start's
    # seeds); None: as many as fill `offspring`; 0: the agents start from the default genome alone
    population: PopulationSettings = field(default_factory=PopulationSettings)
    learning: bool = True  # agents steer by the per-gene effects of every result and the offspring are split
    # by each agent's measured yield; false: per-move statistics only, offspring shared round-robin
    intensify: IntensifySettings = field(default_factory=IntensifySettings)  # paired re-timing of challengers
    prescreen_factor: float = 0.0  # > 0 (at least 1): skip proposals the workload's model (kernel_facts)
    # predicts slower than this factor times its prediction for the best measured genome; 0: off
    screen: ScreenSettings = field(default_factory=ScreenSettings)  # a generation workload's candidates timed on
    # shorter replays, the promising ones raced paired on whole ones (`evo.core.fidelity`); count 0: off

    def __post_init__(self) -> None:
        for name, value in (("generations", self.generations), ("offspring", self.offspring),
                            ("max_evaluations", self.max_evaluations), ("parents_per_agent", self.parents_per_agent)):
            if value < 1:
                raise ValueError(f"search.{name} must be >= 1, got {value}")
        if not self.max_wall_s > 0:  # also refuses NaN
            raise ValueError(f"search.max_wall_s must be a number of seconds > 0, got {self.max_wall_s}")
        # which names exist is the registry's business (evo.core.proposer), checked where agents load
        if not (self.prescreen_factor == 0 or self.prescreen_factor >= 1):  # also refuses NaN
            raise ValueError(f"search.prescreen_factor must be 0 (off) or >= 1, got {self.prescreen_factor}")
        if self.random_seeds is not None and self.random_seeds < 0:
            raise ValueError(f"search.random_seeds must be >= 0 (or null: fill generation 0), got {self.random_seeds}")
        if not self.agents or len(set(self.agents)) != len(self.agents):
            raise ValueError(f"search.agents must name at least one agent, each once; got {list(self.agents)}")


class Team(Protocol):
    """The search's agents by name (in-process: `operators.team.LocalTeam`; on Ray: `operators.ray_team.RayTeam`)."""

    parents_needed: Mapping[str, int]  # agent name -> parents it needs (`Proposer.parents_needed`)

    def ask(self, requests: list[ProposalRequest]) -> list[list[Proposal]]:
        """Each request's proposals, in request order."""
        ...

    def tell(self, feedback: Feedback) -> None:
        """The closed generation's feedback, to every agent."""
        ...

    def state(self) -> dict[str, Any]: ...
    def load_state(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class GenerationReport:
    generation: int
    evaluated: tuple[Evaluated, ...]
    best: Evaluated | None
    evaluations: int  # total so far
    status_counts: dict[str, int]
    median_latency_ms: float  # over this generation's ok results
    wall_s: float  # this generation's wall time, its re-timings included
    retimings: tuple[PairedTiming, ...] = ()  # this generation's paired re-timings (intensification)

    @property
    def fraction_valid(self) -> float:
        return self.status_counts.get("ok", 0) / max(1, len(self.evaluated))

    @property
    def best_latency_ms(self) -> float:
        return self.best.fitness if self.best else math.inf

    @property
    def evals_per_s(self) -> float:
        return len(self.evaluated) / self.wall_s if self.wall_s > 0 else math.nan


@dataclass(frozen=True)
class Unexamined:
    """A correct candidate whose single timing beats the winner's and that no paired re-timing examined."""

    hash: str
    latency_ms: float  # its single timing
    reason: str  # why it was not raced

    def to_dict(self) -> dict[str, Any]:
        return {"hash": self.hash, "latency_ms": self.latency_ms, "reason": self.reason}


@dataclass(frozen=True)
class RaceResult:
    """The final race: who raced, its re-timings round by round (a = a contender, b = the holder it raced),
    the incumbent before and after, what was left unexamined, and each contender's deciding record (its
    rounds against its last holder pooled)."""

    contenders: tuple[str, ...] = ()
    timings: tuple[PairedTiming, ...] = ()
    rounds: int = 0
    before: str | None = None  # the incumbent's hash when the race began
    winner: str | None = None  # the incumbent's hash after it
    unexamined: tuple[Unexamined, ...] = ()
    wall_s: float = 0.0
    decisions: tuple[PairedTiming, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        last = {t.a: t for t in self.decisions}
        return {"contenders": list(self.contenders), "rounds": self.rounds, "before": self.before,
                "winner": self.winner, "wall_s": self.wall_s,
                "verdicts": {h: {"verdict": t.verdict, "against": t.b, "ratio": t.ratio, "low": t.low, "high": t.high,
                                 "pairs": t.pairs} for h, t in last.items()}}


class Search:
    def __init__(self, gene_space: GeneSpace, settings: SearchSettings, team: Team, lessons: Lessons | None = None,
                 retimer: Retimer | None = None, predict: Callable[[Genome], float | None] | None = None,
                 reserve: EndReserve | None = None) -> None:
        """`predict`: a genome's modelled time in ms (None: no model for it), read by the pre-screen. `reserve`:
        what the run's end costs (with a retimer): generations stop while the final race and re-timing fit."""
        self.gene_space = gene_space
        self.settings = settings
        self.team = team
        self.population = Population(settings.population)
        self.rng = np.random.default_rng(derive_seed(settings.seed, "search"))
        self.seed_space = gene_space.restrict(settings.seed_genes) if settings.seed_genes else gene_space
        self.known: dict[str, Evaluated] = {}  # every evaluated genome by hash
        self.pending: dict[str, Proposal] = {}  # asked, not yet told
        self.generation = 0
        self._current: list[Evaluated] = []
        self._started = time.monotonic()
        self._generation_started = self._started
        self.effects = GeneEffects()  # evidence of every result, failures included
        self.yields: dict[str, list[int]] = {a: [0, 0] for a in settings.agents}  # agent -> [children, wins]
        self.lessons = lessons
        self.retimer = retimer
        self.predict = predict
        self._predicted: dict[str, float | None] = {}  # genome hash -> modelled ms
        self.prescreened: dict[str, float] = {}  # skipped by the pre-screen: genome hash -> modelled ms
        self.incumbent: Evaluated | None = None  # with intensification: the best, confirmed by paired re-timing
        self.retimings: list[PairedTiming] = []  # every paired re-timing of this search, in order
        self.reserve = reserve
        self.generation_walls: list[float] = []  # each generation's wall time in this session, re-timings included
        self.stopped_for_end: str = ""  # why the search started no more generations to keep its end in budget
        if lessons is not None:
            self._learn_from(lessons)

    def _learn_from(self, lessons: Lessons) -> None:
        """Start from what earlier runs learned: effects and yields as prior evidence, agents' statistics."""
        self.effects.merge(lessons.effects)
        for agent, (tries, wins) in lessons.yields.items():
            if agent in self.yields:
                self.yields[agent] = [tries, wins]
        self.team.load_state({a: {"stats": s} for a, s in lessons.agent_stats.items() if a in self.settings.agents})

    # -- budget ---------------------------------------------------------------------------------
    @property
    def evaluations(self) -> int:
        return len(self.known)

    def budget_left(self) -> int:
        return self.settings.max_evaluations - self.evaluations - len(self.pending)

    def done(self) -> bool:
        return (
            self.generation >= self.settings.generations
            or self.budget_left() <= 0
            or self.elapsed_s() > self.settings.max_wall_s
            or self._end_would_not_fit()
        )

    def elapsed_s(self) -> float:
        return time.monotonic() - self._started

    def end_reserve_s(self, waiting: int | None = None) -> float:
        """Seconds the run's end needs: a round of the final race for what waits (+1: the next generation may
        add one) and the final re-timing (0 without a reserve; nan while no cost is known)."""
        if self.reserve is None or not self.intensifying:
            return 0.0
        waiting = len(self.unexamined()) + 1 if waiting is None else waiting
        race = self.reserve.race_s(min(waiting, self.settings.intensify.final_race), self.retimings)
        return race + self.reserve.final_s()

    def _end_would_not_fit(self) -> bool:
        """Whether another generation (as long as the median one so far) and the run's end overrun max_wall_s."""
        if self.reserve is None or not self.intensifying or not self.generation_walls:
            return False
        generation_s, end_s = statistics.median(self.generation_walls), self.end_reserve_s()
        if not math.isfinite(end_s) or self.elapsed_s() + generation_s + end_s <= self.settings.max_wall_s:
            return False
        self.stopped_for_end = (f"no generation started after {self.elapsed_s():.0f} s: another (~{generation_s:.0f} s)"
                                f" and the run's end (~{end_s:.0f} s: the final race of {len(self.unexamined())}"
                                f" waiting and the final re-timing) would overrun search.max_wall_s ="
                                f" {self.settings.max_wall_s:g} s")
        return True

    @property
    def intensifying(self) -> bool:
        """Whether challengers are re-timed (a retimer was given and `search.intensify.enabled`)."""
        return self.retimer is not None and self.settings.intensify.enabled

    def best(self) -> Evaluated | None:
        """The incumbent when intensifying (its wins were confirmed paired), else the fastest single timing."""
        return self.incumbent if self.intensifying else self.population.best()

    # -- ask ------------------------------------------------------------------------------------
    def ask(self) -> list[Proposal]:
        """The next generation's proposals: new genomes only, at most the budget left."""
        if self.pending:
            raise RuntimeError(f"ask() with {len(self.pending)} proposals still untold")
        self._generation_started = time.monotonic()
        wanted = min(self.settings.offspring, self.budget_left())
        if wanted <= 0:
            return []
        seeding = len(self.population) == 0
        proposals = self._seeds(wanted) if seeding else self._offspring(wanted)
        proposals = self._prescreen(proposals)
        if len(proposals) < wanted and not (seeding and self.settings.random_seeds is not None):
            # agents ran dry (all children known): explore at random (not past a seed generation's random_seeds)
            more = self._random(wanted - len(proposals), {p.hash for p in proposals} | set(self.prescreened),
                                "random restart")
            proposals += self._prescreen(more)
        proposals = [replace(p, generation=self.generation, index=i) for i, p in enumerate(proposals[:wanted])]
        self.pending = {p.hash: p for p in proposals}
        return proposals

    def _prescreen(self, proposals: list[Proposal]) -> list[Proposal]:
        """Proposals the model does not predict far slower than the best measured genome (all of them
        while the pre-screen is off, nothing is measured yet, or the model has no prediction)."""
        best = self.population.best()
        if self.predict is None or not self.settings.prescreen_factor or best is None:
            return proposals
        reference = self._model_ms(best.proposal.genome)
        bound = self.settings.prescreen_factor * (reference if reference is not None else best.fitness)
        kept = []
        for proposal in proposals:
            ms = self._model_ms(proposal.genome)
            if ms is not None and ms > bound:
                self.prescreened[proposal.hash] = ms
            else:
                kept.append(proposal)
        return kept

    def _model_ms(self, genome: Genome) -> float | None:
        if genome.hash not in self._predicted:
            self._predicted[genome.hash] = self.predict(genome)
        return self._predicted[genome.hash]

    def _seeds(self, n: int) -> list[Proposal]:
        seeds = []
        if self.lessons is not None:  # an earlier run's best engines first: timed again here, not trusted
            for rank, genome, latency in self.lessons.legal_best(self.gene_space):
                # two earlier bests may build one engine (legal_best canonicalises): propose it once
                if genome.hash not in self.known and genome.hash not in {s.hash for s in seeds}:
                    seeds.append(Proposal(genome, (), "seed", f"warm start: #{rank + 1} of lessons "
                                          f"{self.lessons.describe()} ({latency:.3f} ms there)", self.generation,
                                          move_kind="warm_start"))
        default = self.gene_space.default()
        if default.hash not in self.known and default.hash not in {s.hash for s in seeds}:
            seeds.append(Proposal(default, (), "seed", "default genome", self.generation, move_kind="seed"))
        seeds = seeds[:n]
        randoms = n - len(seeds) if self.settings.random_seeds is None else min(n - len(seeds), self.settings.random_seeds)
        return seeds + self._random(randoms, {s.hash for s in seeds}, "random genome")

    def _random(self, n: int, taken: set[str], move: str) -> list[Proposal]:
        out: list[Proposal] = []
        for _ in range(50 * max(n, 1)):
            if len(out) >= n:
                break
            genome = self.seed_space.sample(self.rng)
            if genome.hash in self.known or genome.hash in taken:
                continue
            taken.add(genome.hash)
            out.append(Proposal(genome, (), "seed", move, self.generation, move_kind="seed"))
        return out

    def _offspring(self, wanted: int) -> list[Proposal]:
        # an agent that needs more parents than the population holds (recombination: two) sits this one
        # out, unless that would leave no agent at all
        agents = [a for a in self.settings.agents if self.team.parents_needed[a] <= len(self.population)]
        agents = agents or list(self.settings.agents)
        shares = self._shares(agents, wanted)
        effects = self.effects if self.settings.learning else None
        requests = []
        archive = Archive(self.known)
        for name, share in zip(agents, shares):
            if share == 0:
                continue
            parents = self.population.select_parents(self.rng, self.settings.parents_per_agent)
            unique = tuple({p.proposal.hash: Parent(p.proposal.genome, p.fitness) for p in parents}.values())
            # Ask for a few spares: some children may already be known.
            requests.append(ProposalRequest(name, self.generation, unique, share + 2, archive, effects))
        answers = self.team.ask(requests)
        proposals: list[Proposal] = []
        taken: set[str] = set()
        for request, answer in zip(requests, answers):
            share = shares[agents.index(request.agent)]
            fresh = [p for p in answer if p.hash not in self.known and p.hash not in taken][:share]
            taken.update(p.hash for p in fresh)
            proposals += fresh
        return proposals

    def _shares(self, agents: list[str], wanted: int) -> list[int]:
        """Offspring per agent: even shares, or with `learning` one each and the rest by a Thompson
        draw of each agent's yield (Beta(wins+1, losses+1)), so agents whose children pay get more."""
        n = len(agents)
        if not self.settings.learning:  # round robin, starting one agent later each generation
            return [wanted // n + (1 if (i - self.generation) % n < wanted % n else 0) for i in range(n)]
        draws = np.array([self.rng.beta(self.yields.get(a, [0, 0])[1] + 1,
                                        self.yields.get(a, [0, 0])[0] - self.yields.get(a, [0, 0])[1] + 1)
                          for a in agents])
        if wanted <= n:  # fewer offspring than agents: the best draws get one each
            top = set(np.argsort(-draws, kind="stable")[:wanted].tolist())
            return [int(i in top) for i in range(n)]
        extra = (wanted - n) * draws / draws.sum()
        shares = np.floor(extra).astype(int)
        for i in np.argsort(-(extra - shares), kind="stable")[: wanted - n - int(shares.sum())]:
            shares[i] += 1
        return [1 + int(s) for s in shares]

    # -- tell -----------------------------------------------------------------------------------
    def tell(self, proposal: Proposal, result: EvalResult) -> Evaluated:
        """Record the one result of a pending proposal."""
        if proposal.hash not in self.pending:
            raise KeyError(f"result for {proposal.hash}, which is not pending (told twice, or never asked)")
        if result.genome_hash != proposal.hash:
            raise ValueError(f"result is for {result.genome_hash}, proposal is {proposal.hash}")
        del self.pending[proposal.hash]
        evaluated = Evaluated(proposal, result)
        self.known[proposal.hash] = evaluated
        self.population.offer(evaluated)
        self._current.append(evaluated)
        return evaluated

    def end_generation(self) -> GenerationReport:
        """Close the generation: agents learn which moves paid; the report is returned."""
        if self.pending:
            raise RuntimeError(f"end_generation() with {len(self.pending)} proposals untold")
        current = sorted(self._current, key=lambda e: e.proposal.index)
        timings = self._intensify(current) if self.intensifying else []
        improved = self._account(current, timings)
        if current:
            self.team.tell(Feedback(self.generation, tuple(current), improved))
        counts = {s: sum(1 for e in current if e.result.status == s) for s in STATUSES}
        ok = [e.fitness for e in current if math.isfinite(e.fitness)]
        report = GenerationReport(
            generation=self.generation,
            evaluated=tuple(current),
            best=self.best(),
            evaluations=self.evaluations,
            status_counts=counts,
            median_latency_ms=statistics.median(ok) if ok else math.nan,
            wall_s=time.monotonic() - self._generation_started,
            retimings=tuple(timings),
        )
        self.generation_walls.append(report.wall_s)
        self._current = []
        self.generation += 1
        return report

    # -- saved state ----------------------------------------------------------------------------
    def restore(self, evaluated: list[Evaluated], generation: int, retimings: Sequence[PairedTiming] = ()) -> None:
        """Adopt results recorded by an earlier session, as if told, and continue at `generation`;
        `retimings`: the paired re-timings recorded with them (they decide wins and the incumbent again)."""
        self.adopt(evaluated, [t for t in retimings if t.generation < generation])
        self.generation = generation

    def adopt(self, evaluated: list[Evaluated], retimings: Sequence[PairedTiming] = ()) -> None:
        """Record results that were evaluated but not asked in this session (never evaluated again)."""
        for item in evaluated:
            self.known[item.proposal.hash] = item
            self.population.offer(item)
        self.retimings += list(retimings)
        # the same order as end_generation accounts them, so effects and yields come out identical
        self._account(sorted(evaluated, key=lambda e: (e.proposal.generation, e.proposal.index)), retimings)

    # -- intensification --------------------------------------------------------------------------
    def _intensify(self, current: list[Evaluated]) -> list[PairedTiming]:
        """Re-time this generation's challengers (fastest-looking first, within the budget left once the
        final race's reserve is set aside)."""
        left = self.retimes_left()
        if self.settings.screen.enabled:  # promote the fastest-looking share of the generation, no more
            left = min(left, math.ceil(self.settings.screen.promote * sum(e.result.ok for e in current)))
        challenges = []
        for item in sorted((e for e in current if e.result.ok), key=lambda e: (e.fitness, e.proposal.hash)):
            if len(challenges) >= left:
                break
            holder, reason = self._holder(item)
            if holder is not None:
                challenges.append(Challenge(item, holder, reason, self.generation))
        if not challenges:
            return []
        answers = self.retimer.retime(challenges, self.settings.intensify)
        if len(answers) != len(challenges):
            raise RuntimeError(f"the retimer answered {len(answers)} of {len(challenges)} challenges")
        timings = [replace(t, a=c.challenger.proposal.hash, b=c.holder.proposal.hash, reason=c.reason,
                           generation=c.generation) for c, t in zip(challenges, answers) if not not_timed(t)]
        self.retimings += timings  # one a stop left undone examined nothing: its challenger waits for the race
        return timings

    def retimes_left(self) -> int:
        """Re-timings the search may still run in its generations (the final race's reserve set aside)."""
        settings, evaluations = self.settings.intensify, self.settings.max_evaluations
        return settings.budget(evaluations) - settings.reserve(evaluations) - len(self.retimings)

    def unexamined(self) -> list[Evaluated]:
        """Correct candidates whose single timing beats the incumbent's and that no paired re-timing has
        examined, fastest-looking first ([] without intensification or an incumbent)."""
        if not self.intensifying or self.incumbent is None:
            return []
        examined = {t.a for t in self.retimings} | {self.incumbent.proposal.hash}
        return sorted((e for e in self.known.values() if e.result.ok and e.fitness < self.incumbent.fitness
                       and e.proposal.hash not in examined), key=lambda e: (e.fitness, e.proposal.hash))

    def final_race(self, not_run: str | None = None, should_stop: Callable[[], bool] = lambda: False) -> RaceResult:
        """Race the fastest-looking unexamined candidates against the incumbent before the winner is declared
        (see the module). `not_run`: the race does not run, and every such candidate is named with this reason.
        With a reserve, a round races only the contenders that fit in what is left of search.max_wall_s (the
        final re-timing's share set aside); `should_stop`: a stop ends it, keeping the rounds it finished."""
        started, settings = time.monotonic(), self.settings.intensify
        waiting = self.unexamined()
        before = self.incumbent.proposal.hash if self.incumbent else None
        if not_run is not None or not waiting:
            return RaceResult(before=before, winner=before, unexamined=tuple(
                Unexamined(e.proposal.hash, e.fitness, not_run or "") for e in waiting))
        budget = settings.budget(self.settings.max_evaluations)
        places = min(settings.final_race, max(0, budget - len(self.retimings)))
        contenders = waiting[:places]
        why = (f"beyond the final race's {settings.final_race} places (search.intensify.final_race)"
               if places == settings.final_race else f"the re-timing budget ({budget}) was spent")
        left_out = [Unexamined(e.proposal.hash, e.fitness, why) for e in waiting[places:]]
        raced, timings, rounds = [], [], 0
        evidence: dict[str, PairedTiming] = {}  # contender -> its pooled record against the current holder
        decisions: dict[str, PairedTiming] = {}  # contender -> the record that decided it last

        def leave(items: list[Evaluated], reason: str) -> None:
            left_out.extend(Unexamined(c.proposal.hash, c.fitness, reason) for c in items if c.proposal.hash not in raced)

        while contenders and rounds < settings.race_rounds:
            if should_stop():
                leave(contenders, "the run was stopped during its final race")
                break
            if time.monotonic() - started >= settings.race_wall_s:
                leave(contenders, f"the final race's wall time ran out (search.intensify.race_wall_s = "
                                  f"{settings.race_wall_s:g} s)")
                break
            contenders, over = self._fit_in_wall(contenders[:budget - len(self.retimings) - len(timings)],
                                                 [*self.retimings, *timings])
            if over:
                leave(*over)
            if not contenders:
                break
            holder = self.incumbent
            challenges = [Challenge(c, holder, "race", self.generation) for c in contenders]
            answers = self.retimer.retime(challenges, settings)
            if len(answers) != len(challenges):
                raise RuntimeError(f"the retimer answered {len(answers)} of {len(challenges)} challenges")
            rounds += 1
            undone = [c for c, answer in zip(contenders, answers) if not_timed(answer)]
            leave(undone, "the run was stopped during its final race")
            timed = [(c, answer) for c, answer in zip(contenders, answers) if not not_timed(answer)]
            raced += [c.proposal.hash for c, _ in timed if c.proposal.hash not in raced]
            decided = []
            for c, answer in timed:
                record = replace(answer, a=c.proposal.hash, b=holder.proposal.hash, reason="race",
                                 generation=self.generation)
                timings.append(record)  # each round's own pairs are the evidence; the pooled ones decide
                earlier = evidence.get(c.proposal.hash)
                evidence[c.proposal.hash] = decision = pooled(earlier, record) if earlier is not None else record
                decisions[c.proposal.hash] = decision
                decided.append((c, decision))
            faster = [(r.ratio, c.proposal.hash, c) for c, r in decided if r.verdict == FASTER]
            if faster:  # the fastest confirmed takes the lead; the other live contenders race it afresh
                self.incumbent = min(faster, key=lambda f: (f[0], f[1]))[2]
                contenders = [c for c, r in decided if r.verdict in (FASTER, EQUAL) and c is not self.incumbent]
                evidence.clear()
            else:
                contenders = [c for c, r in decided if r.verdict == EQUAL]
            if undone:
                break
        self.retimings += timings
        return RaceResult(tuple(raced), tuple(timings), rounds, before, self.incumbent.proposal.hash,
                          tuple(sorted(left_out, key=lambda u: (u.latency_ms, u.hash))),
                          time.monotonic() - started, tuple(decisions.values()))

    def _fit_in_wall(self, contenders: list[Evaluated], measured: Sequence[PairedTiming]
                     ) -> tuple[list[Evaluated], tuple[list[Evaluated], str] | None]:
        """The contenders (fastest-looking first) one round can race in what is left of search.max_wall_s once
        the final re-timing's share is set aside, and (the others, why) when some do not fit."""
        if self.reserve is None:
            return contenders, None
        left_s = self.settings.max_wall_s - self.elapsed_s() - self.reserve.final_s()
        fit = self.reserve.fitting(len(contenders), left_s, measured)
        if fit >= len(contenders):
            return contenders, None
        out = contenders[fit:]
        needed = self.reserve.race_s(len(out), measured)
        return contenders[:fit], (out, f"search.max_wall_s ({self.settings.max_wall_s:g} s) ran out: racing the "
                                       f"{len(out)} left would have needed about {needed:.0f} s more")

    def _holder(self, item: Evaluated) -> tuple[Evaluated | None, str]:
        """What `item` looks faster than and must beat paired: the incumbent, else its fastest parent."""
        incumbent = self.incumbent
        if incumbent is not None and item.fitness < incumbent.fitness and item.proposal.hash != incumbent.proposal.hash:
            return incumbent, "incumbent"
        parents = [self.known[h] for h in item.proposal.parents if h in self.known and self.known[h].result.ok]
        if parents and improves_on_parent(item, self.known):
            return min(parents, key=lambda e: (e.fitness, e.proposal.hash)), "parent"
        return None, ""

    def _crown(self, items: list[Evaluated], confirmed: Mapping[str, PairedTiming]) -> None:
        """Move the incumbent, generation by generation: the first correct engine takes it (nothing to
        compare it with); later, a challenger confirmed faster than the incumbent (the fastest by the
        paired ratio when several are)."""
        for _, group in itertools.groupby(items, key=lambda e: e.proposal.generation):
            ok = [e for e in group if e.result.ok]
            if self.incumbent is None:
                self.incumbent = min(ok, key=lambda e: (e.fitness, e.proposal.hash), default=None)
                continue
            holder = self.incumbent.proposal.hash
            winners = [(confirmed[e.proposal.hash].ratio, e.proposal.hash, e) for e in ok
                       if e.proposal.hash in confirmed and confirmed[e.proposal.hash].reason == "incumbent"
                       and confirmed[e.proposal.hash].b == holder]
            if winners:
                self.incumbent = min(winners, key=lambda w: (w[0], w[1]))[2]

    def _account(self, items: list[Evaluated], retimings: Sequence[PairedTiming] = ()) -> frozenset[str]:
        """Add results to the gene effects and the agents' yields; returns the hashes of the results that
        improve on their parent, which the agents' feedback carries too: by `improves_on_parent`, or
        when intensifying only those a paired re-timing confirmed faster (`evo.core.retiming`)."""
        self.effects.observe(items)
        if self.intensifying:
            confirmed = {t.a: t for t in retimings if t.verdict == FASTER}
            improved = frozenset(e.proposal.hash for e in items if e.proposal.hash in confirmed)
            self._crown(items, confirmed)
        else:
            improved = frozenset(e.proposal.hash for e in items if improves_on_parent(e, self.known))
        for item in items:
            if item.proposal.agent in self.yields:
                self.yields[item.proposal.agent][0] += 1
                self.yields[item.proposal.agent][1] += int(item.proposal.hash in improved)
        return improved

    def state(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "evaluated": [e.proposal.hash for e in self.known.values()],
            "population": [m.proposal.hash for m in self.population.members],
            "rng": self.rng.bit_generator.state,
            "agents": self.team.state(),
            "agent_yields": {a: list(v) for a, v in self.yields.items()},
            "gene_effects": self.effects.to_dict(),
            "warm_start": self.lessons.describe() if self.lessons else None,
            "incumbent": self.incumbent.proposal.hash if self.incumbent else None,
            "retimings": len(self.retimings),
        }
