"""A run directory belongs to one run: checks made before a run creates anything or starts Ray.

  check_config(config)        the whole config against its workload: workload, preset, baselines and
                              genes exist here (ConfigError naming what is wrong and what is allowed)
  check_new_run_dir(path)     `run --out PATH` must name a new or empty directory, never another run
                              or a file (RunDirError saying how to continue that run instead)
  finished(run_dir)           the summary of a run that ended (not stopped): resuming it does nothing
  verify_generations(saved)   every complete generation's Parquet file agrees with the journal; a
                              damaged one is rebuilt from the journal, or named when it cannot be

Nothing here imports Ray or MLflow.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from evo.driver.config import ConfigError, RunConfig
from evo.evidence.journal import SCHEMA, evidence_row
from evo.evidence.summary import SUMMARY_FILE, Summary
from evo.core.genome import GeneSpace, GenomeError
from evo.driver.resume import MARKER, RunDirError

if TYPE_CHECKING:
    from evo.driver.resume import SavedRun


def check_config(config: RunConfig) -> None:
    """Everything a run needs from its workload, checked before a directory or Ray exists."""
    from evo.workloads import get_workload
    from evo.workloads.base import DeviceInfo

    try:
        workload = get_workload(config.workload)
    except ValueError as exc:
        raise ConfigError(f"workload: {exc}") from None
    presets = workload.presets()
    if config.preset not in presets:
        raise ConfigError(f"preset {config.preset!r} is not a preset of workload {config.workload!r}; "
                          f"available: {sorted(presets)}")
    preset = presets[config.preset]
    if workload.contract == "generation":
        try:
            preset = workload.with_trace(preset, config.evaluator.trace)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"evaluator.trace: {exc}") from None
        requests = workload.trace(preset).count
        if config.search.screen.enabled and config.search.screen.count >= requests:
            raise ConfigError(f"search.screen.count: {config.search.screen.count} requests screen nothing: the run's "
                              f"trace has {requests}; give fewer (e.g. {max(1, requests // 2)}), "
                              f"or 0 to time every candidate on the whole trace")
    elif config.search.screen.enabled:
        raise ConfigError(f"search.screen: workload {config.workload!r} takes calls, timed on one fixed case; screening"
                          f" on shorter replays applies to generation workloads only (count 0 turns it off)")
    elif config.evaluator.trace:
        raise ConfigError(f"evaluator.trace: workload {config.workload!r} takes calls, not requests (the call "
                          f"contract): a request trace applies to generation workloads only, e.g. llama_serve")
    elif config.evaluator.accuracy:
        raise ConfigError(f"evaluator.accuracy: workload {config.workload!r} takes calls, judged by relative error "
                          f"(evaluator.tolerances); the accuracy contract applies to generation workloads only")
    _check_accuracy(config, workload, preset)
    if config.baselines is not None:
        available = sorted(workload.baselines(preset))
        missing = [n for n in config.baselines if n not in available]
        if missing:
            raise ConfigError(f"baselines {missing} are not available for {config.workload}/{config.preset} here; "
                              f"available: {available} (or null for all)")
    if config.genes:
        # the preset's device type stands in for the evaluators' device, which only Ray can report
        space = workload.gene_space(preset, DeviceInfo(preset.device, preset.device, config.evaluators.threads))
        try:
            space.restrict(config.genes)
        except (GenomeError, KeyError, ValueError, TypeError) as exc:
            raise ConfigError(f"genes: {exc}".replace("\n", " ")) from None


def search_space(config: RunConfig, workload, preset, device) -> GeneSpace:
    """The gene space a run (or a bench, or a strategy comparison) searches: the workload's for `device`, restricted
    to `config.genes`, lossy values left out unless a generation run is judged under an accuracy budget."""
    from evaluators.settings import accuracy_mode

    space = workload.gene_space(preset, device)
    if config.genes:
        space = space.restrict(config.genes)
    if workload.contract != "generation" or accuracy_mode(config.evaluator.accuracy, preset.dtype) == "exact":
        space = space.exact_only()  # lossy values are judged only under a budget
    return space


def _check_accuracy(config: RunConfig, workload, preset) -> None:
    """An exact run names no lossy gene value; a budget needs its bounds, or a workload that calibrates them."""
    from evaluators.settings import BUDGET_KEYS, accuracy_mode
    from evo.workloads.base import DeviceInfo, Workload

    accuracy = config.evaluator.accuracy
    mode = accuracy_mode(accuracy, preset.dtype) if workload.contract == "generation" else "exact"
    if mode == "budget" and not {"min_agreement", "max_mean_gap", "max_gap"} <= set(accuracy) \
            and type(workload).honest_logits is Workload.honest_logits:
        raise ConfigError(f"evaluator.accuracy: mode budget needs min_agreement, max_mean_gap and max_gap: workload "
                          f"{config.workload!r} cannot calibrate a budget (it has no honest_logits)")
    if mode == "exact" and config.genes:
        space = workload.gene_space(preset, DeviceInfo(preset.device, preset.device, config.evaluators.threads))
        lossy = {g.name: [v for v in config.genes.get(g.name, ()) if v in g.lossy] for g in space.genes if g.lossy}
        lossy = {name: values for name, values in lossy.items() if values}
        if lossy:
            raise ConfigError(f"genes: {lossy} trade precision (lossy values), which an exact run cannot accept: set "
                              f"evaluator.accuracy.mode: budget (its bounds {list(BUDGET_KEYS)}, or calibrated), or "
                              f"leave them out")


def check_new_run_dir(path: Path) -> None:
    """`run --out path`: a new or empty directory only."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"--out {path} is an existing file, not a directory; name a new directory")
    if path.is_dir() and any(path.iterdir()):
        if (path / MARKER).exists() or (path / "evidence.jsonl").exists():
            raise RunDirError(f"--out {path} holds another run; continue it with `python -m evo resume {path}`, "
                              f"or name a new directory")
        raise RunDirError(f"--out {path} is not empty ({', '.join(sorted(p.name for p in path.iterdir())[:5])}); "
                          f"a run directory must be new or empty")


