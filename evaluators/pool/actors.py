"""Evaluator actors on a Ray cluster: placement, asynchronous dispatch, hard timeouts, elasticity.

This is the one module of `evaluators/` that imports Ray. Each actor wraps the plain `Evaluator`.
Placement (see `evaluators.pool.placement`): one actor per GPU (`num_gpus=1`) on every node of the run's
accelerator type, or CPU actors pinned to disjoint cores of their node. Every actor is pinned to its
node and declares its resources (`num_cpus`, `num_gpus`) explicitly.

Dispatch keeps every ready actor busy while proposals remain; each proposal gets exactly one result:
- an engine that hangs or dies only takes its own process down: the evaluator kills it at
  `eval_timeout_s` and records the result itself (see evaluators/sandbox/process.py);
- an evaluation that outlives `eval_timeout_s` + a grace period anyway is an evaluator hang: the actor
  is killed and replaced;
- an actor whose process dies is replaced and the death is the proposal's recorded result;
- an actor whose *node* leaves the cluster is retired and its proposal re-queued to another actor
  (the candidate did nothing wrong, and no result of the dead actor can arrive later);
- nodes that join are watched for and get new actors, which take work once they report ready.
A run targets one device type: an actor reporting another device than the first one is retired.
"""
from __future__ import annotations

import collections
import os
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from evaluators.judge.calibration import Calibration
from evaluators.judge.evaluator import Evaluator
from evaluators.pool.placement import NodeView, PlacementError, SlotPlan, initial_plan, placement_kind, plan_slots
from evaluators.settings import EvaluatorSettings, PoolSettings
from evo.core.fidelity import FULL, SCREEN
from evo.core.records import RUNTIME_ERROR, TIMEOUT, EvalResult, Proposal
from evo.core.retiming import NOT_TIMED, PairedTiming, failed_timing
from evo.core.seeds import derive_seed
from evo.workloads.base import DeviceInfo, MachineRates, Preset

__all__ = ["EvaluatorPool", "PlacementError", "PoolSettings", "RetimeJob"]

_MAX_FAILED_STARTS = 3  # per node: after this many actors failed to start there, the node is skipped
_GRACE_S = 60.0  # beyond eval_timeout_s: the evaluator's own deadline fires first (killing the engine takes time)


