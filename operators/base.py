"""What every agent shares: parents in, proposals out, and statistics of which moves paid.

An agent changes only its own domain of the genome. Its moves are grouped into kinds (for a
per-gene mutation, the gene's name); each kind keeps (tries, wins) where a win is a child that was
correct and faster than its parent. Kinds are chosen by Thompson sampling over Beta(wins+1,
losses+1), so moves that paid are tried more often while every kind keeps some chance.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from evo.genome import GeneSpace, Genome, GenomeError
from evo.records import Proposal


@dataclass(frozen=True)
class Parent:
    """A parent as an agent sees it: its genome and fitness (latency in ms, inf when it failed)."""

    genome: Genome
    fitness: float


@dataclass(frozen=True)
class Outcome:
    """Feedback on one proposal: which move kind it used and whether it beat its parent."""

    move_kind: str
    improved: bool


@dataclass(frozen=True)
class Move:
    """A concrete, legal child of one parent."""

    kind: str
    description: str
    child: Genome


class Agent:
    """Base class: subclasses define `name` and `candidate_moves(parent, rng)`."""

    name: str = ""
    domain: str = ""

    def __init__(self, gene_space: GeneSpace, seed: int) -> None:
        self.gene_space = gene_space
        self.rng = np.random.default_rng(seed)
        self.stats: dict[str, list[int]] = {}  # kind -> [tries, wins]

    # -- to be provided by each agent -------------------------------------------------------
    def move_kinds(self, parent: Genome) -> list[str]:
        raise NotImplementedError

    def apply(self, kind: str, parent: Genome, rng: np.random.Generator) -> Move | None:
        """A legal child for move `kind`, or None when this kind has no legal move from `parent`."""
        raise NotImplementedError

    # -- shared machinery -----------------------------------------------------------------------
    def propose(self, parents: list[Parent], n: int, generation: int,
                exclude: frozenset[str] = frozenset()) -> list[Proposal]:
        """Up to `n` distinct children, cycling over `parents` (best first), none of them in `exclude`
        (the genomes the search already knows)."""
        proposals: list[Proposal] = []
        seen: set[str] = {p.genome.hash for p in parents} | set(exclude)
        attempts = 0
        while len(proposals) < n and parents and attempts < 20 * n:
            parent = parents[attempts % len(parents)]
            attempts += 1
            move = self._draw_move(parent.genome)
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
        self.stats = {k: list(v) for k, v in state["stats"].items()}
        self.rng.bit_generator.state = state["rng"]

    # -- helpers for subclasses -----------------------------------------------------------------
    def legal(self, parent: Genome, domain_values: dict[str, Any]) -> Genome | None:
        """The parent with this domain replaced, if legal and different; else None."""
        try:
            child = self.gene_space.validate(parent.with_domain(self.domain, domain_values))
        except GenomeError:
            return None
        return None if child.hash == parent.hash else child


class GeneMutationAgent(Agent):
    """Mutates one gene of its domain to another legal value; each gene is a move kind."""

    def move_kinds(self, parent: Genome) -> list[str]:
        return [g.name for g in self.gene_space.in_domain(self.domain) if len(g.values) > 1]

    def apply(self, kind: str, parent: Genome, rng: np.random.Generator) -> Move | None:
        gene = self.gene_space.gene(kind)
        current = parent.domain(self.domain)
        alternatives = [v for v in gene.values if v != current[kind]]
        for i in rng.permutation(len(alternatives)):
            value = alternatives[int(i)]
            child = self.legal(parent, {**current, kind: value})
            if child is not None:
                return Move(kind, f"{kind}: {current[kind]} -> {value}", child)
        return None