def finished(run_dir: Path) -> Summary | None:
    """The summary of a run that ended by itself (budget spent); None if it can still be continued."""
    path = Path(run_dir) / SUMMARY_FILE
    if not path.exists():
        return None
    try:
        summary = Summary.read(path)
    except ValueError as exc:  # not JSON, or not an object
        raise RunDirError(f"{path} is corrupt: {exc}") from None
    return None if summary.stopped else summary


def verify_generations(saved: SavedRun) -> list[str]:
    """Check each complete generation's Parquet file against the journal; rebuild a damaged one from
    the journal. Returns a line per file rebuilt; raises RunDirError when one cannot be rebuilt."""
    complete = saved.state["generation"] if saved.state else 0
    by_generation: dict[int, list] = {}
    for item in saved.journal:
        by_generation.setdefault(item.proposal.generation, []).append(item)
    rebuilt = []
    for generation in range(complete):
        path = saved.run_dir / "generations" / f"gen_{generation:04d}.parquet"
        expected = sorted(by_generation.get(generation, []), key=lambda e: e.proposal.index)
        problem = _parquet_problem(path, {e.proposal.hash for e in expected})
        if problem is None:
            continue
        if not expected:
            raise RunDirError(f"{path} {problem}, and evidence.jsonl holds no result of generation {generation} "
                              f"to rebuild it from: the run directory is damaged")
        tmp = path.with_suffix(".parquet.tmp")
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist([evidence_row(e) for e in expected], schema=SCHEMA), tmp)
        tmp.replace(path)
        rebuilt.append(f"{path} {problem}: rebuilt from evidence.jsonl ({len(expected)} results)")
    return rebuilt


def _parquet_problem(path: Path, hashes: set[str]) -> str | None:
    if not path.exists():
        return "is missing"
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a truncated or foreign file
        return f"is unreadable ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    if "genome_hash" not in table.column_names:
        return "has no genome_hash column"
    found = table.column("genome_hash").to_pylist()
    if len(found) != len(set(found)) or set(found) != hashes:
        return f"holds {len(found)} results that differ from the journal's {len(hashes)}"
    return None
