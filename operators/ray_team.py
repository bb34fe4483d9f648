"""The agents of a run as Ray actors, one per agent; same interface as `operators.team.LocalTeam`."""
from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from evo.core.genome import GeneSpace
from evo.core.records import Proposal
from operators.base import Outcome
from operators.team import Request, make_agent


class _AgentActor:
    """Holds one agent; constructed inside the actor so its RNG lives there."""

    def __init__(self, name: str, gene_space: GeneSpace, run_seed: int, options: dict[str, Any] | None = None) -> None:
        self.agent = make_agent(name, gene_space, run_seed, options)

    def propose(self, parents, n: int, generation: int, exclude: frozenset = frozenset(),
                effects=None) -> list[Proposal]:
        return self.agent.propose(parents, n, generation, exclude, effects)

    def learn(self, outcomes: list[Outcome] | None, results: tuple = ()) -> None:
        if outcomes:
            self.agent.learn(outcomes)
        self.agent.observe(results)

    def state(self) -> dict[str, Any]:
        return self.agent.state()

    def load_state(self, state: dict[str, Any]) -> None:
        self.agent.load_state(state)

    def close(self) -> None:
        self.agent.close()

    def wait_idle(self, timeout_s: float) -> bool:
        return self.agent.wait_idle(timeout_s)


class RayTeam:
    """One small actor per agent. Agents are light (num_cpus=0, so they never take evaluator cores)
    and live on the driver's node, so a worker node leaving the cluster cannot take them along."""

    def __init__(self, names: list[str], gene_space: GeneSpace, run_seed: int,
                 options: dict[str, dict[str, Any]] | None = None) -> None:
        # Hard affinity also keeps agents beside the run directory they write (the code agent's artifacts).
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        actor = ray.remote(num_cpus=0, num_gpus=0, max_restarts=0, scheduling_strategy=here)(_AgentActor)
        options = options or {}
        self.actors = {name: actor.options(name=None).remote(name, gene_space, run_seed, options.get(name))
                       for name in names}

    def propose(self, requests: list[Request], generation: int) -> list[list[Proposal]]:
        refs = [self.actors[name].propose.remote(parents, n, generation, known, effects)
                for name, parents, n, known, effects in requests]
        return ray.get(refs)

    def learn(self, outcomes: dict[str, list[Outcome]], results: tuple = ()) -> None:
        ray.get([actor.learn.remote(outcomes.get(name), results) for name, actor in self.actors.items()])

    def state(self) -> dict[str, Any]:
        names = list(self.actors)
        return dict(zip(names, ray.get([self.actors[n].state.remote() for n in names])))

    def load_state(self, state: dict[str, Any]) -> None:
        ray.get([self.actors[name].load_state.remote(s) for name, s in state.items()])

    def wait_idle(self, timeout_s: float) -> bool:
        return all(ray.get([a.wait_idle.remote(timeout_s) for a in self.actors.values()], timeout=timeout_s + 30))

    def close(self) -> None:
        try:
            ray.get([actor.close.remote() for actor in self.actors.values()], timeout=10)
        except Exception:  # an actor already gone: killing it below is all that is left
            pass
        for actor in self.actors.values():
            ray.kill(actor)
