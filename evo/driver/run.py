"""The driver: config -> Ray -> evaluators and agents -> search loop -> evidence -> summary.

Ray lives here and in `evaluators.pool` / `operators.ray_team`; the search core never sees it.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

import ray
import yaml

from evaluators.pool import EvaluatorPool
from evo.driver import local_ray
from evo.driver.config import RunConfig
from evo.core.code import CodeStore
from evo.evidence.code_diffs import CodeDiffs, SourceResolver
from evo.evidence.journal import DiskEvidence, write_baselines, write_json
from evo.core.lessons import FILE as LESSONS_FILE, Lessons, for_run as warm_lessons, from_search as lessons_from_search
from evo.core.lessons import write as write_lessons
from evo.core.loop import run_search
from evo.evidence.lineage_view import LineageSink
from evo.evidence.mlflow.sink import MlflowSink, tracking_uri
from evo.core.records import EvalResult
from evo.evidence.mlflow.registry import register_engine
from evo.driver.resume import ReplayExecutor, SavedRun, check_device, restore, write_marker
from evo.driver.rundir import check_config, check_new_run_dir
from evo.core.search import GenerationReport, Search
from evo.driver.stop import STOP, install_handlers
from evo.evidence.engine_record import record_from_summary
from evo.evidence.summary import best_baseline, make_summary
from evo.workloads import get_workload
from evo.workloads.base import DeviceInfo
from operators.code_agent import CODE_DIR
from operators.code_lessons import lessons_path
from operators.ray_team import RayTeam

CODE_LESSONS_FILE = "code_lessons.md"  # the code agent's lessons file as it stood at the end of the run


@dataclass(frozen=True)
class RunOutcome:
    run_dir: Path
    summary: dict
    mlflow_run_id: str | None


def new_run_dir(config: RunConfig) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return Path(config.out_dir) / f"{config.name}-{stamp}"


def start_ray(config: RunConfig) -> bool:
    """Join the cluster named by the config or $RAY_ADDRESS; else start a local Ray on 127.0.0.1.

    Returns whether this process started Ray (and so must stop it).
    """
    if ray.is_initialized():
        return False
    address = config.ray.address or os.environ.get("RAY_ADDRESS")
    # Workers must import this project: it is pip-installed, and the env keeps the compile cache shared.
    env = {"env_vars": {k: os.environ[k] for k in ("TORCHINDUCTOR_CACHE_DIR",) if k in os.environ}}
    if address:
        local_ray.join(address, runtime_env=env, log_to_driver=False)
        return True
    # a new Ray even if `ray start` ran on this machine, listening on 127.0.0.1 only (evo.driver.local_ray)
    local_ray.init_local(num_cpus=config.ray.num_cpus or os.cpu_count(), include_dashboard=False,
                         runtime_env=env, log_to_driver=False)
    return True


class Progress:
    """Prints one line per generation: best latency, speedup, fraction valid, evaluations per second."""

    def __init__(self, out: TextIO, baseline_ms: float, budget: int) -> None:
        self.out, self.baseline_ms, self.budget = out, baseline_ms, budget

    def on_result(self, evaluated) -> None:
        pass

    def on_generation(self, report: GenerationReport, search: Search) -> None:
        speedup = self.baseline_ms / report.best_latency_ms
        best = report.best
        print(f"gen {report.generation:3d} | best {report.best_latency_ms:8.2f} ms"
              f" | {speedup:5.2f}x vs best baseline | valid {report.status_counts.get('ok', 0)}/{len(report.evaluated)}"
              f" | {report.evals_per_s:5.2f} evals/s | evals {report.evaluations}/{self.budget}"
              f" | best from {best.proposal.agent if best else '-'}", file=self.out, flush=True)


class _MlflowGeneration:
    """Adapter so MLflow gets each generation after its Parquet file (and its code diffs) are on disk."""

    def __init__(self, sink: MlflowSink, disk: DiskEvidence, diffs: CodeDiffs | None) -> None:
        self.sink, self.disk, self.diffs = sink, disk, diffs

    def on_result(self, evaluated) -> None:
        pass

    def on_generation(self, report: GenerationReport, search: Search) -> None:
        extra = self.diffs.files.pop(report.generation, []) if self.diffs else []
        self.sink.on_generation(report, search, self.disk.generation_path(report.generation), extra)


def code_agent_options(config: RunConfig, run_dir: Path, device: DeviceInfo) -> dict:
    """The code agent's keyword arguments (operators.code_agent.CodeAgent): settings, where it writes, and
    its API key read here from the variable the config names (never written to the config or MLflow)."""
    settings = config.code_agent
    key_env = settings.llm.api_key_env
    kind = device.kind if device.kind == "cpu" else f"{device.kind}-{device.name}"
    lessons_dir = Path(settings.lessons_dir or Path(config.out_dir) / "lessons").resolve()
    return {"settings": settings, "workload": config.workload, "preset": config.preset, "device": device,
            "run_dir": str(run_dir), "lessons_path": str(lessons_path(lessons_dir, config.workload, kind)),
            "environ": {key_env: os.environ[key_env]} if key_env in os.environ else {}}


def run(config: RunConfig, run_dir: Path | None = None, out: TextIO = sys.stdout,
        resume: SavedRun | None = None, handle_signals: bool = False, lessons: Lessons | None = None) -> RunOutcome:
    """Run a search; with `resume` (from `evo.driver.resume.load_run`), continue the one in its run directory.
    With `handle_signals` (the CLI), SIGTERM and Ctrl-C stop it cleanly (see evo.driver.stop)."""
    started = time.monotonic()
    check_config(config)  # ConfigError before a directory or Ray exists
    if run_dir is not None and not resume:
        check_new_run_dir(Path(run_dir))  # RunDirError: another run, a file, or a non-empty directory
    run_dir = Path(resume.run_dir if resume else run_dir or new_run_dir(config)).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
        write_marker(run_dir, config)
    workload = get_workload(config.workload)
    presets = workload.presets()
    if config.preset not in presets:
        raise ValueError(f"unknown preset {config.preset!r} for workload {config.workload!r}; available: {sorted(presets)}")
    preset = presets[config.preset]
    print(f"run directory: {run_dir}", file=out, flush=True)
    own_ray = start_ray(config)
    if handle_signals:
        install_handlers()  # after ray.init, which installs its own SIGTERM handler
    pool = team = mlflow_sink = disk = lineage = None
    status = "FAILED"
    try:
        pool = EvaluatorPool(config.workload, preset, config.evaluator, config.search.seed,
                             config.evaluators.count, config.evaluators.threads, config.evaluators.accelerator_type,
                             config.evaluators.placement, on_event=lambda line: print(line, file=out, flush=True))
        nodes = len({info["node_id"] for info in pool.describe()})
        print(f"evaluators: {len(pool.slots)} on {nodes} node(s), all timing on {pool.device_type}"
              + (f" ({pool.accelerator} GPUs)" if pool.kind == "gpu" else ""), file=out, flush=True)
        if resume:
            check_device(resume, pool.device_type)
        device = pool.device_info()
        lessons = warm_lessons(run_dir, lessons, resume is not None, config.workload, config.preset,
                               f"{device.kind}:{device.name}")
        if lessons:
            print(f"warm start: lessons of {lessons.describe()} ({len(lessons.best)} best genomes, "
                  f"{lessons.evaluations} evaluations)", file=out, flush=True)
        gene_space = workload.gene_space(preset, device)
        if config.genes:
            gene_space = gene_space.restrict(config.genes)
        available = list(workload.baselines(preset))
        names = list(config.baselines) if config.baselines is not None else available
        missing = [n for n in names if n not in available]
        if missing:
            raise ValueError(f"baselines {missing} are not available here; available: {available}")
        # Start everything that costs CPU (agent processes, the MLflow store) before any timing.
        store = CodeStore(run_dir / CODE_DIR)
        for source in (lessons.code.values() if lessons else ()):  # warm-start genomes that carry code
            store.put(source)
        pool.sources_of = SourceResolver(store, gene_space.code_gene_names())
        options = {}
        if "code" in config.search.agents:
            options["code"] = code_agent_options(config, run_dir, device)
            print(f"code agent: {config.code_agent.llm.model} at {config.code_agent.llm.base_url}; lessons "
                  f"{options['code']['lessons_path']}", file=out, flush=True)
        team = RayTeam(list(config.search.agents), gene_space, config.search.seed, options)
        if config.mlflow.enabled:
            uri = tracking_uri(config.mlflow.tracking_uri)
            tags = {"workload": config.workload, "preset": config.preset, "run_dir": str(run_dir), "device": device.name}
            if resume:  # a linked continuation run: the interrupted one stays as it was left
                tags["continues_run_id"] = _previous_parent_run(uri, config.mlflow.experiment, run_dir) or ""
            mlflow_sink = MlflowSink(uri, config.mlflow.experiment, run_dir.name + (" (resumed)" if resume else ""),
                                     config.to_dict(), tags=tags, run_dir=run_dir)
        team.state()  # waits until the agent actors are up
        roofline = workload.roofline(preset, pool.measure_rates())
        if resume and (run_dir / "baselines.json").exists():
            saved = json.loads((run_dir / "baselines.json").read_text())
            baselines = {name: EvalResult.from_dict(r) for name, r in saved.items()}
            print("baselines: as timed before the interruption", file=out, flush=True)
        else:
            print(f"timing baselines: {', '.join(names)}", file=out, flush=True)
            baselines = pool.run_baselines(names)
            write_baselines(run_dir, baselines)
        for name, result in baselines.items():
            print(f"  baseline {name:32s} {result.status:10s} {result.latency_ms:9.2f} ms  {result.message[:80]}",
                  file=out, flush=True)
        top = best_baseline(baselines)
        baseline_ms = top[1].latency_ms if top else math.nan
        print(f"roofline floor: {roofline.floor_ms:.3f} ms", file=out, flush=True)

        disk = DiskEvidence(run_dir, journaled={e.proposal.hash for e in resume.journal} if resume else set())
        lineage = LineageSink(run_dir, mlflow_sink)  # lineage page and plots, after each generation and at the end
        diffs = None
        if gene_space.code_genes:
            stages = workload.open_stages(preset, device)
            diffs = CodeDiffs(run_dir, store, tuple(s for s in stages if s.gene in gene_space.code_gene_names()))
        sinks = [disk, *([diffs] if diffs else []), Progress(out, baseline_ms, config.search.max_evaluations), lineage]
        if mlflow_sink:
            mlflow_sink.log_baselines(baselines, roofline.floor_ms)
            sinks.append(_MlflowGeneration(mlflow_sink, disk, diffs))
        search = Search(gene_space, config.search, team, lessons=lessons)
        executor = pool
        if resume:
            executor = ReplayExecutor(pool, search, restore(search, resume))
            print(f"resuming at generation {search.generation}: {search.evaluations} results restored, "
                  f"{len(executor.replay)} of the interrupted generation to replay", file=out, flush=True)
        pool.should_stop = STOP.is_set
        run_search(search, executor, sinks, should_stop=STOP.is_set)
        stopped = STOP.is_set()
        if stopped:
            print(f"stopped: {search.evaluations} results are recorded; continue with "
                  f"python -m evo resume {run_dir}", file=out, flush=True)

        summary = make_summary(search, baselines, roofline, config.workload, config.preset,
                               time.monotonic() - started)
        summary["mlflow_run_id"] = mlflow_sink.run_id if mlflow_sink else None
        summary["registered_model"] = None
        summary["stopped"] = stopped
        summary["warm_start"] = lessons.describe() if lessons else None
        write_lessons(run_dir / LESSONS_FILE, lessons_from_search(search, config.workload, config.preset,
                                                                   f"{device.kind}:{device.name}", run_dir.name,
                                                                   store))
        if "code" in options:  # the code agent's lessons as they stand at the end of this run, for MLflow
            team.wait_idle(config.code_agent.llm.timeout_s)
            shutil.copyfile(options["code"]["lessons_path"], run_dir / CODE_LESSONS_FILE)
        summary["best_sources"] = _best_sources(summary, store, gene_space)
        if mlflow_sink and config.mlflow.register_model and summary["best_genome"] and not stopped:
            summary["registered_model"] = _register(mlflow_sink, summary, run_dir, config, out)
        write_json(run_dir / "summary.json", summary)
        status = "KILLED" if stopped else "FINISHED"
        _print_summary(summary, run_dir, out)
        return RunOutcome(run_dir, summary, mlflow_sink.run_id if mlflow_sink else None)
    finally:
        if disk:
            disk.close()
        if lineage:
            lineage.finish()
        if mlflow_sink:
            summary_path = run_dir / "summary.json"
            mlflow_sink.finish(json.loads(summary_path.read_text()) if summary_path.exists() else {}, run_dir, status)
        for part in (team, pool):
            if part:
                part.close()
        if own_ray:
            ray.shutdown()


def _best_sources(summary: dict, store: CodeStore, gene_space) -> dict[str, str]:
    """{hash: source} of the best genome's code genes: serving builds the engine from them."""
    if not summary.get("best_genome"):
        return {}
    values = {k: v for domain in ("fusion", "scheduling", "memory") for k, v in summary["best_genome"][domain].items()}
    return store.sources_for(values, gene_space.code_gene_names())


