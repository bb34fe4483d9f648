"""The agents of a run, called in-process. `operators.ray_team.RayTeam` is the same on Ray actors.

Agents are found by name in the core's registry (`evo.core.proposer.proposer_class`): the built-ins
(`operators.registry`), any class registered with `@register_proposer`, or a dotted path to a class.
"""
from __future__ import annotations

from typing import Any

from evo.core.genome import GeneSpace
from evo.core.proposer import Feedback, ProposalRequest, Proposer
from evo.core.records import Proposal
from evo.core.seeds import derive_seed
from operators.registry import proposer_class


def make_agent(name: str, gene_space: GeneSpace, run_seed: int, options: dict[str, Any] | None = None,
               cls: type | None = None) -> Proposer:
    """Agent `name` (a registered name or a dotted path; `cls`: its class, when already resolved), seeded
    from the run seed by name; `options` are its keyword arguments beyond the gene space and seed (the
    code agent's settings, workload, run directory and lessons file). Its proposals carry `name`."""
    cls = cls or proposer_class(name)
    agent = cls(gene_space, derive_seed(run_seed, f"agent:{name}"), **(options or {}))
    if agent.name != name:  # named by dotted path: its proposals carry the name the search knows it by
        agent.name = name
    return agent


class LocalTeam:
    """Agents as plain objects in this process (tests, single-process runs)."""

    def __init__(self, names: list[str], gene_space: GeneSpace, run_seed: int,
                 options: dict[str, dict[str, Any]] | None = None, classes: dict[str, type] | None = None) -> None:
        options, classes = options or {}, classes or {}
        self.agents = {name: make_agent(name, gene_space, run_seed, options.get(name), cls=classes.get(name))
                       for name in names}
        self.parents_needed = {name: agent.parents_needed for name, agent in self.agents.items()}

    def ask(self, requests: list[ProposalRequest]) -> list[list[Proposal]]:
        return [self.agents[request.agent].ask(request) for request in requests]

    def tell(self, feedback: Feedback) -> None:
        """The generation's feedback to every agent (each learns from its own outcomes and sees every result)."""
        for agent in self.agents.values():
            agent.tell(feedback)

    def state(self) -> dict[str, Any]:
        return {name: agent.state() for name, agent in self.agents.items()}

    def load_state(self, state: dict[str, Any]) -> None:
        for name, agent_state in state.items():
            self.agents[name].load_state(agent_state)

    def wait_idle(self, timeout_s: float) -> bool:
        return all(agent.wait_idle(timeout_s) for agent in self.agents.values())

    def close(self) -> None:
        for agent in self.agents.values():
            agent.close()
