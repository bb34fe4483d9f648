"""The agents of a run, called in-process. `operators.ray_team.RayTeam` is the same on Ray actors."""
from __future__ import annotations

from typing import Any

from evo.core.genome import GeneSpace
from evo.core.effects import GeneEffects
from evo.core.records import Evaluated, Proposal
from evo.core.seeds import derive_seed
from operators.base import Agent, Outcome, Parent
from operators.code_agent import CodeAgent
from operators.fusion import FusionAgent
from operators.integration import IntegrationAgent
from operators.memory_layout import MemoryLayoutAgent
from operators.optuna_agent import OptunaAgent
from operators.scheduling import SchedulingAgent

AGENT_CLASSES: dict[str, type[Agent]] = {
    cls.name: cls for cls in (FusionAgent, SchedulingAgent, MemoryLayoutAgent, IntegrationAgent, OptunaAgent, CodeAgent)
}

# (agent name, parents, number of proposals wanted, hashes already known, the search's gene effects or None)
Request = tuple[str, list[Parent], int, frozenset, GeneEffects | None]


def make_agent(name: str, gene_space: GeneSpace, run_seed: int, options: dict[str, Any] | None = None) -> Agent:
    """Agent `name`; `options` are its keyword arguments beyond the gene space and seed (the code agent's
    settings, workload, run directory and lessons file)."""
    if name not in AGENT_CLASSES:
        raise ValueError(f"unknown agent {name!r}; available: {sorted(AGENT_CLASSES)}")
    return AGENT_CLASSES[name](gene_space, derive_seed(run_seed, f"agent:{name}"), **(options or {}))


class LocalTeam:
    """Agents as plain objects in this process (tests, single-process runs)."""

    def __init__(self, names: list[str], gene_space: GeneSpace, run_seed: int,
                 options: dict[str, dict[str, Any]] | None = None) -> None:
        options = options or {}
        self.agents = {name: make_agent(name, gene_space, run_seed, options.get(name)) for name in names}

    def propose(self, requests: list[Request], generation: int) -> list[list[Proposal]]:
        return [self.agents[name].propose(parents, n, generation, known, effects)
                for name, parents, n, known, effects in requests]

    def learn(self, outcomes: dict[str, list[Outcome]], results: tuple[Evaluated, ...] = ()) -> None:
        """Each agent's own move outcomes, and every result of the generation to every agent."""
        for name, agent in self.agents.items():
            if name in outcomes:
                agent.learn(outcomes[name])
            agent.observe(results)

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
