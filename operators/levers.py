"""LeverSweepAgent: the workload's speed levers, one value at a time, from the best engine so far.

A coordinate sweep over the genes the workload names as levers (`GeneSpace.levers`, most leverage first: how a
step reads the weights, their bytes, steps per exchange, speculation). From its best parent it proposes each lever
set to each of its other values, the genome otherwise unchanged; a child the search already knows is skipped, so
the sweep moves on by itself and starts again from a new best. Lossy values come first where the run allows
them (budget mode): such a value is in the space only because it trades precision for speed. The mutation
agents' random walk over every gene finds a lever's best value too, but at one gene in a dozen per child the
few evaluations an expensive model allows rarely reach it; the sweep reaches each value of every lever within
a few generations and leaves the rest of the genome to the other agents. A value the parent's other genes make
illegal (a kernel that needs another lever's value first, e.g. AMX products that need the C step over bfloat16
weights) comes with the fewest other levers moved from their defaults that make it legal (one, else two; the
levers' order), not three moves later; a lever the parent already moved is not undone for it. Given the search's
evidence (per-gene effects), values already measured slower than the parent's, or seen only failing, come last,
so the sweep moves on to the next lever.
"""
from __future__ import annotations

from itertools import combinations

from evo.core.effects import GeneEffects
from evo.core.genome import Genome, GenomeError
from evo.core.proposer import register_proposer
from evo.core.records import Parent, Proposal
from operators.base import Agent


@register_proposer
class LeverSweepAgent(Agent):
    name = "levers"
    domain = ""  # levers cross domains

    def move_kinds(self, parent: Genome) -> list[str]:
        return [name for name in self.gene_space.levers if len(self.gene_space.gene(name).values) > 1]

    def propose(self, parents: list[Parent], n: int, generation: int,
                exclude: frozenset[str] = frozenset(), effects: GeneEffects | None = None) -> list[Proposal]:
        proposals: list[Proposal] = []
        seen = {p.genome.hash for p in parents} | set(exclude)
        for parent in sorted(parents, key=lambda p: p.fitness):  # best first; the next only once it is swept
            for gene, current, value, child, prerequisites in self._ordered(parent.genome, effects):
                if len(proposals) >= n:
                    return proposals
                if child.hash in seen:
                    continue
                seen.add(child.hash)
                proposals.append(Proposal(genome=child, parents=(parent.genome.hash,), agent=self.name,
                                          move=f"lever {gene}: {current} -> {value}{prerequisites}",
                                          move_kind=gene, generation=generation))
        return proposals

    def _ordered(self, parent: Genome, effects: GeneEffects | None) -> list:
        """The sweep, values the evidence already measured slower than the parent's (the per-gene effects'
        posterior mean, other genes accounted for) or saw only fail moved to its end: a new best is not made to
        re-sweep the lever that made it before the next lever gets a turn."""
        sweep = list(self._sweep(parent))
        if effects is None:
            return sweep

        def measured_worse(move) -> bool:
            gene, current, value = move[:3]
            effect, ok = effects.effect(gene, value)
            if ok == 0:  # failed every time it was tried (e.g. outside the accuracy budget), or never tried
                evidence = effects.evidence(gene, value)
                return evidence is not None and evidence.failed > 0
            return effect > effects.effect(gene, current)[0]

        return sorted(sweep, key=measured_worse)  # stable: the lever order otherwise

    def _sweep(self, parent: Genome):
        """(gene, its current value, another value, child, the other levers changed as the move's text says them)
        for every lever's other values, levers in order, lossy values first; a value illegal with the parent's
        other genes comes with the fewest levers that make it legal."""
        canonical, values = self.gene_space.canonical(parent).hash, parent.values()
        for name in self.move_kinds(parent):
            gene, current = self.gene_space.gene(name), values[name]
            for value in sorted((v for v in gene.values if v != current), key=lambda v: v not in gene.lossy):
                child, changes = self._legal(parent, name, value)
                if child is not None and child.hash not in (parent.hash, canonical):
                    said = ", ".join(f"{lever}: {values[lever]} -> {v}" for lever, v in changes)
                    yield name, current, value, child, f" (with {said})" if said else ""

    def _legal(self, parent: Genome, name: str, value) -> tuple[Genome | None, tuple]:
        """`parent` with `name` set to `value`, or where that is illegal with the parent's other genes, also with one
        (else two) other levers moved from their defaults, the first such child in the levers' order, and those
        changes; None where none makes it legal (a lever the parent already moved is never undone for it: from the
        C step, float16 weights, which need the eager step, are not proposed)."""
        try:
            return self.gene_space.validate(parent.with_genes(**{name: value})), ()
        except GenomeError:
            pass
        values, default = parent.values(), self.gene_space.default().values()
        others = [(lever, v) for lever in self.move_kinds(parent)  # never undoing a lever the parent moved
                  if lever != name and values[lever] == default[lever]
                  for v in self.gene_space.gene(lever).values if v != values[lever]]
        for count in (1, 2):
            for changes in combinations(others, count):
                if len({lever for lever, _ in changes}) < count:
                    continue  # one lever set twice
                try:
                    return self.gene_space.validate(parent.with_genes(**{name: value}, **dict(changes))), changes
                except GenomeError:
                    continue
        return None, ()
