"""The agents of a run as Ray actors, one per agent; same interface as `operators.team.LocalTeam`."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from evo.core.genome import GeneSpace
from evo.core.proposer import Archive, Feedback, ProposalRequest
from evo.core.records import Proposal
from operators.registry import proposer_class
from operators.team import make_agent


class _AgentActor:
    """Holds one agent; constructed inside the actor so its RNG lives there. Its class is resolved by the
    driver and travels by reference, so an agent named by dotted path loads where its module imports."""

    def __init__(self, cls: type, name: str, gene_space: GeneSpace, run_seed: int,
                 options: dict[str, Any] | None = None) -> None:
        self.agent = make_agent(name, gene_space, run_seed, options, cls=cls)

    def ask(self, request: ProposalRequest, archive: Archive) -> list[Proposal]:
        return self.agent.ask(replace(request, archive=archive))

    def tell(self, feedback: Feedback) -> None:
        self.agent.tell(feedback)

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
        classes = {name: proposer_class(name) for name in names}  # an unknown name fails here, before any actor
        self.parents_needed = {name: cls.parents_needed for name, cls in classes.items()}
        # Hard affinity also keeps agents beside the run directory they write (the code agent's artifacts).
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        actor = ray.remote(num_cpus=0, num_gpus=0, max_restarts=0, scheduling_strategy=here)(_AgentActor)
        options = options or {}
        self.actors = {name: actor.options(name=None).remote(classes[name], name, gene_space, run_seed,
                                                             options.get(name))
                       for name in names}

    def ask(self, requests: list[ProposalRequest]) -> list[list[Proposal]]:
        # the archive goes to the object store once per generation, not once per agent
        archives = {id(r.archive): ray.put(r.archive) for r in requests}
        refs = [self.actors[r.agent].ask.remote(replace(r, archive=Archive()), archives[id(r.archive)])
                for r in requests]
        return ray.get(refs)

    def tell(self, feedback: Feedback) -> None:
        shared = ray.put(feedback)  # once, for every actor
        ray.get([actor.tell.remote(shared) for actor in self.actors.values()])

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
