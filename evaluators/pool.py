"""Evaluator actors on Ray: placement, asynchronous dispatch, hard timeouts, replacement.

This is the one module of `evaluators/` that imports Ray. Each actor wraps the plain `Evaluator`.
- GPU presets: one actor per GPU (`num_gpus=1`), optionally constrained to an accelerator type.
- CPU presets: `count` actors, each pinned to its own disjoint set of `threads` cores, so two
  timings never share a core. (Ray's `num_cpus` reservation keeps other work off those slots.)
Dispatch keeps every actor busy while proposals remain. An evaluation that outlives
`eval_timeout_s` is a hang: the actor is killed (a thread wait cannot stop it) and replaced; an actor
that dies is replaced too. Either way the proposal gets exactly one recorded result.
"""
from __future__ import annotations

import collections
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any, Iterator

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from evaluators.evaluator import Evaluator
from evaluators.settings import EvaluatorSettings
from evo.records import RUNTIME_ERROR, TIMEOUT, EvalResult, Proposal
from evo.seeds import derive_seed
from evo.workloads.base import DeviceInfo, MachineRates, Preset


class PlacementError(RuntimeError):
    """The cluster lacks the resources the evaluators need; the message names the resource."""


@dataclass
class _Slot:
    """One evaluator position: its cores, its current actor and how many actors it has had."""

    index: int
    cores: tuple[int, ...] | None
    actor: Any = None
    generation: int = 0


