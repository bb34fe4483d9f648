"""IntegrationAgent: recombines whole domains of two good parents into one child.

A child takes each domain (fusion, scheduling, memory) from one of two parents, e.g. one parent's
fusion plan with the other's schedule. Illegal combinations are skipped, not repaired.
"""
from __future__ import annotations

import itertools

import numpy as np

from evo.core.effects import GeneEffects
from evo.core.genome import DOMAINS, Genome, GenomeError
from evo.core.proposer import register_proposer
from evo.core.records import Proposal
from operators.base import Agent, Move, Parent


@register_proposer
class IntegrationAgent(Agent):
    name = "integration"
    domain = ""
    parents_needed = 2  # a child takes domains from two parents

    def move_kinds(self, parent: Genome) -> list[str]:
        return ["recombine"]

    def apply(self, kind: str, parent: Genome, rng: np.random.Generator) -> Move | None:
        raise NotImplementedError("integration works on two parents; use propose()")

    def propose(self, parents: list[Parent], n: int, generation: int,
                exclude: frozenset[str] = frozenset(), effects: GeneEffects | None = None) -> list[Proposal]:
        """Up to `n` children of distinct parent pairs. Without `effects`, the first legal new mask of
        each pair; with them, the legal new mask a Thompson draw of the gene effects favours."""
        proposals: list[Proposal] = []
        seen = {p.genome.hash for p in parents} | set(exclude)
        pairs = list(itertools.permutations(range(len(parents)), 2))
        order = self.rng.permutation(len(pairs)) if pairs else []
        for pair_index in order:
            if len(proposals) >= n:
                break
            a, b = (parents[i] for i in pairs[int(pair_index)])
            # Each non-trivial mask takes some domains from a and the rest from b.
            children = []
            for mask in self.rng.permutation(2 ** len(DOMAINS) - 2) + 1:
                take_b = [bool(int(mask) >> i & 1) for i in range(len(DOMAINS))]
                data = a.genome.to_dict()
                for domain, from_b in zip(DOMAINS, take_b):
                    if from_b:
                        data[domain] = b.genome.domain(domain)
                try:
                    child = self.gene_space.validate(Genome.from_dict(data))
                except GenomeError:
                    continue
                if child.hash in seen:
                    continue
                children.append((child, take_b))
                if effects is None:
                    break
            if not children:
                continue
            child, take_b = (children[0] if effects is None else
                             min(children, key=lambda c: effects.sample_score(self.rng, a.genome, c[0])))
            seen.add(child.hash)
            taken = ", ".join(f"{d} from {(b if fb else a).genome.hash[:8]}" for d, fb in zip(DOMAINS, take_b))
            proposals.append(Proposal(genome=child, parents=(a.genome.hash, b.genome.hash),
                                      agent=self.name, move=taken, move_kind="recombine",
                                      generation=generation))
        return proposals
