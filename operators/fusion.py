"""FusionAgent: which adjacent stages run as one function, and on which backend each group runs.

Fusion genes follow a naming convention any workload can use: `backend_<stage>` for each stage in
pipeline order and `fuse_<a>_<b>` for each boundary between adjacent stages a and b. Stages joined
by fused boundaries form a group that must share one backend, so every move keeps that rule:
fusing a boundary gives the right-hand group the left group's backend, and a backend move changes
a whole group at once.
"""
from __future__ import annotations

import numpy as np

from evo.core.genome import Genome
from operators.base import Agent, Move


class FusionAgent(Agent):
    name = "fusion"
    domain = "fusion"

    def _stages(self) -> list[str]:
        return [g.name.removeprefix("backend_") for g in self.gene_space.in_domain("fusion")
                if g.name.startswith("backend_")]

    def _boundaries(self) -> list[tuple[str, str, str]]:
        stages = self._stages()
        pairs = [(a, b) for a, b in zip(stages, stages[1:])]
        genes = {g.name for g in self.gene_space.in_domain("fusion")}
        return [(f"fuse_{a}_{b}", a, b) for a, b in pairs if f"fuse_{a}_{b}" in genes]

    def groups(self, genes: dict) -> list[list[str]]:
        """Stages partitioned into fused groups, in pipeline order."""
        groups: list[list[str]] = []
        for stage in self._stages():
            if groups and genes.get(f"fuse_{groups[-1][-1]}_{stage}", False):
                groups[-1].append(stage)
            else:
                groups.append([stage])
        return groups

    def move_kinds(self, parent: Genome) -> list[str]:
        if not self._stages():  # a workload without the stage convention: only plain gene mutations
            return ["gene"] + self.model_kinds()
        return ["fuse", "split", "backend"] + self.model_kinds()

    def apply(self, kind: str, parent: Genome, rng: np.random.Generator) -> Move | None:
        if kind == "model":
            return self.model_move(parent, rng)
        genes = parent.domain("fusion")
        options = []
        if kind == "gene":
            for gene in self.gene_space.in_domain("fusion"):
                options += [(f"{gene.name}: {genes[gene.name]} -> {v}", {**genes, gene.name: v})
                            for v in gene.values if v != genes[gene.name]]
        elif kind in ("fuse", "split"):
            want = kind == "fuse"
            for gene, a, b in self._boundaries():
                if genes[gene] != want:
                    new = {**genes, gene: want}
                    if want:  # the right-hand group joins the left one, on its backend
                        for group in self.groups(new):
                            if a in group:
                                for stage in group:
                                    new[f"backend_{stage}"] = genes[f"backend_{a}"]
                    options.append((f"{kind} {a}+{b}", new))
        else:
            backends = self.gene_space.gene(f"backend_{self._stages()[0]}").values
            for group in self.groups(genes):
                for backend in backends:
                    if backend != genes[f"backend_{group[0]}"]:
                        new = {**genes, **{f"backend_{s}": backend for s in group}}
                        options.append((f"backend of {'+'.join(group)} -> {backend}", new))
        for i in rng.permutation(len(options)):
            description, values = options[int(i)]
            child = self.legal(parent, values)
            if child is not None:
                return Move(kind, description, child)
        return None
