"""The plain evaluator: genome JSON in, exactly one `EvalResult` out. The Ray pool wraps this class
with `ray.remote`; tests call it directly.

One evaluation: parse and validate the genome, build the engine and make one warm-up call at the
preset shape (`build_s` covers both, since torch.compile compiles lazily), run the correctness
cascade on fresh inputs, then time it on rotated input sets. Engine faults become statuses with a
message; only configuration and programming errors raise.

A genome's engine is built and called under `forbid_calls` (it may not call the workload's reference
or baselines; see check.py for the other cheat checks). A result whose median latency is below the
preset's roofline floor (x `roofline_margin`) is 'suspect', never 'ok': faster than the machine allows
means a timing cheat, work deferred past the timer or a wrong roofline. Every result carries the floor.
"""
from __future__ import annotations

import gc
import hashlib
import math
import time
import traceback
from typing import Callable

import torch

from evo.genome import Genome, GenomeError
from evo.records import BUILD_ERROR, INCORRECT, OK, RUNTIME_ERROR, SUSPECT, TIMEOUT, EvalResult
from evo.workloads import get_workload
from evo.workloads.base import CheckCase, DeviceInfo, Engine, MachineRates, Preset, Workload
from evaluators import device as devices
from evaluators.check import (EngineCallError, ForbiddenCall, GuardedEngine, SeedStream, check_engine,
                               forbid_calls, forbidden_targets)
from evaluators.settings import EvaluatorSettings
from evaluators.timing import measure_rates, num_threads, sync, time_engine

_TRACEBACK_CHARS = 4000


