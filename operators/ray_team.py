"""The agents of a run on Ray: one actor holds them all; same interface as `operators.team.LocalTeam`.

One actor, not one each: every actor is a worker process that starts Ray's worker and imports the agents'
modules (~1.5 s of CPU each), four of them at every run's start on a 2-core machine took ~5 s. The agents
still run side by side: each has its own concurrency group of one thread, so one agent's calls run in
order while another's (the code agent waiting on its LLM) run beside them.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from evo.core.genome import GeneSpace
from evo.core.proposer import Archive, Feedback, ProposalRequest
from evo.core.records import Proposal
from operators.registry import proposer_class
from operators.team import LocalTeam


class _AgentsActor:
    """Holds the run's agents (`LocalTeam`, constructed inside the actor so their RNGs live there). Their
    classes are resolved by the driver and travel by reference, so an agent named by dotted path loads
    where its module imports."""

    def __init__(self, classes: dict[str, type], gene_space: GeneSpace, run_seed: int,
                 options: dict[str, dict[str, Any]]) -> None:
        self.team = LocalTeam(list(classes), gene_space, run_seed, options, classes=classes)

    def ask(self, request: ProposalRequest, archive: Archive) -> list[Proposal]:
        return self.team.agents[request.agent].ask(replace(request, archive=archive))

    def tell(self, name: str, feedback: Feedback) -> None:
        self.team.agents[name].tell(feedback)

    def state(self, name: str) -> dict[str, Any]:
        return self.team.agents[name].state()

    def load_state(self, name: str, state: dict[str, Any]) -> None:
        self.team.agents[name].load_state(state)

    def wait_idle(self, name: str, timeout_s: float) -> bool:
        return self.team.agents[name].wait_idle(timeout_s)

    def close(self, name: str) -> None:
        self.team.agents[name].close()


class RayTeam:
    """The run's agents in one small actor. Agents are light (num_cpus=0, so they never take evaluator cores)
    and live on the driver's node, so a worker node leaving the cluster cannot take them along."""

    def __init__(self, names: list[str], gene_space: GeneSpace, run_seed: int,
                 options: dict[str, dict[str, Any]] | None = None) -> None:
        classes = {name: proposer_class(name) for name in names}  # an unknown name fails here, before the actor
        self.names = list(names)
        self.parents_needed = {name: cls.parents_needed for name, cls in classes.items()}
        # Hard affinity also keeps agents beside the run directory they write (the code agent's artifacts).
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        actor = ray.remote(num_cpus=0, num_gpus=0, max_restarts=0, scheduling_strategy=here,
                           concurrency_groups={self._group(name): 1 for name in names})(_AgentsActor)
        self.actor = actor.remote(classes, gene_space, run_seed, options or {})

    @staticmethod
    def _group(name: str) -> str:
        return f"agent:{name}"

    def _call(self, method: str, name: str, *args: Any) -> ray.ObjectRef:
        return getattr(self.actor, method).options(concurrency_group=self._group(name)).remote(*args)

    def ask(self, requests: list[ProposalRequest]) -> list[list[Proposal]]:
        # the archive goes to the object store once per generation, not once per request
        archives = {id(r.archive): ray.put(r.archive) for r in requests}
        return ray.get([self._call("ask", r.agent, replace(r, archive=Archive()), archives[id(r.archive)])
                        for r in requests])

    def tell(self, feedback: Feedback) -> None:
        shared = ray.put(feedback)  # once, for every agent
        ray.get([self._call("tell", name, name, shared) for name in self.names])

    def state(self) -> dict[str, Any]:
        return dict(zip(self.names, ray.get([self._call("state", name, name) for name in self.names])))

    def load_state(self, state: dict[str, Any]) -> None:
        ray.get([self._call("load_state", name, name, s) for name, s in state.items()])

    def wait_idle(self, timeout_s: float) -> bool:
        return all(ray.get([self._call("wait_idle", name, name, timeout_s) for name in self.names],
                           timeout=timeout_s + 30))

    def close(self) -> None:
        try:
            ray.get([self._call("close", name, name) for name in self.names], timeout=10)
        except Exception:  # the actor already gone: killing it below is all that is left
            pass
        ray.kill(self.actor)
