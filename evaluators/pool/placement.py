"""Where evaluators go, planned from a snapshot of the cluster's nodes (no Ray here, so it is testable
alone; `evaluators.pool.actors` reads the snapshot from Ray and starts the actors).

- "gpu" placement: one evaluator per GPU on every node of the run's accelerator type.
- "cpu" placement: on every node, `CPU // threads` evaluators, each owning `threads` cores of its node
  (core positions `position * threads ...` in the node's affinity list), so no two share a core.
A run targets one device type: GPU evaluators only go to nodes of one accelerator type.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping

from evaluators.settings import PLACEMENTS

ACCELERATOR_PREFIX = "accelerator_type:"


class PlacementError(RuntimeError):
    """The cluster lacks the resources the evaluators need; the message names the resource."""


@dataclass(frozen=True)
class NodeView:
    """One alive node as placement sees it."""

    node_id: str
    cpus: int
    gpus: int
    accelerator_types: tuple[str, ...] = ()
    cores: int | None = None  # cores this process may use, known for the driver's own node only
    is_driver: bool = False

    @classmethod
    def from_ray(cls, node: Mapping, driver_node_id: str, driver_cores: int) -> NodeView:
        """From one entry of `ray.nodes()`."""
        resources = node.get("Resources", {})
        types = tuple(sorted(k[len(ACCELERATOR_PREFIX):] for k in resources if k.startswith(ACCELERATOR_PREFIX)))
        is_driver = node["NodeID"] == driver_node_id
        return cls(node["NodeID"], int(resources.get("CPU", 0)), int(resources.get("GPU", 0)), types,
                   driver_cores if is_driver else None, is_driver)

    @property
    def accelerator(self) -> str:
        return self.accelerator_types[0] if self.accelerator_types else "unknown"


@dataclass(frozen=True)
class SlotPlan:
    """One evaluator to start: its node and its position there (GPU ordinal, or core group)."""

    node_id: str
    position: int

    def cores(self, threads: int) -> tuple[int, ...]:
        """Positions, in the node's sorted affinity list, of the cores a CPU evaluator owns."""
        return tuple(range(self.position * threads, (self.position + 1) * threads))


def placement_kind(placement: str, preset_name: str, preset_device: str) -> str:
    """'gpu' or 'cpu'. 'auto' follows the preset's device. A cuda preset cannot run on CPU evaluators;
    a cpu preset may be placed one per GPU (each evaluator then holds a GPU and computes on the CPU)."""
    if placement not in PLACEMENTS:
        raise PlacementError(f"evaluators.placement {placement!r} is not one of {PLACEMENTS}")
    if placement == "auto":
        return "gpu" if preset_device == "cuda" else "cpu"
    if placement == "cpu" and preset_device == "cuda":
        raise PlacementError(f"preset {preset_name!r} runs on cuda; evaluators.placement 'cpu' cannot run it "
                             f"(use 'auto' or 'gpu')")
    return placement


def target_accelerator(nodes: Iterable[NodeView], requested: str | None) -> str | None:
    """The accelerator type a GPU run targets: the requested one, else the type with the most GPUs
    (ties broken by name). None when no node has a GPU."""
    gpus = Counter()
    for node in nodes:
        if node.gpus:
            gpus[node.accelerator] += node.gpus
    if requested:
        return requested
    if not gpus:
        return None
    return min(gpus, key=lambda t: (-gpus[t], t))


def capacity(node: NodeView, kind: str, threads: int, accelerator: str | None) -> int:
    """How many evaluators this node holds."""
    if kind == "gpu":
        if accelerator is not None and accelerator not in node.accelerator_types and node.accelerator != accelerator:
            return 0
        return min(node.gpus, node.cpus // threads)
    cpus = node.cpus if node.cores is None else min(node.cpus, node.cores)
    return cpus // threads


def plan_slots(nodes: list[NodeView], kind: str, threads: int, accelerator: str | None,
               taken: set[tuple[str, int]], limit: int | None) -> list[SlotPlan]:
    """The evaluators to add: free positions on each node (the driver's node first, then by node id),
    at most `limit` of them (None: as many as fit)."""
    plans: list[SlotPlan] = []
    for node in sorted(nodes, key=lambda n: (not n.is_driver, n.node_id)):
        for position in range(capacity(node, kind, threads, accelerator)):
            if limit is not None and len(plans) >= limit:
                return plans
            if (node.node_id, position) not in taken:
                plans.append(SlotPlan(node.node_id, position))
    return plans


def initial_plan(nodes: list[NodeView], kind: str, threads: int, count: int, requested_accelerator: str | None,
                 preset_name: str) -> tuple[list[SlotPlan], str | None]:
    """The first evaluators of a run and the accelerator type it targets; raises `PlacementError`
    naming the missing resource when they cannot be placed."""
    if threads < 1:
        raise PlacementError(f"evaluators.threads must be >= 1, got {threads}")
    if count < 0:
        raise PlacementError(f"evaluators.count must be >= 0 (0: as many as fit), got {count}")
    accelerator = target_accelerator(nodes, requested_accelerator) if kind == "gpu" else None
    plans = plan_slots(nodes, kind, threads, accelerator, set(), None)
    fit = len(plans)
    if kind == "gpu" and fit == 0:
        total = sum(n.gpus for n in nodes)
        if total == 0:
            raise PlacementError(f"preset {preset_name!r} needs GPUs but the Ray cluster has none; "
                                 f"start Ray on a GPU node or use a CPU preset")
        if requested_accelerator:
            present = sorted({n.accelerator for n in nodes if n.gpus})
            raise PlacementError(f"no GPU node has {ACCELERATOR_PREFIX}{requested_accelerator}; accelerator "
                                 f"types with GPUs here: {present}. Change evaluators.accelerator_type")
        raise PlacementError(f"a GPU evaluator needs 1 GPU and {threads} CPU(s) on the same node; no node has both")
    if kind == "cpu" and fit == 0:
        most = max((capacity(n, kind, 1, None) for n in nodes), default=0)
        raise PlacementError(f"a CPU evaluator needs {threads} CPU(s) on one node but no node offers more than "
                             f"{most}; lower evaluators.threads")
    if count > fit:
        what = "GPUs" if kind == "gpu" else "CPUs"
        need = count if kind == "gpu" else count * threads
        offered = fit if kind == "gpu" else fit * threads  # GPUs of the targeted type only
        raise PlacementError(f"{count} evaluators x {threads} threads need {need} {what}; only {offered} "
                             f"available. Lower evaluators.count or threads")
    return plans[:count or fit], accelerator
