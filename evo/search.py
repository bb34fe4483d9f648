"""The ask/tell core of the evolutionary search. Pure: no Ray, no MLflow, no torch.

`ask()` returns the next generation's proposals (agents' children of selected parents, or seeds),
deduplicated against every genome already evaluated and trimmed to the evaluation budget.
`tell()` records exactly one result per proposal; `end_generation()` feeds the agents what paid and
returns the generation's report. Who evaluates (in-process, Ray pool) is the caller's business.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from evo.genome import GeneSpace
from evo.population import Population, PopulationSettings
from evo.records import STATUSES, EvalResult, Evaluated, Proposal
from evo.seeds import derive_seed
from operators.base import Outcome, Parent

AGENT_NAMES = ("fusion", "scheduling", "memory", "integration")


@dataclass(frozen=True)
class SearchSettings:
    """Budget and shape of the search. Each field: default, and what it does."""

    seed: int = 0  # the run seed; every agent's and evaluator's seed derives from it by name
    generations: int = 6  # generations to run (generation 0 is the seeds)
    offspring: int = 8  # proposals per generation
    max_evaluations: int = 60  # genome evaluations in all (baselines not counted)
    max_wall_s: float = 540.0  # no new generation starts after this many seconds
    agents: tuple[str, ...] = AGENT_NAMES  # agents taking part, offspring shared round-robin
    parents_per_agent: int = 3  # parents offered to each agent per generation
    seed_genes: dict[str, list] | None = None  # restrict random seeds (not agents), e.g. {backend_intra: [eager]}
    population: PopulationSettings = field(default_factory=PopulationSettings)

    def __post_init__(self) -> None:
        for name, value in (("generations", self.generations), ("offspring", self.offspring),
                            ("max_evaluations", self.max_evaluations), ("parents_per_agent", self.parents_per_agent)):
            if value < 1:
                raise ValueError(f"search.{name} must be >= 1, got {value}")
        unknown = [a for a in self.agents if a not in AGENT_NAMES]
        if unknown or not self.agents:
            raise ValueError(f"search.agents {list(self.agents)} invalid; choose from {list(AGENT_NAMES)}")


class Team(Protocol):
    def propose(self, requests: list[tuple[str, list[Parent], int, frozenset]], generation: int) -> list[list[Proposal]]: ...
    def learn(self, outcomes: dict[str, list[Outcome]]) -> None: ...
    def state(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class GenerationReport:
    generation: int
    evaluated: tuple[Evaluated, ...]
    best: Evaluated | None
    evaluations: int  # total so far
    status_counts: dict[str, int]
    median_latency_ms: float  # over this generation's ok results
    wall_s: float  # this generation's wall time

    @property
    def fraction_valid(self) -> float:
        return self.status_counts.get("ok", 0) / max(1, len(self.evaluated))

    @property
    def best_latency_ms(self) -> float:
        return self.best.fitness if self.best else math.inf

    @property
    def evals_per_s(self) -> float:
        return len(self.evaluated) / self.wall_s if self.wall_s > 0 else math.nan


class Search:
    def __init__(self, gene_space: GeneSpace, settings: SearchSettings, team: Team) -> None:
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
            or time.monotonic() - self._started > self.settings.max_wall_s
        )

    def best(self) -> Evaluated | None:
        return self.population.best()

    # -- ask ------------------------------------------------------------------------------------
    def ask(self) -> list[Proposal]:
        """The next generation's proposals: new genomes only, at most the budget left."""
        if self.pending:
            raise RuntimeError(f"ask() with {len(self.pending)} proposals still untold")
        self._generation_started = time.monotonic()
        wanted = min(self.settings.offspring, self.budget_left())
        if wanted <= 0:
            return []
        if len(self.population) == 0:
            proposals = self._seeds(wanted)
        else:
            proposals = self._offspring(wanted)
        if len(proposals) < wanted:  # agents ran dry (all children known): explore at random
            proposals += self._random(wanted - len(proposals), {p.hash for p in proposals}, "random restart")
        proposals = [
            Proposal(genome=p.genome, parents=p.parents, agent=p.agent, move=p.move, move_kind=p.move_kind,
                     generation=self.generation, index=i)
            for i, p in enumerate(proposals[:wanted])
        ]
        self.pending = {p.hash: p for p in proposals}
        return proposals

    def _seeds(self, n: int) -> list[Proposal]:
        default = self.gene_space.default()
        seeds = []
        if default.hash not in self.known:
            seeds.append(Proposal(default, (), "seed", "default genome", self.generation, move_kind="seed"))
        return seeds + self._random(n - len(seeds), {s.hash for s in seeds}, "random genome")

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
        agents = list(self.settings.agents)
        if len(self.population) < 2 and "integration" in agents and len(agents) > 1:
            agents.remove("integration")  # recombination needs two parents
        shares = [wanted // len(agents) + (1 if i < wanted % len(agents) else 0) for i in range(len(agents))]
        requests = []
        known = frozenset(self.known)
        for name, share in zip(agents, shares):
            if share == 0:
                continue
            parents = self.population.select_parents(self.rng, self.settings.parents_per_agent)
            unique = list({p.proposal.hash: Parent(p.proposal.genome, p.fitness) for p in parents}.values())
            # Ask for a few spares: some children may already be known.
            requests.append((name, unique, share + 2, known))
        answers = self.team.propose(requests, self.generation)
        proposals: list[Proposal] = []
        taken: set[str] = set()
        for (name, _, _, _), answer in zip(requests, answers):
            share = shares[agents.index(name)]
            fresh = [p for p in answer if p.hash not in self.known and p.hash not in taken][:share]
            taken.update(p.hash for p in fresh)
            proposals += fresh
        return proposals

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
        outcomes: dict[str, list[Outcome]] = {}
        for item in current:
            if item.proposal.agent in self.settings.agents:
                parent_fitness = min((self.known[h].fitness for h in item.proposal.parents if h in self.known),
                                     default=math.inf)
                improved = item.fitness < parent_fitness
                outcomes.setdefault(item.proposal.agent, []).append(Outcome(item.proposal.move_kind, improved))
        if outcomes:
            self.team.learn(outcomes)
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
        )
        self._current = []
        self.generation += 1
        return report

    # -- saved state ----------------------------------------------------------------------------
    def restore(self, evaluated: list[Evaluated], generation: int) -> None:
        """Adopt results recorded by an earlier session, as if told, and continue at `generation`."""
        self.adopt(evaluated)
        self.generation = generation

    def adopt(self, evaluated: list[Evaluated]) -> None:
        """Record results that were evaluated but not asked in this session (never evaluated again)."""
        for item in evaluated:
            self.known[item.proposal.hash] = item
            self.population.offer(item)

    def state(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "evaluated": [e.proposal.hash for e in self.known.values()],
            "population": [m.proposal.hash for m in self.population.members],
            "rng": self.rng.bit_generator.state,
            "agents": self.team.state(),
        }
