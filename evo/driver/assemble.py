"""Assembly: a run's config -> its parts (run directory, Ray, evaluators, agents, stores, evidence sinks).

Nothing here searches or times anything; `evo.driver.run` puts the parts to work. Each part that
holds a process or a remote run registers its teardown on the run's `ExitStack` as it is made, so
a run that fails half-assembled still closes what it started, in reverse order.
"""
from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, TextIO

import ray
import yaml

from evaluators.pool.actors import EvaluatorPool
from evo.core.code import CodeStore
from evo.core.genome import GeneSpace
from evo.core.lessons import Lessons, for_run as warm_lessons
from evo.driver import local_ray
from evo.driver.config import RunConfig
from evo.driver.resume import SavedRun, check_device, write_marker
from evo.driver.rundir import check_new_run_dir, search_space
from evo.evidence.code_diffs import CodeDiffs, SourceResolver
from evo.evidence.journal import DiskEvidence
from evo.evidence.lineage_view import LineageSink
from evo.evidence.mlflow.sink import MlflowEvidence, MlflowSink, tracking_uri
from evo.evidence.sink import FAILED, Sink
from evo.workloads import get_workload
from evo.workloads.base import DeviceInfo, Preset, Workload
from operators.code_agent import CODE_DIR
from operators.code_lessons import lessons_path
from operators.ray_team import RayTeam

Say = Callable[[str], None]  # prints one line of the run's output


@dataclass(frozen=True)
class RunParts:
    """What a run is made of once assembled: everything the search needs but its baselines."""

    config: RunConfig
    run_dir: Path
    workload: Workload
    preset: Preset
    pool: EvaluatorPool
    device: DeviceInfo  # what the evaluators time on
    lessons: Lessons | None  # warm start: what earlier runs learned
    gene_space: GeneSpace
    store: CodeStore  # engine sources named by code genes
    team: RayTeam
    agent_options: dict[str, dict[str, Any]]  # per agent name: its keyword arguments (the code agent's)
    mlflow: MlflowSink | None

    @property
    def device_name(self) -> str:
        return f"{self.device.kind}:{self.device.name}"


def open_run_dir(config: RunConfig, run_dir: Path | None, resume: SavedRun | None) -> Path:
    """The run's directory, created with its config and format marker (a resumed run keeps its own)."""
    if resume:
        return Path(resume.run_dir).resolve()
    if run_dir is not None:
        check_new_run_dir(Path(run_dir))  # RunDirError: another run, a file, or a non-empty directory
    path = Path(run_dir or new_run_dir(config)).resolve()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    write_marker(path, config)
    return path


def new_run_dir(config: RunConfig) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return Path(config.out_dir) / f"{config.name}-{stamp}"


def start_ray(config: RunConfig) -> bool:
    """Join the cluster named by the config or $RAY_ADDRESS; else start a local Ray on 127.0.0.1.

    Returns whether this process started Ray (and so must stop it).
    """
    return local_ray.start_for_run(config.ray.address, config.ray.num_cpus)


def assemble(config: RunConfig, run_dir: Path, resume: SavedRun | None, lessons: Lessons | None,
             say: Say, stack: ExitStack) -> RunParts:
    """Start the evaluators, read the lessons, make the gene space and code store, start the agents and the
    MLflow run: everything that costs CPU starts here, before any timing."""
    workload = get_workload(config.workload)
    preset = workload.presets()[config.preset]  # check_config has vouched for it
    if workload.contract == "generation":  # judged on the config's trace: the roofline and the gene space see it
        preset = workload.with_trace(preset, config.evaluator.trace)
    pool = start_pool(config, preset, say, stack)
    if resume:
        check_device(resume, pool.device_type)
    device = pool.device_info()
    gene_space = search_space(config, workload, preset, device)
    lessons = warm_lessons(run_dir, lessons, resume is not None, config.workload, config.preset,
                           f"{device.kind}:{device.name}", gene_space)
    if lessons:
        say(f"warm start: lessons of {lessons.describe()} ({len(lessons.best)} best genomes, "
            f"{lessons.evaluations} evaluations)")
    store = CodeStore(run_dir / CODE_DIR)
    for source in (lessons.code.values() if lessons else ()):  # warm-start genomes that carry code
        store.put(source)
    pool.sources_of = SourceResolver(store, gene_space.code_gene_names())
    options = agent_options(config, run_dir, device, say)
    team = RayTeam(list(config.search.agents), gene_space, config.search.seed, options)
    stack.callback(team.close)
    mlflow = start_mlflow(config, run_dir, device, resume, stack)
    team.state()  # waits until the agents' actor is up
    return RunParts(config, run_dir, workload, preset, pool, device, lessons, gene_space, store, team, options,
                    mlflow)


