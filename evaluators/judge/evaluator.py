"""The plain evaluator (the judge): genome JSON in, exactly one `EvalResult` out. The Ray pool wraps
this class with `ray.remote`; tests call it directly.

The judge never runs an engine in its own process. Each candidate's engine is built and called in a
fresh process of its own (`evaluators.sandbox.process`); the judge draws every input, computes the float64
reference, compares outputs and owns the clock, so an engine that patches timers, comparisons, the
reference or anything else only patches its own process, which dies with the candidate.

One evaluation:
1. parse and validate the genome (here); start the engine's process and build the engine there;
2. the first call, at the preset shape (where lazy compilers compile: `build_s` covers both);
3. every check case of the workload's cascade and every timed call, in one order shuffled per
   evaluation (a timed call's latency is the judge's wall time around it, less, with
   `subtract_call_overhead`, the judge's own cost of a call measured with echo calls before the build): the same call site, the same process state and the same shapes, so nothing inside the
   engine can tell a check from a timed call. EVERY call gets freshly drawn inputs and is checked
   against the reference (outputs, inputs unchanged, output types and memory), timed calls included;
   the first `warmup` calls at the timing shape are not timed; a device that throttled meanwhile
   (heat or power, `evaluators.machine.telemetry`) gets the timed calls run once more, and the result says so;
4. a median below the roofline floor re-measures the machine and re-verifies the engine on fresh
   inputs; still below it, the result is `suspect` (never ranked).
Engine faults become statuses with a message; only configuration and programming errors raise.
"""
from __future__ import annotations

import gc
import hashlib
import math
import secrets
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch

from evo.core.code import CodeError, check_sources, code_hash
from evo.core.genome import Genome, GenomeError
from evo.core.records import BUILD_ERROR, INCORRECT, OK, RUNTIME_ERROR, SUSPECT, TIMEOUT, EvalResult
from evo.core.retiming import PairedTiming
from evo.core.seeds import derive_seed
from evo.workloads import get_workload
from evo.workloads.base import CheckCase, DeviceInfo, MachineRates, Preset, Workload
from evaluators.judge.calibration import RUN, Calibration, machine_key, remember
from evaluators.judge.check import compare_outputs, expected_dtypes, worse
from evaluators.judge.generation import GenerationJudge
from evaluators.judge.timing import Timing, num_threads, probe_rates, summarize
from evaluators.machine import device as devices
from evaluators.machine import telemetry
from evaluators.sandbox import jail
from evaluators.sandbox.arena import ArenaPool
from evaluators.sandbox.guard import hidden_paths
from evaluators.sandbox.process import CallResult, EngineProcess, EngineProcessError, workload_modules
from evaluators.sandbox.zygote import Zygote
from evaluators.settings import EvaluatorSettings

_SPEC_CACHE_SIZE = 256  # output specs kept for cases of distinct shapes
# After an evaluation the judge collects the young generations (0 and 1) only; older garbage is left to Python's own
# collector. Engines run in their own processes, so nothing of theirs is here. A full collection walks every object of
# the process: ~0.15 s in an evaluator actor, ~0.7 s or more in one that imported transformers (a test session).
_YOUNG = 1
_CALIBRATION_CALLS = 5  # echo calls that measure the judge's own cost of a call, before the engine is built
_FORBIDDEN_ADVICE = "engines must compute their answer, not call the workload's reference or a baseline"


@dataclass(frozen=True)
class _Call:
    """One planned call: the case its inputs are drawn from, and whether its latency may count."""

    case: CheckCase
    timing: bool  # at the timing shape, one of the warm-up + timed calls
    where: str


@dataclass(frozen=True)
class _Built:
    """A built engine: the result's stamp (`threads`, `build_s`), when its build's clock started, and the
    deadlines of its build (plus first call) and of the whole evaluation (perf_counter seconds)."""

    stamp: dict
    launched: float
    build_deadline: float
    deadline: float


@dataclass(frozen=True)
class _Verdict:
    """What one checked call showed: a failure (status + message) or a pass with its latency."""

    status: str | None  # None: passed
    message: str = ""
    error: str = ""
    elapsed_ms: float = math.nan
    rel_error: float = math.nan