class PlacedEvaluator(Evaluator):
    """The evaluator inside a Ray actor: takes its cores by position on its own node and reports
    where it runs (node, GPU ids, CUDA_VISIBLE_DEVICES)."""

    def __init__(self, workload: str, preset: str, settings: EvaluatorSettings, seed: int, name: str,
                 core_positions: tuple[int, ...] | None) -> None:
        cores = None
        if core_positions is not None:
            available = sorted(os.sched_getaffinity(0))
            if max(core_positions) >= len(available):
                raise PlacementError(f"{name}: core positions {list(core_positions)} exceed the {len(available)} "
                                     f"cores this node lets the evaluator use")
            cores = tuple(available[p] for p in core_positions)
        super().__init__(workload, preset, settings, seed, name, cores)

    def describe(self) -> dict:
        return {**super().describe(), "node_id": ray.get_runtime_context().get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "host": socket.gethostname(), "pid": os.getpid(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


@dataclass(frozen=True)
class RetimeJob:
    """One paired re-timing for an evaluator (`Evaluator.retime`): the first engine against each other."""

    engines: tuple[str, ...]  # genome JSON, "default" or "baseline:NAME"
    sources: dict[str, str]  # code hash -> source for the genomes' code genes
    calls: int = 16
    warmup: int = 2
    min_effect: float = 0.02
    reason: str = ""
    generation: int = -1

    def failed(self, message: str, evaluator: str) -> list[PairedTiming]:
        """What the job answers when its evaluator could not (died, hung)."""
        labels = [e if not e.lstrip().startswith("{") else "genome" for e in self.engines]
        return [failed_timing(labels[0], b, message, self.min_effect, reason=self.reason, generation=self.generation,
                              evaluator=evaluator) for b in labels[1:]]


@dataclass(frozen=True)
class _Job:
    """One call of an evaluator actor's method, and what stands for its result when the actor cannot give one."""

    key: Any  # what the caller gets back beside the result
    method: str
    args: tuple
    kwargs: dict
    failed: Callable[[str, str, str, str], Any]  # (status, message, error, evaluator) -> the result


@dataclass(eq=False)  # identity: a slot is one actor's place in the pool
class _Slot:
    """One evaluator actor: where it runs, and whether it has reported ready."""

    index: int
    plan: SlotPlan
    actor: Any
    starting: Any  # the describe() call while the actor starts; None once ready
    info: dict | None = None

    @property
    def name(self) -> str:
        return f"evaluator-{self.index}"


class EvaluatorPool:
    """Evaluator actors for one (workload, preset): `settings` is what each evaluator does, `pool` how many
    run and where; `on_event` gets one line per change (an actor replaced, a node joining or leaving)."""

    def __init__(self, workload: str, preset: Preset, settings: EvaluatorSettings, run_seed: int,
                 pool: PoolSettings = PoolSettings(), *, on_event: Callable[[str], None] = lambda message: None,
                 watch_interval_s: float = 2.0, start_timeout_s: float = 300.0, node_wait_s: float = 120.0) -> None:
        self.workload, self.preset, self.settings, self.run_seed = workload, preset, settings, run_seed
        self.count, self.threads = pool.count, pool.threads
        self.kind = placement_kind(pool.placement, preset.name, preset.device)
        self.on_event = on_event
        self.should_stop = lambda: False  # polled at least once a second: stop dispatching when true
        self.sources_of: Callable[[Proposal], dict[str, str]] = lambda p: dict(p.sources)  # code hash -> source
        self.screen: dict[str, int] | None = None  # candidates' evaluations screen so (evo.core.fidelity); None: full
        self.watch_interval_s, self.node_wait_s = watch_interval_s, node_wait_s
        self.slots: list[_Slot] = []
        self.device_type: str | None = None  # the device every timing of this run comes from
        self.requeued = 0  # evaluations handed to another actor because their node left
        self._next_index = 0
        self._failed_starts: collections.Counter[str] = collections.Counter()
        self._last_watch = time.monotonic()
        self._rates: MachineRates | None = None  # the run's rates (use_rates), handed to every actor
        plans, self.accelerator = initial_plan(self._nodes(), self.kind, pool.threads, pool.count,
                                               pool.accelerator_type, preset.name)
        for plan in plans:
            self._start(plan)
        self._await_first(start_timeout_s)

    # -- placement ------------------------------------------------------------------------------
    def _nodes(self) -> list[NodeView]:
        driver = ray.get_runtime_context().get_node_id()
        cores = len(os.sched_getaffinity(0))
        return [NodeView.from_ray(n, driver, cores) for n in ray.nodes() if n.get("Alive")]

    def _start(self, plan: SlotPlan) -> _Slot:
        options: dict[str, Any] = {
            "num_cpus": self.threads, "num_gpus": 1 if self.kind == "gpu" else 0, "max_restarts": 0,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(plan.node_id, soft=False)}
        slot = _Slot(self._next_index, plan, None, None)
        self._next_index += 1
        seed = derive_seed(self.run_seed, slot.name)
        positions = plan.cores(self.threads) if self.kind == "cpu" else None
        slot.actor = ray.remote(PlacedEvaluator).options(**options).remote(
            self.workload, self.preset.name, self.settings, seed, slot.name, positions)
        slot.starting = slot.actor.describe.remote()
        if self._rates is not None:  # an actor's calls run in order: it has the run's floor before any work
            slot.actor.use_rates.remote(self._rates)
        self.slots.append(slot)
        return slot

    def _await_first(self, timeout: float) -> None:
        """Wait for the first actors; any failure here is a configuration problem: fail fast."""
        try:
            infos = ray.get([slot.starting for slot in self.slots], timeout=timeout)
        except GetTimeoutError as exc:
            self.close()
            raise PlacementError(f"evaluators did not start within {timeout:.0f} s: the cluster may lack "
                                 f"{self._need()} (other jobs may hold them)") from exc
        except Exception as exc:
            self.close()
            raise PlacementError(f"an evaluator failed to start: {_cause(exc)}") from exc
        self.device_type = infos[0]["device"]  # the driver's node comes first
        for slot, info in zip(list(self.slots), infos):
            self._admit(slot, info)

    def _ready(self, slot: _Slot) -> None:
        """A started actor reported (or failed to)."""
        try:
            info = ray.get(slot.starting)
        except Exception as exc:
            self._failed_starts[slot.plan.node_id] += 1
            self._retire(slot, f"it failed to start: {_cause(exc)}")
            return
        if self._admit(slot, info):
            self.on_event(f"evaluator {slot.name} ready on node {_short(slot.plan.node_id)}"
                          f" ({len(self.ready_slots())} ready)")

    def _admit(self, slot: _Slot, info: dict) -> bool:
        """Let a started actor take work, if it times on the run's device type; else retire it."""
        if info["device"] != self.device_type:
            self._retire(slot, f"its device {info['device']} is not the run's {self.device_type}")
            return False
        slot.info, slot.starting = info, None
        return True

    def _retire(self, slot: _Slot, why: str) -> None:
        self._kill(slot)
        self.slots.remove(slot)
        self.on_event(f"evaluator {slot.name} on node {_short(slot.plan.node_id)} retired: {why}")

    def _replace(self, slot: _Slot) -> None:
        """A new actor at the same place (its predecessor hung or died on a node that is still up)."""
        self._kill(slot)
        self.slots.remove(slot)
        self._start(slot.plan)

    def _watch(self, force: bool = False) -> None:
        """Retire actors of nodes that left; start actors on nodes that joined (throttled)."""
        if not force and time.monotonic() - self._last_watch < self.watch_interval_s:
            return
        self._last_watch = time.monotonic()
        nodes = self._nodes()
        alive = {n.node_id for n in nodes}
        for slot in [s for s in self.slots if s.plan.node_id not in alive]:
            self._retire(slot, "its node left the cluster")
        usable = [n for n in nodes if self._failed_starts[n.node_id] < _MAX_FAILED_STARTS]
        limit = max(0, self.count - len(self.slots)) if self.count else None
        taken = {(s.plan.node_id, s.plan.position) for s in self.slots}
        for plan in plan_slots(usable, self.kind, self.threads, self.accelerator, taken, limit):
            slot = self._start(plan)
            self.on_event(f"evaluator {slot.name} starting on node {_short(plan.node_id)}")

    def _need(self) -> str:
        """What one evaluator needs, for error messages."""
        return "a free GPU" if self.kind == "gpu" else f"{self.threads} free CPU(s) on one node"

    def _node_lost(self, slot: _Slot, exc: BaseException) -> bool:
        if "node has died" in str(exc):
            return True
        return slot.plan.node_id not in {n["NodeID"] for n in ray.nodes() if n.get("Alive")}

    # -- information ----------------------------------------------------------------------------
    def ready_slots(self) -> list[_Slot]:
        return [s for s in self.slots if s.starting is None]

    def describe(self) -> list[dict]:
        return [dict(s.info) for s in self.ready_slots()]

    def device_info(self) -> DeviceInfo:
        return self._ask_one("device_info")

    def calibrate(self) -> Calibration:
        """The machine's rates, measured on one evaluator (best of short probes, never below the
        machine's cached calibration), with where they came from."""
        return self._ask_one("calibration")

    def use_rates(self, rates: MachineRates) -> None:
        """Every evaluator, and every one started later, judges with `rates`: one floor for the run."""
        self._rates = rates
        for slot in self.slots:
            slot.actor.use_rates.remote(rates)

    def best_rates(self) -> MachineRates:
        """The rates re-measured on one evaluator, merged (the higher of each) with what every ready
        evaluator holds (one that re-measured below the floor holds higher ones); no evaluation runs."""
        slots = self.ready_slots()
        refs = [slots[0].actor.measure_rates.remote(True)] + [s.actor.measure_rates.remote() for s in slots[1:]]
        best = None
        for ref in refs:
            try:
                rates = ray.get(ref, timeout=self.settings.eval_timeout_s)
            except (GetTimeoutError, RayActorError):
                continue
            best = rates if best is None else best.merged_max(rates)
        if best is None:
            raise RuntimeError("no evaluator could re-measure the machine's rates")
        return best

    def _ask_one(self, method: str):
        slot = self.ready_slots()[0]
        return ray.get(getattr(slot.actor, method).remote(), timeout=self.settings.eval_timeout_s)

    # -- evaluation -----------------------------------------------------------------------------
    def run_baselines(self, names: list[str],
                      on_result: Callable[[str, EvalResult], None] = lambda name, result: None) -> dict[str, EvalResult]:
        """Each baseline's result, in the order they finish; `on_result` hears of each as it does (progress)."""
        jobs = [_Job(name, "evaluate_baseline", (name,), {}, _eval_failure(f"baseline:{name}")) for name in names]
        results = {}
        for key, result in self._dispatch(jobs, timeout_factor=self._budget_factor(("baseline:",))):
            results[key] = result
            on_result(key, result)
        return results

    def run(self, proposals: list[Proposal]) -> Iterator[tuple[Proposal, EvalResult]]:
        # (genome JSON[, sources]): only genomes with code genes need sources
        screen = {"screen": self.screen} if self.screen else {}
        jobs = [_Job(p, "evaluate", (p.genome.to_json(), *filter(None, [self.sources_of(p)])), screen,
                     _eval_failure(p.hash, SCREEN if screen else FULL)) for p in proposals]
        yield from self._dispatch(jobs)

    def retime(self, jobs: list[RetimeJob]) -> list[list[PairedTiming]]:
        """Paired re-timings (`evaluators.judge.paired`), each in one evaluator, spread over the ready ones;
        the answers in job order. An evaluator that dies or hangs answers `failed` records."""
        calls = [_Job(i, "retime", (list(job.engines),),
                      {"calls": job.calls, "warmup": job.warmup, "min_effect": job.min_effect, "sources": job.sources,
                       "reason": job.reason, "generation": job.generation},
                      lambda status, message, error, evaluator, job=job: job.failed(f"{status}: {message}", evaluator))
                 for i, job in enumerate(jobs)]
        if not jobs:
            return []
        answers = dict(self._dispatch(calls, timeout_factor=max(self._budget_factor(job.engines) for job in jobs)))
        return [answers.get(i) or job.failed(NOT_TIMED, "") for i, job in enumerate(jobs)]

    def _budget_factor(self, engines: Sequence[str]) -> float:
        """The evaluators' budget for these engines ("baseline:NAME" or genome JSON), in eval_timeout_s: a
        baseline's build has its own limit (`EvaluatorSettings.budgets`)."""
        s = self.settings
        return sum(s.budgets(baseline=e.startswith("baseline:"))[1][1] for e in engines) / s.eval_timeout_s

    def _dispatch(self, jobs: list[_Job], timeout_factor: float = 1) -> Iterator[tuple[Any, Any]]:
        queue = collections.deque(jobs)
        running: dict[Any, tuple[tuple, _Slot, float]] = {}  # ref -> (job, slot, started)
        timeout = self.settings.eval_timeout_s * timeout_factor + _GRACE_S
        lost_since: float | None = None
        while queue or running:
            if self.should_stop():  # in-flight work is abandoned (its actors are killed at close)
                return
            self._watch()
            for ref, (job, slot, _) in list(running.items()):
                if slot not in self.slots:  # retired with its node: the job goes to another actor
                    running.pop(ref)
                    queue.appendleft(job)
                    self.requeued += 1
            busy = {id(slot) for _, slot, _ in running.values()}
            for slot in self.ready_slots():
                if not queue:
                    break
                if id(slot) not in busy:
                    job = queue.popleft()
                    running[getattr(slot.actor, job.method).remote(*job.args, **job.kwargs)] = (job, slot, time.monotonic())
            if not running and not self.ready_slots():  # nothing can take work: wait a while for evaluators
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since > self.node_wait_s:
                    raise PlacementError(f"no evaluator could take work for {self.node_wait_s:.0f} s: the nodes that "
                                         f"ran them left the cluster, or new ones cannot start (they need "
                                         f"{self._need()})")
                if not self.slots:
                    self._watch(force=True)
                    time.sleep(0.5)
                    continue
            else:
                lost_since = None
            starting = {slot.starting: slot for slot in self.slots if slot.starting is not None}
            deadline = min((started for _, _, started in running.values()), default=time.monotonic()) + timeout
            wait_s = min(1.0, max(0.0, deadline - time.monotonic()))
            ready, _ = ray.wait(list(running) + list(starting), num_returns=1, timeout=wait_s)
            for ref in ready:
                if ref in starting:
                    self._ready(starting[ref])
                    continue
                job, slot, _ = running.pop(ref)
                result = self._collect(ref, job, slot)
                if result is None:
                    queue.appendleft(job)
                    self.requeued += 1
                else:
                    yield job.key, result
            for ref, (job, slot, started) in list(running.items()):
                if time.monotonic() - started > timeout:
                    running.pop(ref)
                    self._replace(slot)
                    budget = "eval_timeout_s" if timeout_factor == 1 else f"its budget {timeout - _GRACE_S:g} s"
                    yield job.key, job.failed(TIMEOUT, f"evaluation exceeded {budget} + {_GRACE_S:g} s = "
                                                       f"{timeout:g} s; evaluator killed and replaced", "", slot.name)

    def _collect(self, ref, job: _Job, slot: _Slot) -> Any:
        """The job's result, or None when the actor's node left (the job is to be re-queued)."""
        try:
            return ray.get(ref)
        except RayActorError as exc:
            if self._node_lost(slot, exc):
                self._retire(slot, "its node left the cluster; its evaluation is re-queued")
                return None
            self._replace(slot)
            return job.failed(RUNTIME_ERROR, "evaluator process died during evaluation; replaced", str(exc)[:2000],
                              slot.name)
        except Exception as exc:  # an error the evaluator failed to turn into a status
            return job.failed(RUNTIME_ERROR, f"{type(exc).__name__}: {exc}"[:500], traceback.format_exc()[-2000:],
                              slot.name)

    def _kill(self, slot: _Slot) -> None:
        try:
            ray.kill(slot.actor, no_restart=True)
        except Exception:  # already dead
            pass

    def close(self) -> None:
        for slot in self.slots:
            self._kill(slot)


def _eval_failure(genome_hash: str, fidelity: str = FULL) -> Callable[[str, str, str, str], EvalResult]:
    return lambda status, message, error, evaluator: EvalResult(genome_hash, status, message=message, error=error,
                                                                evaluator=evaluator, fidelity=fidelity)


def _short(node_id: str) -> str:
    return node_id[:8]


def _cause(exc: BaseException) -> str:
    """The useful line of an actor's failure (Ray wraps the constructor's exception in its own text)."""
    text = str(exc).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:500]