class EvaluatorPool:
    def __init__(self, workload: str, preset: Preset, settings: EvaluatorSettings, run_seed: int,
                 count: int = 0, threads: int = 1, accelerator_type: str | None = None) -> None:
        self.workload, self.preset, self.settings, self.run_seed = workload, preset, settings, run_seed
        self.threads = threads
        self.accelerator_type = accelerator_type
        self.should_stop = lambda: False  # polled at least once a second: stop dispatching when true
        self.slots = [_Slot(i, cores) for i, cores in enumerate(self._plan(count, threads))]
        for slot in self.slots:
            self._start(slot)
        # Fail fast with a clear message if an actor cannot start (bad preset, missing device).
        self._infos = [self._get(slot.actor.describe.remote(), what="start evaluator") for slot in self.slots]

    # -- placement ------------------------------------------------------------------------------
    def _plan(self, count: int, threads: int) -> list[tuple[int, ...] | None]:
        resources = ray.cluster_resources()
        if self.preset.device == "cuda":
            gpus = int(resources.get("GPU", 0))
            if gpus < 1:
                raise PlacementError(f"preset {self.preset.name!r} needs GPUs but the Ray cluster has none "
                                     f"(resources: {sorted(resources)}); start Ray on a GPU node or use a CPU preset")
            return [None] * (count or gpus)
        if threads < 1:
            raise PlacementError(f"evaluators.threads must be >= 1, got {threads}")
        cores = sorted(os.sched_getaffinity(0))
        cpus = int(resources.get("CPU", 0))
        fit = min(len(cores), cpus) // threads
        if fit < 1:
            raise PlacementError(f"a CPU evaluator needs {threads} CPU(s) but the cluster offers {cpus} "
                                 f"and this node has {len(cores)} cores; lower evaluators.threads")
        count = count or fit
        if count > fit:
            raise PlacementError(f"{count} evaluators x {threads} threads need {count * threads} CPUs; "
                                 f"only {min(len(cores), cpus)} available. Lower evaluators.count or threads")
        return [tuple(cores[i * threads:(i + 1) * threads]) for i in range(count)]

    def _start(self, slot: _Slot) -> None:
        options: dict[str, Any] = {"num_cpus": self.threads, "max_restarts": 0}
        if self.preset.device == "cuda":
            options = {"num_cpus": 1, "num_gpus": 1, "max_restarts": 0}
            if self.accelerator_type:
                options["accelerator_type"] = self.accelerator_type
        name = f"evaluator-{slot.index}" + (f".{slot.generation}" if slot.generation else "")
        seed = derive_seed(self.run_seed, name)
        slot.actor = ray.remote(Evaluator).options(**options).remote(
            self.workload, self.preset.name, self.settings, seed, name, slot.cores)
        slot.generation += 1

    def _replace(self, slot: _Slot) -> None:
        try:
            ray.kill(slot.actor, no_restart=True)
        except Exception:  # already dead
            pass
        self._start(slot)

    def _get(self, ref, what: str, timeout: float = 600.0):
        try:
            return ray.get(ref, timeout=timeout)
        except GetTimeoutError as exc:
            raise PlacementError(f"could not {what} within {timeout:.0f} s: the cluster may lack "
                                 f"{'a GPU' if self.preset.device == 'cuda' else f'{self.threads} free CPU(s)'}") from exc

    # -- information ----------------------------------------------------------------------------
    def describe(self) -> list[dict]:
        return list(self._infos)

    def device_info(self) -> DeviceInfo:
        return self._get(self.slots[0].actor.device_info.remote(), what="read device info")

    def measure_rates(self) -> MachineRates:
        return self._get(self.slots[0].actor.measure_rates.remote(), what="measure rates")

    # -- evaluation -----------------------------------------------------------------------------
    def run_baselines(self, names: list[str]) -> dict[str, EvalResult]:
        jobs = [(name, "evaluate_baseline", name) for name in names]
        return {key: result for key, result in self._dispatch(jobs, hash_of=lambda n: f"baseline:{n}")}

    def run(self, proposals: list[Proposal]) -> Iterator[tuple[Proposal, EvalResult]]:
        jobs = [(p, "evaluate", p.genome.to_json()) for p in proposals]
        yield from self._dispatch(jobs, hash_of=lambda p: p.hash)

    def _dispatch(self, jobs, hash_of) -> Iterator[tuple[Any, EvalResult]]:
        queue = collections.deque(jobs)
        idle = collections.deque(self.slots)
        running: dict[Any, tuple[Any, _Slot, float]] = {}  # ref -> (key, slot, started)
        timeout = self.settings.eval_timeout_s
        while queue or running:
            if self.should_stop():  # in-flight work is abandoned (its actors are killed at close)
                return
            while queue and idle:
                key, method, arg = queue.popleft()
                slot = idle.popleft()
                running[getattr(slot.actor, method).remote(arg)] = (key, slot, time.monotonic())
            nearest = min(started for _, _, started in running.values()) + timeout
            wait_s = min(1.0, max(0.0, nearest - time.monotonic()))
            ready, _ = ray.wait(list(running), num_returns=1, timeout=wait_s)
            for ref in ready:
                key, slot, started = running.pop(ref)
                yield key, self._collect(ref, hash_of(key), slot)
                idle.append(slot)
            for ref, (key, slot, started) in list(running.items()):
                if time.monotonic() - started > timeout:
                    running.pop(ref)
                    self._replace(slot)
                    yield key, EvalResult(hash_of(key), TIMEOUT, message=f"evaluation exceeded eval_timeout_s="
                                          f"{timeout:g} s; evaluator killed and replaced", evaluator=f"evaluator-{slot.index}")
                    idle.append(slot)

    def _collect(self, ref, genome_hash: str, slot: _Slot) -> EvalResult:
        try:
            return ray.get(ref)
        except RayActorError as exc:
            self._replace(slot)
            return EvalResult(genome_hash, RUNTIME_ERROR, message="evaluator process died during evaluation; replaced",
                              error=str(exc)[:2000], evaluator=f"evaluator-{slot.index}")
        except Exception as exc:  # an error the evaluator failed to turn into a status
            return EvalResult(genome_hash, RUNTIME_ERROR, message=f"{type(exc).__name__}: {exc}"[:500],
                              error=traceback.format_exc()[-2000:], evaluator=f"evaluator-{slot.index}")

    def close(self) -> None:
        for slot in self.slots:
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception:
                pass
