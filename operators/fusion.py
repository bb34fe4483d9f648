"""FusionAgent: which adjacent stages run as one function, and on which backend each group runs.

The agent reads the workload's stage pipeline from the gene space (`GeneSpace.pipeline`, an
`evo.core.genome.StagePipeline`): its stages in order, the backend gene of each stage and the fuse
gene of each boundary between adjacent stages. Stages joined by fused boundaries form a group that
must share one backend, so every move keeps that rule: fusing a boundary gives the right-hand group
the left group's backend, and a backend move changes a whole group at once. Genes the parent's
engine ignores (`GeneSpace.ignored_genes`) are not moved: such a child would build the same engine.
A space without a pipeline gets plain per-gene mutations of its fusion domain.
"""
from __future__ import annotations

import numpy as np

from evo.core.genome import Genome, StagePipeline
from evo.core.proposer import register_proposer
from operators.base import Agent, Move


@register_proposer
class FusionAgent(Agent):
    name = "fusion"
    domain = "fusion"

    def _pipeline(self) -> StagePipeline | None:
        pipeline = self.gene_space.pipeline
        return pipeline if pipeline is not None and pipeline.domain == self.domain else None

    def groups(self, genes: dict) -> list[list[str]]:
        """Stages partitioned into fused groups, in pipeline order."""
        pipeline = self._pipeline()
        return [list(stages) for stages, _ in pipeline.groups(genes)] if pipeline else []

    def move_kinds(self, parent: Genome) -> list[str]:
        pipeline = self._pipeline()
        if pipeline is None:  # a workload without a stage pipeline: only plain gene mutations
            return ["gene"] + self.model_kinds()
        ignored = self.gene_space.ignored_genes(parent.values())
        kinds = []
        if any(gene not in ignored for gene, _, _ in pipeline.boundaries()):
            kinds += ["fuse", "split"]
        if any(pipeline.backend_gene(s) not in ignored for s in pipeline.stages):
            kinds.append("backend")
        return (kinds or ["gene"]) + self.model_kinds()

    def apply(self, kind: str, parent: Genome, rng: np.random.Generator) -> Move | None:
        if kind == "model":
            return self.model_move(parent, rng)
        genes = parent.domain(self.domain)
        ignored = self.gene_space.ignored_genes(parent.values())
        pipeline = self._pipeline()
        options = []
        if kind == "gene":
            for gene in self.gene_space.in_domain(self.domain):
                if gene.name not in ignored:
                    options += [(f"{gene.name}: {genes[gene.name]} -> {v}", {**genes, gene.name: v})
                                for v in gene.values if v != genes[gene.name]]
        elif kind in ("fuse", "split"):
            want = kind == "fuse"
            for gene, a, b in pipeline.boundaries():
                if gene not in ignored and genes[gene] != want:
                    new = {**genes, gene: want}
                    if want:  # the right-hand group joins the left one, on its backend
                        for group in self.groups(new):
                            if a in group:
                                for stage in group:
                                    new[pipeline.backend_gene(stage)] = genes[pipeline.backend_gene(a)]
                    options.append((f"{kind} {a}+{b}", new))
        else:
            backends = self.gene_space.gene(pipeline.backend_gene(pipeline.stages[0])).values
            for group in self.groups(genes):
                names = [pipeline.backend_gene(s) for s in group]
                if all(name in ignored for name in names):
                    continue
                for backend in backends:
                    if backend != genes[names[0]]:
                        new = {**genes, **{name: backend for name in names}}
                        options.append((f"backend of {'+'.join(group)} -> {backend}", new))
        for i in rng.permutation(len(options)):
            description, values = options[int(i)]
            child = self.legal(parent, values)
            if child is not None:
                return Move(kind, description, child)
        return None
