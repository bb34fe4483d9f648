"""What every agent shares: parents in, proposals out, and statistics of which moves paid.

`Agent` implements the core's `evo.core.proposer.Proposer` protocol (`ask` a `ProposalRequest`, `tell` a
`Feedback`) on top of two hooks a subclass may override: `propose(parents, n, generation, exclude,
effects)` and `observe(results)`. Register a subclass with `@register_proposer` and configs can name it.

An agent changes only its own domain of the genome. Its moves are grouped into kinds (for a
per-gene mutation, the gene's name); each kind keeps (tries, wins) where a win is a child that was
correct and faster than its parent. Kinds are chosen by Thompson sampling over Beta(wins+1,
losses+1), so moves that paid are tried more often while every kind keeps some chance. Given the
search's per-gene effect model (`evo.core.effects`, built from every result, failures and their messages
included), an agent draws several moves and proposes the one a Thompson draw of the effects favours.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from evo.core.effects import GeneEffects
from evo.core.genome import GeneSpace, Genome, GenomeError
from evo.core.proposer import Feedback, ProposalRequest
from evo.core.records import Evaluated, Outcome, Parent, Proposal

CANDIDATES = 8  # moves drawn per child when steering by effects; the most promising one is proposed


@dataclass(frozen=True)
class Move:
    """A concrete, legal child of one parent."""

    kind: str
    description: str
    child: Genome


class Agent:
    """Base class: subclasses define `name`, `domain`, `move_kinds(parent)` and `apply(kind, parent, rng)`,
    or override `propose` altogether (a whole-genome sampler, recombination, the code agent)."""

    name: str = ""
    domain: str = ""
    parents_needed: int = 1  # parents it needs to propose anything (evo.core.proposer.Proposer)

    def __init__(self, gene_space: GeneSpace, seed: int) -> None:
        self.gene_space = gene_space
        self.rng = np.random.default_rng(seed)
        self.stats: dict[str, list[int]] = {}  # kind -> [tries, wins]
        self._effects: GeneEffects | None = None  # set for the duration of a propose() call

    # -- to be provided by each agent -------------------------------------------------------
    def move_kinds(self, parent: Genome) -> list[str]:
        raise NotImplementedError

    def apply(self, kind: str, parent: Genome, rng: np.random.Generator) -> Move | None:
        """A legal child for move `kind`, or None when this kind has no legal move from `parent`."""
        raise NotImplementedError

    # -- the Proposer protocol ------------------------------------------------------------------
    def ask(self, request: ProposalRequest) -> list[Proposal]:
        """The search's request, answered by `propose`."""
        return self.propose(list(request.parents), request.count, request.generation, request.known,
                            request.effects)

    def tell(self, feedback: Feedback) -> None:
        """Its own results' outcomes to the move statistics (`learn`), then every result to `observe`."""
        outcomes = feedback.outcomes(self.name)
        if outcomes:
            self.learn(outcomes)
        self.observe(feedback.results)

    # -- shared machinery -----------------------------------------------------------------------
    def propose(self, parents: list[Parent], n: int, generation: int,
                exclude: frozenset[str] = frozenset(), effects: GeneEffects | None = None) -> list[Proposal]:
        """Up to `n` distinct children, cycling over `parents` (best first), none of them in `exclude`
        (the genomes the search already knows). With `effects` (the evidence of every result so far),
        each child is the most promising of `CANDIDATES` drawn moves by a Thompson draw of the
        per-gene effects: moves toward values that were slow or failed are drawn less often."""
        proposals: list[Proposal] = []
        seen: set[str] = {p.genome.hash for p in parents} | set(exclude)
        attempts = 0
        while len(proposals) < n and parents and attempts < 20 * n:
            parent = parents[attempts % len(parents)]
            attempts += 1
            self._effects = effects  # the `model` move reads it
            if effects is None:
                move = self._draw_move(parent.genome)
            else:
                drawn = [self._draw_move(parent.genome) for _ in range(CANDIDATES)]
                fresh = {m.child.hash: m for m in drawn if m is not None and m.child.hash not in seen}
                move = min(fresh.values(), key=lambda m: effects.sample_score(self.rng, parent.genome, m.child),
                           default=None)
            if move is None or move.child.hash in seen:
                continue
            seen.add(move.child.hash)
            proposals.append(
                Proposal(
                    genome=move.child,
                    parents=(parent.genome.hash,),
                    agent=self.name,
                    move=move.description,
                    move_kind=move.kind,
                    generation=generation,
                )
            )
        return proposals

    def _draw_move(self, parent: Genome) -> Move | None:
        kinds = self.move_kinds(parent)
        # Thompson sampling: one Beta draw per kind, try kinds from the highest draw down.
        draws = [self.rng.beta(self._wins(k) + 1, self._losses(k) + 1) for k in kinds]
        for i in np.argsort(draws)[::-1]:
            move = self.apply(kinds[int(i)], parent, self.rng)
            if move is not None:
                return move
        return None

    def observe(self, results: tuple[Evaluated, ...]) -> None:
        """Every result of a generation, whoever proposed it (failures included). Agents that model
        the whole history (e.g. `operators.optuna_agent`) override this; the gene-effect model that
        steers the others is kept by the search and passed to `propose`."""

    def close(self) -> None:
        """Stop background work, if the agent has any (the code agent's model calls)."""

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for background work to finish; whether it did (no background work: True)."""
        return True

    def learn(self, outcomes: list[Outcome]) -> None:
        for outcome in outcomes:
            tries_wins = self.stats.setdefault(outcome.move_kind, [0, 0])
            tries_wins[0] += 1
            tries_wins[1] += int(outcome.improved)

    def win_rates(self) -> dict[str, float]:
        return {k: (w / t if t else math.nan) for k, (t, w) in sorted(self.stats.items())}

    def _wins(self, kind: str) -> int:
        return self.stats.get(kind, [0, 0])[1]

    def _losses(self, kind: str) -> int:
        tries, wins = self.stats.get(kind, [0, 0])
        return tries - wins

    # -- saved state ----------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"stats": {k: list(v) for k, v in self.stats.items()}, "rng": self.rng.bit_generator.state}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore saved state; a warm start passes only `stats` (earlier runs' move statistics)."""
        self.stats = {k: list(v) for k, v in state["stats"].items()}
        if "rng" in state:
            self.rng.bit_generator.state = state["rng"]

    # -- helpers for subclasses -----------------------------------------------------------------
    def model_kinds(self) -> list[str]:
        """["model"] once the effects hold a few ok results: a move that sets every gene of this
        agent's domain to the value a Thompson draw of the effects favours (a jump of several genes,
        which single-gene moves cannot make when genes only pay together)."""
        return ["model"] if self._effects is not None and self._effects.ok >= 4 else []

    def model_move(self, parent: Genome, rng: np.random.Generator) -> Move | None:
        current = parent.domain(self.domain)
        for _ in range(3):  # a draw may be illegal (e.g. sub-chunk larger than chunk): draw again
            score = self._effects.draw(rng)
            values = {g.name: min(g.values, key=lambda v, g=g: score(g.name, v))
                      for g in self.gene_space.in_domain(self.domain)}
            child = self.legal(parent, values)
            if child is not None:
                changed = ", ".join(f"{k}: {current[k]} -> {v}" for k, v in values.items() if current[k] != v)
                return Move("model", f"model: {changed}", child)
        return None


    def legal(self, parent: Genome, domain_values: dict[str, Any]) -> Genome | None:
        """The parent with this domain replaced, if legal and a different engine; else None. The parent's
        code genes (evo.core.code) are kept unless `domain_values` names them. The child is canonical
        (`GeneSpace.canonical`): a move that changes only genes its engine ignores gives the parent back,
        so None (a parent from an older journal may not be canonical: compared canonically too)."""
        code = {g: v for g, v in parent.domain(self.domain).items() if g in self.gene_space.code_gene_names()}
        try:
            child = self.gene_space.validate(parent.with_domain(self.domain, {**code, **domain_values}))
        except GenomeError:
            return None
        return None if child.hash in (parent.hash, self.gene_space.canonical(parent).hash) else child


class GeneMutationAgent(Agent):
    """Mutates one gene of its domain to another legal value; each gene is a move kind."""

    def move_kinds(self, parent: Genome) -> list[str]:
        ignored = self.gene_space.ignored_genes(parent.values())  # moving them would build the same engine
        return [g.name for g in self.gene_space.in_domain(self.domain)
                if len(g.values) > 1 and g.name not in ignored] + self.model_kinds()

    def apply(self, kind: str, parent: Genome, rng: np.random.Generator) -> Move | None:
        if kind == "model":
            return self.model_move(parent, rng)
        gene = self.gene_space.gene(kind)
        current = parent.domain(self.domain)
        alternatives = [v for v in gene.values if v != current[kind]]
        for i in rng.permutation(len(alternatives)):
            value = alternatives[int(i)]
            child = self.legal(parent, {**current, kind: value})
            if child is not None:
                return Move(kind, f"{kind}: {current[kind]} -> {value}", child)
        return None