def _register(sink: MlflowSink, summary: dict, run_dir: Path, config: RunConfig, out: TextIO) -> str | None:
    """Register the best engine, if MLflow has caught up; a store that is down only costs the registration."""
    name = config.mlflow.model_name or f"{config.workload}-{config.preset}-engine"
    if not sink.run_id or sink.pending:
        print(f"warning: MLflow is behind, the best engine was not registered as {name!r}; "
              f"serve the run directory {run_dir} instead", file=out, flush=True)
        return None
    try:
        version = register_engine(record_from_summary(summary, str(run_dir)), sink.run_id, name, sink.uri)
    except Exception as exc:  # the evidence is on disk; a failed registration must not lose the summary
        print(f"warning: registering {name!r} in MLflow failed: {type(exc).__name__}: {exc}", file=out, flush=True)
        return None
    return f"models:/{name}/{version}"


def _previous_parent_run(uri: str, experiment: str, run_dir: Path) -> str | None:
    """The newest parent run logged for this run directory, if MLflow can tell."""
    from mlflow.tracking import MlflowClient

    try:
        client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(experiment)
        if found is None:
            return None
        runs = client.search_runs([found.experiment_id], filter_string=f"tags.run_dir = '{run_dir}'",
                                  order_by=["attributes.start_time DESC"], max_results=1)
        return runs[0].info.run_id if runs else None
    except Exception:  # MLflow being down must not stop a resume
        return None