def start_pool(config: RunConfig, preset: Preset, say: Say, stack: ExitStack) -> EvaluatorPool:
    pool = EvaluatorPool(config.workload, preset, config.evaluator, config.search.seed, config.evaluators,
                         on_event=say)
    stack.callback(pool.close)
    nodes = len({info["node_id"] for info in pool.describe()})
    say(f"evaluators: {len(pool.slots)} on {nodes} node(s), all timing on {pool.device_type}"
        + (f" ({pool.accelerator} GPUs)" if pool.kind == "gpu" else ""))
    return pool


def agent_options(config: RunConfig, run_dir: Path, device: DeviceInfo, say: Say) -> dict[str, dict[str, Any]]:
    """Keyword arguments of the agents that take some: the code agent's (see `code_agent_options`)."""
    if "code" not in config.search.agents:
        return {}
    options = code_agent_options(config, run_dir, device)
    say(f"code agent: {config.code_agent.llm.model} at {config.code_agent.llm.base_url}; lessons "
        f"{options['lessons_path']}")
    return {"code": options}


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


def start_mlflow(config: RunConfig, run_dir: Path, device: DeviceInfo, resume: SavedRun | None,
                 stack: ExitStack) -> MlflowSink | None:
    """The MLflow parent run (through its outbox), or None when MLflow is off. Should the run fail before
    its sinks close, the parent run is ended FAILED."""
    if not config.mlflow.enabled:
        return None
    uri = tracking_uri(config.mlflow.tracking_uri)
    tags = {"workload": config.workload, "preset": config.preset, "run_dir": str(run_dir), "device": device.name}
    if resume:  # a linked continuation run: the interrupted one stays as it was left
        tags["continues_run_id"] = _previous_parent_run(uri, config.mlflow.experiment, run_dir) or ""
    sink = MlflowSink(uri, config.mlflow.experiment, run_dir.name + (" (resumed)" if resume else ""),
                      config.to_dict(), tags=tags, run_dir=run_dir)
    stack.callback(lambda: sink.finished or sink.finish(None, run_dir, FAILED))
    return sink


def evidence_sinks(parts: RunParts, resume: SavedRun | None, *reporters: Sink) -> list[Sink]:
    """The search's sinks, in the order each generation reaches them: the journal and Parquet file first,
    the code diffs, the `reporters` (progress lines), MLflow (which logs the files before it), the lineage
    drawing."""
    disk = DiskEvidence(parts.run_dir, journaled={e.proposal.hash for e in resume.journal} if resume else set(),
                        resumed_at=(resume.state or {}).get("generation", 0) if resume else None)
    diffs = None
    if parts.gene_space.code_genes:
        stages = parts.workload.open_stages(parts.preset, parts.device)
        code_genes = parts.gene_space.code_gene_names()
        diffs = CodeDiffs(parts.run_dir, parts.store, tuple(s for s in stages if s.gene in code_genes))
    sinks: list[Sink] = [disk, *([diffs] if diffs else []), *reporters]
    if parts.mlflow:
        sinks.append(MlflowEvidence(parts.mlflow, parts.run_dir, disk.generation_path,
                                    lambda generation: diffs.files.pop(generation, []) if diffs else []))
    sinks.append(LineageSink(parts.run_dir, parts.mlflow))  # lineage page and plots, every 30 s of search and at the end
    return sinks


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