class Evaluator:
    """Builds, checks and times engines of one workload preset on the device this process owns."""

    def __init__(
        self,
        workload: str,
        preset: str,
        settings: EvaluatorSettings,
        seed: int,
        name: str = "evaluator-0",
        cores: tuple[int, ...] | None = None,
    ) -> None:
        self.workload: Workload = get_workload(workload)
        presets = self.workload.presets()
        if preset not in presets:
            raise ValueError(f"unknown preset {preset!r} for workload {workload!r}; available: {sorted(presets)}")
        self.preset: Preset = presets[preset]
        self.settings = settings
        self.name = name
        self.cores = tuple(cores) if cores is not None else None
        self.device = devices.select_device(self.preset)
        if self.cores is not None and self.device == "cpu":
            devices.pin_cores(self.cores)
        threads = len(self.cores) if self.cores else torch.get_num_threads()
        self._info = devices.device_info(self.device, threads)
        self._versions = devices.versions(self.device)
        self._tolerance = settings.tolerance(self.preset.dtype)  # a missing dtype is a config error: fail now
        self._seeds = SeedStream(seed, name)
        self._timing_case = _timing_case(self.workload, self.preset)
        self._forbidden = forbidden_targets(self.workload)
        self._rates: MachineRates | None = None  # measured on first need, then cached
        self._floor_ms: float | None = None

    # ----------------------------------------------------------------- public API
    def device_info(self) -> DeviceInfo:
        return self._info

    def describe(self) -> dict:
        return {
            "name": self.name,
            "workload": self.workload.name,
            "preset": self.preset.name,
            "device": self._device_label(),
            "threads": self._info.threads,
            "versions": dict(self._versions),
            "cores": list(self.cores) if self.cores is not None else None,
        }

    def evaluate(self, genome_json: str) -> EvalResult:
        """Build, check and time the engine a genome describes."""
        start = time.perf_counter()
        try:
            genome = Genome.from_json(genome_json)
        except GenomeError as exc:
            digest = "invalid:" + hashlib.sha256(genome_json.encode()).hexdigest()[:16]
            return self._result(digest, BUILD_ERROR, start, message=f"invalid genome: {exc}", error=_describe(exc))

        def build() -> Engine:
            space = self.workload.gene_space(self.preset, self._info)
            with forbid_calls(self._forbidden) as calls:
                engine = self.workload.build(space.validate(genome), self.preset, self._info)
            if calls:
                raise ForbiddenCall(f"build called {', '.join(sorted(set(calls)))}: engines must compute their"
                                    " answer, not call the workload's reference or a baseline")
            return engine

        return self._evaluate(genome.hash, build, start, guarded=True)

    def evaluate_baseline(self, baseline: str) -> EvalResult:
        """Build, check and time a named baseline exactly like a genome's engine."""
        start = time.perf_counter()
        builders = self.workload.baselines(self.preset)
        if baseline not in builders:
            raise ValueError(
                f"unknown baseline {baseline!r} for {self.workload.name}/{self.preset.name}; available: {sorted(builders)}"
            )
        return self._evaluate(f"baseline:{baseline}", lambda: builders[baseline](self._info), start)

    def measure_rates(self, again: bool = False) -> MachineRates:
        """The machine's ceilings (fp32 FLOP/s, copy bandwidth), measured on first need and cached.
        `again` measures once more and keeps the higher of each rate: ceilings read low when another
        process disturbs a measurement, and a low ceiling would make an honest engine look too fast."""
        if self._rates is None or again:
            rates = measure_rates(self.device, self._info.threads if self.device == "cpu" else None)
            if self._rates is not None:
                rates = MachineRates(max(rates.flops_per_s, self._rates.flops_per_s),
                                     max(rates.bytes_per_s, self._rates.bytes_per_s))
            self._rates, self._floor_ms = rates, None
        return self._rates

    def roofline_floor_ms(self) -> float:
        """The preset's roofline floor on this machine (nan if the workload cannot say), cached."""
        if self._floor_ms is None:
            try:
                self._floor_ms = float(self.workload.roofline(self.preset, self.measure_rates()).floor_ms)
            except Exception:  # a workload without a usable roofline: nothing is suspect
                self._floor_ms = math.nan
        return self._floor_ms

    # ----------------------------------------------------------------- one evaluation
    def _evaluate(self, genome_hash: str, build: Callable[[], Engine], start: float,
                  guarded: bool = False) -> EvalResult:
        engine = None
        try:
            with torch.no_grad():
                try:
                    engine = build()
                    threads = _engine_threads(engine)
                    if guarded:  # baselines may call what they like; genomes' engines may not
                        engine = GuardedEngine(engine, self._forbidden)
                except ForbiddenCall as exc:
                    return self._result(genome_hash, INCORRECT, start, message=str(exc),
                                        build_s=time.perf_counter() - start)
                except Exception as exc:
                    return self._result(genome_hash, BUILD_ERROR, start, message=_summary("build failed", exc),
                                        error=_describe(exc), build_s=time.perf_counter() - start)
                with num_threads(threads if self.device == "cpu" else None):
                    return self._run(genome_hash, engine, start, threads)
        finally:
            del engine
            gc.collect()
            if self.device != "cpu":
                torch.cuda.empty_cache()

    def _run(self, genome_hash: str, engine: Engine, start: float, threads: int | None) -> EvalResult:
        stamp = {"threads": threads or self._info.threads}
        timing_sets = [self._draw(self._timing_case) for _ in range(self.settings.input_sets)]
        try:
            engine(**timing_sets[0])  # first call at the preset shape: where lazy compilers compile
            sync(self.device)
        except ForbiddenCall as exc:
            return self._result(genome_hash, INCORRECT, start, message=f"first call: {exc}", **stamp)
        except Exception as exc:
            status = BUILD_ERROR if _is_compile_error(exc) else RUNTIME_ERROR
            return self._result(genome_hash, status, start, message=_summary("first call failed", exc),
                                error=_describe(exc), build_s=time.perf_counter() - start, **stamp)
        build_s = time.perf_counter() - start
        stamp["build_s"] = build_s
        if build_s > self.settings.build_timeout_s:
            return self._result(genome_hash, TIMEOUT, start, **stamp,
                                message=f"build + first call took {build_s:.1f} s > build_timeout_s {self.settings.build_timeout_s:g} s")
        try:
            report = check_engine(engine, self.workload, self.preset, self.workload.check_cases(self.preset),
                                  self._seeds, device=self.device, tolerance=self._tolerance,
                                  elementwise_factor=self.settings.elementwise_factor,
                                  settle_s=self.settings.settle_s, poison=self.settings.poison_memory)
        except EngineCallError as exc:
            cause = exc.__cause__ or exc
            return self._result(genome_hash, RUNTIME_ERROR, start, message=str(exc), error=_describe(cause), **stamp)
        stamp["max_rel_error"] = report.max_rel_error
        if not report.passed:
            return self._result(genome_hash, INCORRECT, start, message=report.message, **stamp)
        elapsed = time.perf_counter() - start
        if elapsed > self.settings.eval_timeout_s:
            return self._result(genome_hash, TIMEOUT, start, **stamp,
                                message=f"check took {elapsed:.1f} s > eval_timeout_s {self.settings.eval_timeout_s:g} s")
        try:
            timing = time_engine(engine, timing_sets, device=self.device, warmup=self.settings.warmup,
                                 repeats=self.settings.repeats, min_timing_s=self.settings.min_timing_s)
        except ForbiddenCall as exc:
            return self._result(genome_hash, INCORRECT, start, message=f"while timing: {exc}", **stamp)
        except Exception as exc:
            return self._result(genome_hash, RUNTIME_ERROR, start, message=_summary("failed while timing", exc),
                                error=_describe(exc), **stamp)
        if self._below_floor(timing.median_ms):
            return self._result(genome_hash, SUSPECT, start, latency_ms=timing.median_ms,
                                latency_spread_ms=timing.spread_ms, **stamp,
                                message=f"median latency {timing.median_ms:.4g} ms is below the roofline floor"
                                        f" {self.roofline_floor_ms():.4g} ms x margin {self.settings.roofline_margin:g}:"
                                        " faster than this machine allows (work deferred past the timer, a broken"
                                        " timer or a wrong roofline); never ranked")
        return self._result(genome_hash, OK, start, latency_ms=timing.median_ms, latency_spread_ms=timing.spread_ms,
                            message=f"{report.message}; {len(timing.samples_ms)} timed calls", **stamp)

    def _below_floor(self, latency_ms: float) -> bool:
        """Faster than margin x the floor, even after re-measuring the machine's rates (False for nan)."""
        if not latency_ms < self.roofline_floor_ms() * self.settings.roofline_margin:
            return False
        self.measure_rates(again=True)
        return latency_ms < self.roofline_floor_ms() * self.settings.roofline_margin

    def _draw(self, case: CheckCase) -> dict:
        return self.workload.make_inputs(case, self.preset.dtype, self.device, self._seeds.next())

    def _result(self, genome_hash: str, status: str, start: float, **fields) -> EvalResult:
        fields.setdefault("threads", self._info.threads)
        fields.setdefault("roofline_floor_ms", self.roofline_floor_ms())
        return EvalResult(
            genome_hash=genome_hash,
            status=status,
            eval_s=time.perf_counter() - start,
            device=self._device_label(),
            versions=dict(self._versions),
            evaluator=self.name,
            **fields,
        )

    def _device_label(self) -> str:
        return f"{self._info.kind}:{self._info.name}"