class OsSeeds:
    """Input seeds from the OS's randomness (63 bits: torch and numpy accept them), never repeated."""

    def __init__(self) -> None:
        self._used: set[int] = set()

    def next(self) -> int:
        while (seed := secrets.randbits(63)) in self._used:
            pass
        self._used.add(seed)
        return seed


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
        sampler: telemetry.Sampler | None = None,
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
        self._arenas = ArenaPool(self.device)  # the judge's shared arenas, lent to each engine process, freed at close()
        if self.cores is not None and self.device == "cpu":
            devices.pin_cores(self.cores)
        threads = len(self.cores) if self.cores else torch.get_num_threads()
        self._info = devices.device_info(self.device, threads)
        self._versions = devices.versions(self.device)
        self._tolerance = settings.tolerance(self.preset.dtype)  # a missing dtype is a config error: fail now
        self._dtypes = expected_dtypes(self.workload, self.preset)
        # Every call's inputs come from a seed drawn from the OS's randomness: no stream to replay.
        self._seeds = OsSeeds()
        if settings.sandbox == "strict" and (why := jail.unavailable()):
            raise ValueError(f"evaluator setting sandbox='strict' cannot confine engines on this machine: {why}."
                             " Set `evaluator: {sandbox: none}` in the config to judge trusted engines unconfined")
        self._versions["sandbox"] = settings.sandbox  # in every result's versions
        # what the engine's process loads before its jail: the workload's modules, what its engines use, and
        # what poisoned memory needs (deterministic mode imports torch._dynamo)
        self._preload = (*workload_modules(self.workload), *self.workload.engine_preload,
                         *(("torch._dynamo",) if settings.poison_memory else ()))
        self.generation: GenerationJudge | None = None  # the judge of a generation workload (requests in, tokens out)
        if self.workload.contract == "generation":
            self.preset = self.workload.with_trace(self.preset, settings.trace)  # the run's trace, within the bounds
            self.generation = GenerationJudge(self)
        self._timing_case = None if self.generation else self.workload.timing_case(self.preset)
        self._rates: MachineRates | None = None  # the driver's (use_rates), or measured on first need; then kept
        self._rates_source = ""  # evaluators.judge.calibration: MEASURED, CACHED or RUN
        self._rates_key = machine_key(self._info, self.preset.dtype)
        self._floor_ms: float | None = None
        self._spec_cache: dict[tuple, dict] = {}
        self._seen: dict[tuple, str] = {}  # fingerprints of this evaluation's outputs -> the call that returned them
        self._telemetry_start: dict = {}  # the machine as the current evaluation started (evaluators.machine.telemetry)
        self._retimed_after_throttle = False  # this evaluation's calls were timed again: the device throttled
        self.sampler = sampler or telemetry.MachineSampler()  # tests pass one of their own (a throttle)
        self._paired_seed, self._retimings = derive_seed(seed, f"{name}:paired"), 0  # paired call orders
        Zygote.shared(self._preload)  # starts now (imports torch there), ready by the first evaluation

    # ----------------------------------------------------------------- public API
    def close(self) -> None:
        """Free the judge's shared arenas (call once no engine process of this evaluator is alive)."""
        self._arenas.close()

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

    def evaluate(self, genome_json: str, sources: Mapping[str, str] | None = None,
                 screen: Mapping[str, int] | None = None) -> EvalResult:
        """Build, check and time the engine a genome describes. `sources` maps code hash -> source for the
        genome's code genes (`evo.core.code`): checked here (compiled, never run), run only in the engine's process.
        `screen` ({count, replays}, `evo.core.fidelity.ScreenSettings.to_evaluator`): a generation engine's
        screening evaluation, the whole check replay and then shorter timed replays (its result's fidelity
        "screen"); None: full fidelity."""
        if screen is not None and self.generation is None:
            raise ValueError("screen applies to generation workloads only (a call workload's timing case is fixed)")
        start = time.perf_counter()
        try:
            genome = Genome.from_json(genome_json)
        except GenomeError as exc:
            digest = "invalid:" + hashlib.sha256(genome_json.encode()).hexdigest()[:16]
            return self._result(digest, BUILD_ERROR, start, message=f"invalid genome: {exc}", error=f"GenomeError: {exc}")
        try:
            self.workload.gene_space(self.preset, self._info).validate(genome)
        except GenomeError as exc:
            return self._result(genome.hash, BUILD_ERROR, start, message=f"invalid genome: {exc}",
                                error=f"GenomeError: {exc}")
        try:
            code = self._code(genome, sources or {})
        except CodeError as exc:
            return self._result(genome.hash, BUILD_ERROR, start, message=f"invalid engine code: {exc}",
                                error=f"CodeError: {exc}")
        return self._evaluate(genome.hash, start, {"genome_json": genome.to_json(), "guarded": True, "sources": code},
                              screen)

    def _code(self, genome: Genome, sources: Mapping[str, str]) -> dict[str, str]:
        """{hash: source} of the genome's code genes, each present, matching its hash and checked."""
        chosen = check_sources(genome.values(), sources, self.workload.open_stages(self.preset, self._info))
        return {code_hash(source): source for source in chosen.values()}

    def evaluate_baseline(self, baseline: str) -> EvalResult:
        """Build, check and time a named baseline exactly like a genome's engine (baselines may call
        the reference; nothing else differs)."""
        start = time.perf_counter()
        builders = self.workload.baselines(self.preset)
        if baseline not in builders:
            raise ValueError(
                f"unknown baseline {baseline!r} for {self.workload.name}/{self.preset.name}; available: {sorted(builders)}"
            )
        return self._evaluate(f"baseline:{baseline}", start, {"baseline": baseline, "guarded": False})

    def measure_rates(self, again: bool = False) -> MachineRates:
        """The machine's ceilings for the preset's arithmetic (matmul FLOP/s per dtype, copy bandwidth):
        the driver's run-wide rates (`use_rates`), else measured in this process, which never runs an
        engine, on first need and kept. A measurement is the best of short probes and never below this
        machine's cached calibration, which it raises when it beats it (evaluators.judge.calibration). `again`
        measures once more and keeps the higher of each rate: ceilings read low when another process
        disturbs a measurement, and a low ceiling would make an honest engine look too fast."""
        if self._rates is None or again:
            Zygote.shared(self._preload).wait_ready()  # it shares these cores while it starts
            found = remember(self._rates_key, probe_rates(self.device, self.preset.dtype,
                                                          self._info.threads if self.device == "cpu" else None))
            rates = found.rates if self._rates is None else found.rates.merged_max(self._rates)
            if rates != self._rates:
                self._rates, self._floor_ms, self._rates_source = rates, None, found.source
        return self._rates

    def calibration(self) -> Calibration:
        """The rates the floor uses and where they came from (measured now, the machine's cache, the run)."""
        return Calibration(self.measure_rates(), self._rates_source, self._rates_key)

    def use_rates(self, rates: MachineRates) -> None:
        """Judge with the run's rates (the driver hands every evaluator the same: one floor per run, the
        one the summary shows). A re-measurement below the floor (`_below_floor`) only raises them."""
        self._rates, self._floor_ms, self._rates_source = rates, None, RUN

    def roofline_floor_ms(self) -> float:
        """The preset's roofline floor on this machine (nan if the workload cannot say), cached."""
        if self._floor_ms is None:
            try:
                self._floor_ms = float(self.workload.roofline(self.preset, self.measure_rates()).floor_ms)
            except Exception:  # a workload without a usable roofline: nothing is suspect
                self._floor_ms = math.nan
        return self._floor_ms

    # ----------------------------------------------------------------- one evaluation
    def _evaluate(self, genome_hash: str, start: float, engine: dict,
                  screen: Mapping[str, int] | None = None) -> EvalResult:
        self.roofline_floor_ms()  # the ceilings are measured before any engine runs
        self._seen = {}
        self._telemetry_start, self._retimed_after_throttle = self.sampler.sample(self.device), False
        try:
            # The judge's own work (drawing inputs, the reference) runs on one thread, so no idle worker
            # thread of its pool spins on the engine's cores while a call is timed.
            process = self.engine_process(guarded=bool(engine.get("guarded")))
            with num_threads(1):
                try:
                    process.launch(preload=self._preload)
                    result = self._judge(process, genome_hash, start, engine, screen)
                except EngineProcessError as exc:
                    result = self._failed(genome_hash, start, exc, "sandbox", self._limit(genome_hash, build=True))
                finally:
                    process.close()
            if process.survivors:  # the PID namespace and the cgroup make this impossible: say so loudly
                result = replace(result, status=INCORRECT, latency_ms=math.nan,
                                 message=f"processes {list(process.survivors)} of this candidate outlived it"
                                         f" (killed): {result.message}")
            return result
        finally:
            gc.collect(_YOUNG)
            if self.device != "cpu":
                torch.cuda.empty_cache()

    def _judge(self, process: EngineProcess, genome_hash: str, start: float, engine: dict,
               screen: Mapping[str, int] | None = None) -> EvalResult:
        if self.generation is not None:
            return self.generation.judge(process, genome_hash, start, engine, screen)
        settings = self.settings
        null_ms = 0.0
        try:
            process.configure(self.workload, self.preset, self._info, **engine)
            if settings.subtract_call_overhead:
                null_ms = 1e3 * process.calibrate(self._draw(self._timing_case), self._specs(self._timing_case),
                                                  repeats=_CALIBRATION_CALLS)
        except EngineProcessError as exc:
            return self._failed(genome_hash, start, exc, "calibration", self._limit(genome_hash, build=True))
        built, failed_build = self.built(process, genome_hash, start, engine, configure=False)
        if failed_build is not None:
            return failed_build
        stamp, launched, deadline = built.stamp, built.launched, built.deadline

        try:
            first = self._checked(process, _Call(self._timing_case, False, "first call at the preset shape"),
                                  min(built.build_deadline, deadline), first=True)
        except EngineProcessError as exc:
            return self._failed(genome_hash, start, exc, "build + first call", self._limit(genome_hash, build=True),
                                **{**stamp, "build_s": time.perf_counter() - launched})
        stamp["build_s"] = time.perf_counter() - launched
        if first.status is not None:
            return self._result(genome_hash, first.status, start, message=first.message, error=first.error,
                                max_rel_error=first.rel_error, **stamp)

        rng = np.random.default_rng(self._seeds.next())
        plan = self._plan(rng)
        worst = first.rel_error
        try:
            verdicts, timing = self._run_plan(process, plan, deadline, null_ms)
        except EngineProcessError as exc:
            return self._failed(genome_hash, start, exc, "evaluation", self._limit(genome_hash), **stamp)
        for verdict in verdicts:
            worst = worse(worst, verdict.rel_error)
        stamp["max_rel_error"] = worst
        failed = next((v for v in verdicts if v.status is not None), None)
        if failed is not None:
            return self._result(genome_hash, failed.status, start, message=failed.message, error=failed.error, **stamp)
        assert timing is not None
        note = f"passed {len(verdicts) + 1} checked calls (every timed call checked; tol {self._tolerance:.1e})"
        if telemetry.throttled(self._stamp()):  # the device held its clocks down: time the calls once more
            self._telemetry_start, self._retimed_after_throttle = self.sampler.sample(self.device), True
            timing, failed_result = self._time_again(genome_hash, start, process, rng, deadline, null_ms, stamp,
                                                     "re-timing after a throttle")
            if failed_result is not None:
                return failed_result
            note += "; timed again: the device throttled during the first timing"

        if self._below_floor(timing.median_ms):
            first_median = timing.median_ms
            timing, failed_result = self._time_again(genome_hash, start, process, rng, deadline, null_ms, stamp,
                                                     "re-verification")
            if failed_result is not None:
                return failed_result
            if self._below_floor(timing.median_ms):
                return self._result(genome_hash, SUSPECT, start, latency_ms=timing.median_ms,
                                    latency_spread_ms=timing.spread_ms, **stamp,
                                    message=f"median latency {timing.median_ms:.4g} ms (first {first_median:.4g} ms,"
                                            f" re-verified on fresh inputs) is below the roofline floor"
                                            f" {self.roofline_floor_ms():.4g} ms x margin {settings.roofline_margin:g}:"
                                            " faster than this machine allows (work deferred past the timer, a broken"
                                            " timer or a wrong roofline); never ranked")
            note += f"; re-verified on fresh inputs after a first median of {first_median:.4g} ms below the floor"
        return self._result(genome_hash, OK, start, latency_ms=timing.median_ms, latency_spread_ms=timing.spread_ms,
                            message=f"{note}; {len(timing.samples_ms)} timed calls", **stamp)

    def built(self, process: EngineProcess, genome_hash: str, start: float, engine: dict, contract: str = "call",
              configure: bool = True) -> tuple[_Built | None, EvalResult | None]:
        """Configure (unless done) and build the engine in its launched process: (what the build gave, None),
        or (None, the failed result)."""
        if configure:
            try:
                process.configure(self.workload, self.preset, self._info, contract=contract, **engine)
            except EngineProcessError as exc:
                return None, self._failed(genome_hash, start, exc, "configuration", self._limit(genome_hash, True))
        launched = time.perf_counter()  # the build's clock starts once the engine's process is ready
        (_, build_limit_s), (_, whole_s) = self.settings.budgets(baseline=engine.get("baseline") is not None)
        build_deadline, deadline = launched + build_limit_s, launched + whole_s
        try:
            built = process.build(timeout_s=build_deadline - time.perf_counter())
        except EngineProcessError as exc:
            return None, self._failed(genome_hash, start, exc, "build", self._limit(genome_hash, build=True),
                                      build_s=time.perf_counter() - launched)
        if built["forbidden_calls"] or built.get("forbidden"):
            calls = ", ".join(sorted(set(built["forbidden_calls"]))) or built.get("message", "")
            return None, self._result(genome_hash, INCORRECT, start, build_s=time.perf_counter() - launched,
                                      message=f"build called {calls}: {_FORBIDDEN_ADVICE}")
        if built.get("op") != "built":
            return None, self._result(genome_hash, BUILD_ERROR, start, build_s=time.perf_counter() - launched,
                                      message=_summary("build failed", built), error=str(built.get("traceback", "")))
        stamp = {"threads": int(built.get("threads") or self._info.threads), "build_s": time.perf_counter() - launched}
        return _Built(stamp, launched, build_deadline, deadline), None

    def _plan(self, rng: np.random.Generator, checks: bool = True, timed: bool = True) -> list[_Call]:
        """Every check case, the cases drawn over the workload's domain for this evaluation (from `rng`)
        and the warm-up + timed calls, shuffled; the first `warmup` calls at the timing shape in the
        shuffled order are the warm-up."""
        cases = [case for stage in self.workload.check_cases(self.preset) for case in stage] if checks else []
        drawn = self._drawn_cases(rng) if checks else []
        calls = [_Call(case, False, f"check case {case.name!r}") for case in cases]
        calls += [_Call(case, False, f"drawn case {case.name!r} {_shape_text(case)}") for case in drawn]
        if timed:
            calls += [_Call(self._timing_case, True, "") for _ in range(self.settings.warmup + self.settings.repeats)]
        order = rng.permutation(len(calls))
        return [calls[i] for i in order]

    def _run_plan(self, process: EngineProcess, plan: list[_Call], deadline: float, null_ms: float
                  ) -> tuple[list[_Verdict], Timing | None]:
        """Run the plan (stop at the first failing call); the verdicts and the timing of the timed calls
        (each call's wall time less `null_ms`, the judge's cost of a call without an engine).

        On the CPU a call's outputs are compared only once the next call is not a timed one (every call is
        still checked, in plan order): a float64 reference computed right before a timed call would evict
        the engine's working set from the caches the calls share and make the engine look slower than it
        runs; before an untimed check call it costs nothing, and a wrong engine stops at once."""
        on_cpu = self.device == "cpu"
        verdicts: list[_Verdict] = []
        pending: list[tuple[_Call, dict, CallResult]] = []
        samples: list[float] = []
        timing_calls = 0
        extra = 0
        queue = list(plan)
        total_s = 0.0
        while queue:
            call = queue.pop(0)
            if call.timing:
                timing_calls += 1
                warm = timing_calls <= self.settings.warmup
                call = _Call(call.case, True, f"{'warm-up' if warm else 'timed'} call {timing_calls} ({call.case.name})")
            inputs, result, failure = self._call(process, call, deadline)
            if failure is None and on_cpu and queue and queue[0].timing:
                pending.append((call, inputs, result))
                verdict = _Verdict(None, elapsed_ms=result.elapsed_s * 1e3)
            else:
                verdicts += self._compare_all(pending)
                pending = []
                if verdicts and verdicts[-1].status is not None:
                    return verdicts, None
                verdict = failure or self._compare(call, inputs, result)
                verdicts.append(verdict)
                if verdict.status is not None:
                    return verdicts, None
            if call.timing and timing_calls > self.settings.warmup:
                samples.append(max(verdict.elapsed_ms - null_ms, 0.0))
                total_s += verdict.elapsed_ms / 1e3
            min_s = self.settings.min_timing_s
            if not queue and min_s is not None and total_s < min_s and extra < 10_000:
                extra += 1
                queue.append(_Call(self._timing_case, True, ""))
        verdicts += self._compare_all(pending)
        if verdicts and verdicts[-1].status is not None:
            return verdicts, None
        return verdicts, summarize(samples) if samples else None

    def _compare_all(self, pending: list[tuple[_Call, dict, CallResult]]) -> list[_Verdict]:
        """Verdicts of deferred calls, in order, up to and including the first failing one."""
        verdicts = []
        for call, inputs, result in pending:
            verdicts.append(self._compare(call, inputs, result))
            if verdicts[-1].status is not None:
                break
        return verdicts

    def _checked(self, process: EngineProcess, call: _Call, deadline: float, first: bool = False) -> _Verdict:
        """One call on fresh inputs, checked against the reference at once. Raises EngineProcessError."""
        inputs, result, failure = self._call(process, call, deadline, first)
        return failure or self._compare(call, inputs, result)

    def _call(self, process: EngineProcess, call: _Call, deadline: float, first: bool = False
              ) -> tuple[dict, CallResult, _Verdict | None]:
        """One call on fresh inputs: (inputs, what the judge saw, a failure found without the reference
        or None). Raises EngineProcessError."""
        inputs = self._draw(call.case)
        result, failure = self._send(process, inputs, self._specs(call.case), call.where, deadline, first)
        return inputs, result, failure

    def _send(self, process: EngineProcess, inputs: dict, specs: dict, where: str, deadline: float,
              first: bool = False) -> tuple[CallResult, _Verdict | None]:
        """One call on `inputs`: (what the judge saw, a failure found without the reference or None).
        Raises EngineProcessError."""
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            raise EngineProcessError("timeout", "the evaluation ran out of time before " + where)
        result = process.call(inputs, specs, timeout_s=remaining)
        reply = result.reply
        if result.forbidden or reply.get("forbidden"):
            calls = ", ".join(sorted(set(result.forbidden))) or "a forbidden function"
            return result, _Verdict(INCORRECT, f"{where}: engine called {calls}: {_FORBIDDEN_ADVICE}")
        if reply.get("op") == "raised":
            if first:
                status = BUILD_ERROR if reply.get("compile_error") else RUNTIME_ERROR
                return result, _Verdict(status, _summary("first call failed", reply),
                                        str(reply.get("traceback", "")))
            kind = "out of memory" if reply.get("oom") else reply.get("type", "an error")
            text = str(reply.get("message", "")).strip().splitlines()
            return result, _Verdict(RUNTIME_ERROR, f"engine raised {kind} on {where}: {text[0] if text else ''}"[:500],
                                    str(reply.get("traceback", "")))
        if reply.get("op") != "returned":
            return result, _Verdict(INCORRECT, f"{where}: engine process answered"
                                              f" {str(reply.get('op'))[:40]!r}, not a result")
        if result.inputs_changed:
            return result, _Verdict(INCORRECT, f"{where}: engine modified its inputs in place:"
                                              f" {list(result.inputs_changed)}")
        if reply.get("problem"):
            return result, _Verdict(INCORRECT, f"{where}: {str(reply['problem'])[:500]}")
        if result.late:
            return result, _Verdict(INCORRECT, f"{where}: outputs {list(result.late)} changed after the engine"
                                              " returned (work deferred past return, e.g. a kernel or thread"
                                              " still writing)")
        return result, None

    def _compare(self, call: _Call, inputs: dict, result: CallResult) -> _Verdict:
        """The call's outputs against the float64 reference of its inputs."""
        reference, scales = self.workload.reference_and_scales(self.preset, inputs)
        problem, rel = compare_outputs(result.outputs, reference, self._dtypes, self._tolerance,
                                       self.settings.elementwise_factor, scales)
        fingerprint = _fingerprint(result.outputs)
        if problem:
            if fingerprint in self._seen:
                problem = (f"returned exactly the outputs of an earlier call ({self._seen[fingerprint]}) on different"
                           f" inputs (cached or stale result): {problem}")
            return _Verdict(INCORRECT, f"{call.where}: {problem}", rel_error=rel)
        self._seen.setdefault(fingerprint, call.where)
        return _Verdict(None, elapsed_ms=result.elapsed_s * 1e3, rel_error=rel)

    def _draw(self, case: CheckCase) -> dict:
        return self.workload.make_inputs(case, self.preset.dtype, self.device, self._seeds.next())

    def _drawn_cases(self, rng: np.random.Generator) -> list[CheckCase]:
        """This evaluation's random cases over the workload's domain; one outside it is a workload bug."""
        domain = self.workload.domain(self.preset)
        drawn = list(self.workload.draw_cases(self.preset, rng))
        for case in drawn:
            outside = domain.outside(case.shape, self.preset.shape)
            if outside:
                raise ValueError(f"workload {self.workload.name!r} drew case {case.name!r} outside its own domain:"
                                 f" {outside}")
        return drawn

    def _specs(self, case: CheckCase) -> dict[str, tuple[tuple[int, ...], str]]:
        """The (shape, dtype) of each output for `case`: as the workload declares them, else from the
        reference of one draw, cached (a bounded cache: drawn cases come in ever new shapes)."""
        declared = self.workload.output_shapes(case)
        if declared is not None:
            return {n: (tuple(declared[n]), d) for n, d in self._dtypes.items()}
        key = _case_key(case)
        if key not in self._spec_cache:
            if len(self._spec_cache) >= _SPEC_CACHE_SIZE:
                self._spec_cache.clear()
            reference = self.workload.reference_for(self.preset, self._draw(case))
            self._spec_cache[key] = {n: (tuple(reference[n].shape), d) for n, d in self._dtypes.items()}
        return self._spec_cache[key]

    def result(self, genome_hash: str, status: str, start: float, **fields) -> EvalResult:
        """A result of this evaluator (device, versions, telemetry, floor stamped), for the generation judge."""
        return self._result(genome_hash, status, start, **fields)

    def below_floor(self, latency_ms: float) -> bool:
        return self._below_floor(latency_ms)

    def next_seed(self) -> int:
        """A fresh seed from the OS's randomness (never repeated): every draw of inputs or prompts."""
        return self._seeds.next()

    @property
    def preload(self) -> tuple:
        """What an engine's process loads before its jail."""
        return self._preload

    def _below_floor(self, latency_ms: float) -> bool:
        """Faster than margin x the floor, even after re-measuring the machine's rates (False for nan)."""
        if not latency_ms < self.roofline_floor_ms() * self.settings.roofline_margin:
            return False
        self.measure_rates(again=True)
        return latency_ms < self.roofline_floor_ms() * self.settings.roofline_margin

    def _limit(self, genome_hash: str, build: bool = False) -> tuple[str, float]:
        """The deadline that applies: the whole evaluation's, or during the build the sooner of both (a
        baseline's, `baseline:NAME`, are its own: `EvaluatorSettings.budgets`)."""
        build_limit, whole = self.settings.budgets(baseline=genome_hash.startswith("baseline:"))
        return build_limit if build and build_limit[1] <= whole[1] else whole

    def _failed(self, genome_hash: str, start: float, exc: EngineProcessError, what: str,
                limit: tuple[str, float], **stamp: object) -> EvalResult:
        """An engine process that hung, died or broke the protocol, as a result."""
        if exc.kind == "timeout":
            return self._result(genome_hash, TIMEOUT, start, **stamp,
                                message=f"{what} took longer than {limit[0]} {limit[1]:g} s: {exc}")
        if exc.kind == "protocol":
            return self._result(genome_hash, INCORRECT, start, **stamp, message=f"{what}: {exc}")
        return self._result(genome_hash, RUNTIME_ERROR, start, **stamp, message=f"{what} failed: {exc}",
                            error=str(exc))

    def _result(self, genome_hash: str, status: str, start: float, **fields) -> EvalResult:
        fields.setdefault("threads", self._info.threads)
        fields.setdefault("roofline_floor_ms", self.roofline_floor_ms())
        return EvalResult(
            genome_hash=genome_hash,
            status=status,
            eval_s=time.perf_counter() - start,
            device=self._device_label(),
            versions={**self._versions, **telemetry.as_versions(self._stamp())},
            evaluator=self.name,
            **fields,
        )

    def _time_again(self, genome_hash: str, start: float, process: EngineProcess, rng: np.random.Generator,
                    deadline: float, null_ms: float, stamp: dict, what: str) -> tuple[Timing | None, EvalResult | None]:
        """The timed calls once more, each still checked: (their timing, None), or (None, the failed
        result, its message led by `what`)."""
        try:
            again, timing = self._run_plan(process, self._plan(rng, checks=False), deadline, null_ms)
        except EngineProcessError as exc:
            return None, self._failed(genome_hash, start, exc, what, self._limit(genome_hash), **stamp)
        failed = next((v for v in again if v.status is not None), None)
        if failed is not None:
            return None, self._result(genome_hash, failed.status, start, message=f"{what}: {failed.message}",
                                      error=failed.error, **stamp)
        return timing, None

    def _device_label(self) -> str:
        return f"{self._info.kind}:{self._info.name}"

    def _stamp(self) -> dict:
        """The machine from the evaluation's start (or its re-timing's) to now (`evaluators.machine.telemetry`)."""
        stamp = telemetry.around(self._telemetry_start, self.sampler.sample(self.device))
        return {**stamp, "retimed_after_throttle": True} if self._retimed_after_throttle else stamp

    # ================================================================= held engines: paired re-timing
    # The pieces `evaluators.judge.paired` times several engines with, interleaved call by call: the same build,
    # first call, call checks and clock as an evaluation, with each engine's process kept open.
    def compare(self, a: str, b: str, *, calls: int = 16, warmup: int = 2, min_effect: float = 0.02,
                sources: Mapping[str, str] | None = None, reason: str = "ab", generation: int = -1) -> PairedTiming:
        """Engine `a` against engine `b`, paired (`evaluators.judge.paired`): each is genome JSON, `default` (the
        gene space's default genome), `baseline:NAME` or a baseline's name. Ratio = a's latency / b's."""
        return self.retime([a, b], calls=calls, warmup=warmup, min_effect=min_effect, sources=sources,
                           reason=reason, generation=generation)[0]

    def retime(self, engines: Sequence[str], *, calls: int = 16, warmup: int = 2, min_effect: float = 0.02,
               sources: Mapping[str, str] | None = None, reason: str = "ab", generation: int = -1) -> list[PairedTiming]:
        """The first engine against each of the others, all timed in one interleaved run (see `compare`)."""
        from evaluators.judge.paired import retime  # the module builds on this class's pieces below

        rng = np.random.default_rng([self._paired_seed, self._retimings])  # the call orders: seeded, by count
        self._retimings += 1
        return retime(self, list(engines), rng, calls=calls, warmup=warmup, min_effect=min_effect,
                      sources=dict(sources or {}), reason=reason, generation=generation)

    def resolve(self, engine: str, sources: Mapping[str, str] | None = None) -> tuple[str, dict]:
        """(label, what the engine's process builds) for genome JSON, `default`, `baseline:NAME` or a
        baseline's name; ValueError naming what is wrong and what is accepted."""
        baselines = self.workload.baselines(self.preset)
        text = engine.strip()
        if text == "default":
            text = self.workload.gene_space(self.preset, self._info).default().to_json()
        if not text.startswith("{"):
            name = text.removeprefix("baseline:")
            if name not in baselines:
                raise ValueError(f"unknown engine {engine!r}: give genome JSON, 'default', or a baseline of "
                                 f"{self.workload.name}/{self.preset.name}: {sorted(baselines)}")
            return f"baseline:{name}", {"baseline": name, "guarded": False}
        try:
            space = self.workload.gene_space(self.preset, self._info)
            genome = space.validate(space.completed(Genome.from_json(text)))  # stored before genes were added
            code = self._code(genome, sources or {})
        except (GenomeError, CodeError) as exc:
            raise ValueError(f"invalid genome: {exc}") from exc
        return genome.hash, {"genome_json": genome.to_json(), "guarded": True, "sources": code}

    @contextmanager
    def holding(self) -> Iterator[ExitStack]:
        """The judge's state for engines kept open: one thread for its own work, fresh output fingerprints;
        engine processes entered on the stack yielded are killed on leaving."""
        self._seen = {}
        try:
            with num_threads(1), ExitStack() as stack:
                yield stack
        finally:
            gc.collect(_YOUNG)
            if self.device != "cpu":
                torch.cuda.empty_cache()

    def engine_process(self, guarded: bool = True) -> EngineProcess:
        """An engine process with this evaluator's settings and sandbox, not launched yet (`hold` launches
        it); `guarded` (a genome's engine, not a baseline): its view leaves out the reference's files."""
        return EngineProcess(self.device, threads=self._info.threads, settle_s=self.settings.settle_s,
                             poison=self.settings.poison_memory,
                             memory_bytes=int(self.settings.engine_memory_gb * 2**30),
                             network=self.settings.engine_network, sandbox=self.settings.sandbox,
                             hidden=hidden_paths(self.workload) if guarded else (), trusted=not guarded,
                             readable=self.workload.engine_files(self.preset), arena_pool=self._arenas)

    def hold(self, process: EngineProcess, engine: dict, deadline: float) -> tuple[str | None, float]:
        """Launch `process`, build `engine` there and check its first call: (why it failed, or None;
        the judge's cost of a call to subtract from its timed calls, ms)."""
        if self.generation is not None:
            return self.generation.hold(process, engine, deadline)
        null_ms = 0.0
        try:
            process.launch(preload=self._preload)
            process.configure(self.workload, self.preset, self._info, **engine)
            if self.settings.subtract_call_overhead:
                null_ms = 1e3 * process.calibrate(self._draw(self._timing_case), self._specs(self._timing_case),
                                                  repeats=_CALIBRATION_CALLS)
            (_, build_limit_s), _ = self.settings.budgets(baseline=engine.get("baseline") is not None)
            built = process.build(timeout_s=min(build_limit_s, deadline - time.perf_counter()))
            if built["forbidden_calls"] or built.get("forbidden"):
                return f"build called {', '.join(sorted(set(built['forbidden_calls'])))}: {_FORBIDDEN_ADVICE}", null_ms
            if built.get("op") != "built":
                return _summary("build failed", built), null_ms
            first = self._checked(process, _Call(self._timing_case, False, "first call at the preset shape"),
                                  deadline, first=True)
        except EngineProcessError as exc:
            return f"{exc.kind}: {exc}", null_ms
        return (None if first.status is None else f"{first.status}: {first.message}"), null_ms

    def timed_call(self, process: EngineProcess, where: str, deadline: float, null_ms: float = 0.0
                   ) -> tuple[float, str | None, tuple]:
        """One call at the timing shape on fresh inputs: (latency ms, a failure found without the reference
        or None, what `verify` checks against the reference, now or after the run). For a generation engine
        one "call" is one replay of the run's trace and its latency the run's objective."""
        if self.generation is not None:
            return self.generation.timed_call(process, where, deadline, null_ms)
        call = _Call(self._timing_case, True, where)
        try:
            inputs, result, failure = self._call(process, call, deadline)
        except EngineProcessError as exc:
            return math.nan, f"{where}: {exc.kind}: {exc}", ()
        if failure is not None:
            return math.nan, f"{failure.status}: {failure.message}", ()
        return max(result.elapsed_s * 1e3 - null_ms, 0.0), None, (call, inputs, result)

    def verify(self, pending: tuple) -> str | None:
        """A timed call's outputs against the float64 reference: why they are wrong, or None."""
        if self.generation is not None:
            return self.generation.verify(pending)
        verdict = self._compare(*pending)
        return None if verdict.status is None else f"{verdict.status}: {verdict.message}"

    def figures(self, pending: tuple) -> dict[str, float]:
        """A timed call's figures beyond its latency (a generation engine's replay metrics), for paired records."""
        return self.generation.figures(pending) if self.generation is not None else {}

    def verify_held(self, process: EngineProcess, deadline: float) -> tuple[str | None, float]:
        """Every check case and a fresh draw over the domain, on a held engine (no timed calls): (why it
        failed, or None; the worst relative error)."""
        self._seen = {}
        try:
            verdicts, _ = self._run_plan(process, self._plan(np.random.default_rng(self._seeds.next()), timed=False),
                                         deadline, 0.0)
        except EngineProcessError as exc:
            return f"{exc.kind}: {exc}", math.nan
        worst = math.nan
        for verdict in verdicts:
            worst = worse(worst, verdict.rel_error)
        failed = next((v for v in verdicts if v.status is not None), None)
        self._seen = {}
        return (None if failed is None else f"{failed.status}: {failed.message}"), worst

    def case_of(self, inputs: Mapping[str, torch.Tensor | None]) -> CheckCase:
        """The case a request's inputs are an instance of: each free dim read off the tensors through the
        workload's request schema, the other dims the preset's."""
        shape = dict(self.preset.shape)
        optional = False
        for spec in self.workload.request_specs(self.preset):
            tensor = inputs.get(spec.name)
            if tensor is None:
                continue
            optional |= not spec.required
            for i, dim in enumerate(spec.shape):
                name = dim if isinstance(dim, str) else spec.dim_names[i] if i < len(spec.dim_names) else None
                if name is not None:
                    shape[name] = int(tensor.shape[i])
        return CheckCase("request", shape, self._timing_case.distribution, optional)

    def request(self, process: EngineProcess, inputs: Mapping[str, torch.Tensor | None], where: str,
                timeout_s: float) -> tuple[dict[str, torch.Tensor] | None, str | None]:
        """One call of a held engine on a client's inputs: (the outputs as the judge copied them, None), or
        (None, what went wrong without the reference). Raises EngineProcessError."""
        full = self._complete(inputs)
        result, failure = self._send(process, full, self._specs(self.case_of(full)), where,
                                     time.perf_counter() + timeout_s)
        if failure is not None:
            return None, f"{failure.status}: {failure.message}"
        return result.outputs, None

    def _complete(self, inputs: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        """A client's inputs with every input the workload names (an absent optional one as None)."""
        return {name: inputs.get(name) for name in self.workload.input_names}

    def rescore(self, inputs: Mapping[str, torch.Tensor | None], outputs: Mapping[str, torch.Tensor]
                ) -> tuple[str, float]:
        """A served call's outputs against the float64 reference of its inputs: (the problem or "", the
        norm-wise relative error)."""
        reference, scales = self.workload.reference_and_scales(self.preset, self._complete(inputs))
        return compare_outputs(dict(outputs), reference, self._dtypes, self._tolerance,
                               self.settings.elementwise_factor, scales)

    @property
    def defer_checks(self) -> bool:
        """Whether checks wait until the timed calls are done (CPU: a reference between calls would evict
        the engines' working sets from the caches they share)."""
        return self.device == "cpu"


def _case_key(case: CheckCase) -> tuple:
    return tuple(sorted(case.shape.items())), case.with_initial_state


def _shape_text(case: CheckCase) -> str:
    """e.g. "(B=3 T=133 H=2 K=32 V=32, beta_edges, with initial state)": a drawn case's message says where."""
    dims = " ".join(f"{axis}={value}" for axis, value in case.shape.items())
    return f"({dims}, {case.distribution}{', with initial state' if case.with_initial_state else ''})"


def _fingerprint(outputs: Mapping[str, torch.Tensor] | None) -> tuple:
    """Names, shapes and a digest of the bytes of each output: equal fingerprints, equal outputs."""
    parts = []
    for name, value in sorted((outputs or {}).items()):
        raw = value.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
        parts.append((name, tuple(value.shape), hashlib.blake2b(raw, digest_size=16).hexdigest()))
    return tuple(parts)


def _summary(what: str, reply: Mapping[str, object]) -> str:
    kind = "out of memory" if reply.get("oom") else str(reply.get("type", "error"))
    lines = str(reply.get("message", "")).strip().splitlines()
    return f"{what}: {kind}: {lines[0] if lines else ''}"[:500]
