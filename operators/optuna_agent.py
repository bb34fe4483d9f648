"""OptunaAgent: Optuna's TPE as one more agent of the team, over the whole genome.

It ignores its parents: its study holds every result of the search (its own trials told, everyone
else's added as they are observed, failures as infeasible), and each proposal is a TPE trial.
Illegal combinations are told to the study as infeasible (see `evo.core.optuna_study`), never evaluated.
Its sampler is reseeded from (agent seed, trials so far) before each batch, and its state is the
trial history, so a restored agent proposes what the original would have.
"""
from __future__ import annotations

from typing import Any

from evo.core.effects import GeneEffects
from evo.core.genome import GeneSpace, Genome
from evo.core.optuna_study import GenomeStudy
from evo.core.proposer import register_proposer
from evo.core.records import EvalResult, Evaluated, Proposal
from evo.core.seeds import derive_seed
from operators.base import Agent, Move, Parent


@register_proposer
class OptunaAgent(Agent):
    name = "optuna"
    domain = ""
    parents_needed = 0  # it ignores its parents: its study holds every result
    sampler = "tpe"

    def __init__(self, gene_space: GeneSpace, seed: int) -> None:
        super().__init__(gene_space, seed)
        self.seed = seed
        self.results: dict[str, EvalResult] = {}  # every result observed, by genome hash
        self.history: list[list] = []  # [genome, result] in the order observed: the study is rebuilt from it
        self.illegal: list[list] = []  # [params, message] of trials the gene space rejected

    def move_kinds(self, parent: Genome) -> list[str]:
        return [self.sampler]

    def apply(self, kind: str, parent: Genome, rng) -> Move | None:
        raise NotImplementedError("the Optuna agent proposes whole genomes; use propose()")

    def _study(self) -> GenomeStudy:
        """The study as a function of what was observed, so a restored agent asks the same trials."""
        study = GenomeStudy(self.gene_space, derive_seed(self.seed, f"trials:{len(self.history)}"), self.sampler)
        for genome, result in self.history:
            study.add(Genome.from_dict(genome), EvalResult.from_dict(result))
        for params, message in self.illegal:
            study.add_illegal(params, message)
        return study

    def propose(self, parents: list[Parent], n: int, generation: int,
                exclude: frozenset[str] = frozenset(), effects: GeneEffects | None = None) -> list[Proposal]:
        study = self._study()
        proposals: list[Proposal] = []
        taken: set[str] = set()
        for _ in range(20 * n):
            if len(proposals) >= n:
                break
            trial, genome = study.ask()
            if genome is None:  # illegal: told to the study as infeasible, remembered for later batches
                self.illegal.append([dict(trial.params), trial.user_attrs.get("illegal", "")])
                continue
            known = self.results.get(genome.hash)
            if known is not None:  # TPE asked for a measured genome: tell it what it was, no new evaluation
                study.tell(trial, known)
                continue
            if genome.hash in exclude or genome.hash in taken:
                study.drop(trial)
                continue
            taken.add(genome.hash)
            proposals.append(Proposal(genome=genome, parents=(), agent=self.name, move=f"{self.sampler} trial "
                                      f"{trial.number}", move_kind=self.sampler, generation=generation))
        return proposals

    def observe(self, results: tuple[Evaluated, ...]) -> None:
        for item in results:
            if item.proposal.hash not in self.results:
                self.results[item.proposal.hash] = item.result
                self.history.append([item.proposal.genome.to_dict(), _plain(item.result)])

    def state(self) -> dict[str, Any]:
        return {**super().state(), "history": self.history, "illegal": self.illegal}

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        if "history" in state:
            self.history = [list(h) for h in state["history"]]
            self.illegal = [list(i) for i in state.get("illegal", [])]
            self.results = {Genome.from_dict(g).hash: EvalResult.from_dict(r) for g, r in self.history}


def _plain(result: EvalResult) -> dict:
    """Only what the study needs, JSON-safe (state.json writes NaN as null; from_dict reads it back)."""
    return {"genome_hash": result.genome_hash, "status": result.status, "latency_ms": result.latency_ms,
            "message": result.message[:200]}