def _timing_case(workload: Workload, preset: Preset) -> CheckCase:
    """The case timed: the workload's `timing_case(preset)` if it has one, else a check case at the
    preset shape, else the first check case's distribution at the preset shape."""
    custom = getattr(workload, "timing_case", None)
    if callable(custom):
        return custom(preset)
    cases = [c for stage in workload.check_cases(preset) for c in stage]
    if not cases:
        raise ValueError(f"workload {workload.name!r} has no check cases for preset {preset.name!r}")
    for case in cases:
        if dict(case.shape) == dict(preset.shape):
            return case
    return CheckCase(name=f"preset:{preset.name}", shape=dict(preset.shape), distribution=cases[0].distribution)


def _engine_threads(engine: Engine) -> int | None:
    threads = getattr(engine, "num_threads", None)
    if threads is None:
        return None
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"engine.num_threads must be a positive int or None, got {threads!r}")
    return threads


def _is_compile_error(exc: BaseException) -> bool:
    module = type(exc).__module__ or ""
    return module.startswith(("torch._dynamo", "torch._inductor"))


def _summary(what: str, exc: BaseException) -> str:
    kind = "out of memory" if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) else type(exc).__name__
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{what}: {kind}: {text}"[:500]


def _describe(exc: BaseException) -> str:
    """Type, message and the last frames of the traceback, capped."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-8))
    return text[-_TRACEBACK_CHARS:]