def _print_summary(summary: dict, run_dir: Path, out: TextIO) -> None:
    print("\nbest engine", summary["best_hash"], file=out)
    if summary["best_genome"]:
        for domain in ("fusion", "scheduling", "memory"):
            genes = ", ".join(f"{k}={v}" for k, v in summary["best_genome"][domain].items())
            print(f"  {domain:10s} {genes}", file=out)
    print(f"  latency    {summary['best_latency_ms']:.3f} ms (IQR {summary['best_latency_spread_ms']:.3f}),"
          f" max rel error {summary['best_max_rel_error']:.2e}", file=out)
    for name, value in sorted(summary["speedups"].items(), key=lambda kv: kv[1]):
        print(f"  {value:7.2f}x faster than {name}", file=out)
    print(f"  {summary['speedup_vs_best_baseline']:7.2f}x faster than the best baseline ({summary['best_baseline']})",
          file=out)
    if summary["roofline"]:
        print(f"  {100 * summary['roofline']['fraction_of_floor']:.1f}% of the roofline floor"
              f" ({summary['roofline']['floor_ms']:.3f} ms)", file=out)
    print(f"  evaluations {summary['evaluations']} {summary['status_counts']}", file=out)
    if summary.get("registered_model"):
        print(f"  registered  {summary['registered_model']} (MLflow run {summary['mlflow_run_id']})", file=out)
    print(f"run directory: {run_dir}", file=out, flush=True)
