"""`python -m evo bench`: genomes and every baseline evaluated in this one process, side by side.

No Ray and no MLflow on the import chain (GPU boxes often have neither): the plain
`evaluators.evaluator.Evaluator` builds, checks and times each engine; an optional short search runs
with the in-process agents (`operators.team.LocalTeam`). Writes results.parquet, table.md and
table.json under the output folder; logs to MLflow only when it is importable and enabled.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from evo.driver.config import RunConfig
from evo.core.genome import Genome, GeneSpace
from evo.core.records import EvalResult
from evo.core.seeds import derive_seed


@dataclass(frozen=True)
class BenchRow:
    """One engine's line of the table. speedup = reference median / this median (>1: faster)."""

    engine: str  # "baseline:<name>", or the genome hash with its source
    source: str  # baseline, genome, sample, search
    status: str
    median_ms: float
    iqr_ms: float
    max_rel_error: float
    roofline_floor_ms: float
    fraction_of_roofline: float  # floor / median: 1.0 means at the floor
    speedup: float  # vs `reference`
    reference: str
    build_s: float
    message: str
    genome: str  # genome JSON ("" for baselines)


def genomes_from_file(path: str, space: GeneSpace) -> list[Genome]:
    """A JSON list (or JSON lines) of genomes: full genome objects, or flat {gene: value} maps that
    take defaults for the genes they omit."""
    text = Path(path).read_text()
    items = json.loads(text) if text.lstrip().startswith("[") else [json.loads(line) for line in text.splitlines() if line.strip()]
    out = []
    for item in items:
        full = isinstance(item, dict) and "workload" in item
        out.append(space.validate(Genome.from_dict(item)) if full else space.make(item))
    return out


def sample_genomes(space: GeneSpace, n: int, seed: int) -> list[Genome]:
    """The default genome, then random legal ones (distinct), drawn with a seed derived by name."""
    rng = np.random.default_rng(derive_seed(seed, "bench:sample"))
    out = {space.default().hash: space.default()} if n > 0 else {}
    for _ in range(50 * n):
        if len(out) >= n:
            break
        genome = space.sample(rng)
        out.setdefault(genome.hash, genome)
    return list(out.values())


def run_search(evaluator, space: GeneSpace, config: RunConfig, budget: int) -> list[tuple[Genome, EvalResult]]:
    """A short search, agents and evaluator in this process: ask, evaluate, tell, until done."""
    from evo.core.search import Search
    from operators.team import LocalTeam

    settings = replace(config.search, max_evaluations=budget)
    search = Search(space, settings, LocalTeam(list(settings.agents), space, settings.seed))
    out = []
    while not search.done():
        proposals = search.ask()
        if not proposals:
            break
        for proposal in proposals:
            result = evaluator.evaluate(proposal.genome.to_json())
            search.tell(proposal, result)
            out.append((proposal.genome, result))
        search.end_generation()
    return out


def make_rows(entries: list[tuple[str, str, Genome | None, EvalResult]],
              reference_baseline: str | None = None) -> list[BenchRow]:
    """Table rows with roofline fractions and speedups against `reference_baseline` (the workload's
    `reference_baseline`: what a user runs today), else the best baseline."""
    ok = {name: r.latency_ms for name, _, _, r in entries if r.ok}
    baselines = {n: ms for n, ms in ok.items() if n.startswith("baseline:")}
    wanted = f"baseline:{reference_baseline}" if reference_baseline else None
    reference = wanted if wanted in baselines else min(baselines, key=baselines.get, default="")
    ref_ms = baselines.get(reference, math.nan)
    rows = []
    for name, source, genome, r in entries:
        median = r.latency_ms if r.ok else math.nan
        rows.append(BenchRow(
            engine=name, source=source, status=r.status, median_ms=median,
            iqr_ms=r.latency_spread_ms if r.ok else math.nan, max_rel_error=r.max_rel_error,
            roofline_floor_ms=r.roofline_floor_ms, fraction_of_roofline=r.roofline_floor_ms / median,
            speedup=ref_ms / median, reference=reference.removeprefix("baseline:"),
            build_s=r.build_s, message=r.message[:300], genome=genome.to_json() if genome else ""))
    return sorted(rows, key=lambda row: (math.isnan(row.median_ms), row.median_ms))


def _fmt(x: float, spec: str) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def markdown(rows: list[BenchRow], title: str) -> str:
    """The table as Markdown: engine, status, median, IQR, error, fraction of roofline, speedup."""
    ref = next((r.reference for r in rows if r.reference), "") or "none"
    lines = [f"### {title}", "",
             f"| engine | source | status | median ms | IQR ms | max rel err | fraction of roofline | speedup vs {ref} |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r.engine} | {r.source} | {r.status} | {_fmt(r.median_ms, '.4g')} | {_fmt(r.iqr_ms, '.3g')} | "
                     f"{_fmt(r.max_rel_error, '.2e')} | {_fmt(r.fraction_of_roofline, '.3f')} | {_fmt(r.speedup, '.2f')}x |")
    return "\n".join(lines) + "\n"


def write(rows: list[BenchRow], out_dir: Path, title: str, stamp: dict) -> None:
    """results.parquet (one row per engine), table.md and table.json."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir.mkdir(parents=True, exist_ok=True)
    records = [asdict(r) for r in rows]
    pq.write_table(pa.Table.from_pylist(records), out_dir / "results.parquet")
    (out_dir / "table.md").write_text(markdown(rows, title))
    clean = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()} for rec in records]
    (out_dir / "table.json").write_text(json.dumps({"title": title, "environment": stamp, "rows": clean}, indent=1))


def log_mlflow(config: RunConfig, out_dir: Path, rows: list[BenchRow]) -> str:
    """One MLflow run with the table as artifacts, when mlflow is importable and enabled; else a reason."""
    if not config.mlflow.enabled:
        return "MLflow disabled in the config"
    try:
        import mlflow  # only here: the bench runs where MLflow is absent
    except ImportError:
        return "MLflow not installed: table written to files only"

    if config.mlflow.tracking_uri:
        mlflow.set_tracking_uri(config.mlflow.tracking_uri)
    mlflow.set_experiment(f"{config.mlflow.experiment}-bench")
    with mlflow.start_run(run_name=out_dir.name) as run:
        mlflow.log_params({"workload": config.workload, "preset": config.preset})
        for i, r in enumerate(rows):
            if math.isfinite(r.median_ms):
                mlflow.log_metric(f"median_ms_{i:02d}", r.median_ms)
        mlflow.log_artifacts(str(out_dir))
        return f"MLflow run {run.info.run_id}"


def bench(config: RunConfig, genomes_file: str | None, sample: int, search_budget: int,
          baselines: list[str] | None, out: str | None) -> tuple[list[BenchRow], Path]:
    """Evaluate the chosen genomes, a short search's genomes and every baseline; write the table."""
    from evaluators.evaluator import Evaluator  # torch loads here, not at `python -m evo --help`

    evaluator = Evaluator(config.workload, config.preset, config.evaluator, derive_seed(config.search.seed, "bench"),
                          name="bench")
    space = evaluator.workload.gene_space(evaluator.preset, evaluator.device_info())
    if config.genes:
        space = space.restrict(config.genes)
    chosen = [("genome", g) for g in (genomes_from_file(genomes_file, space) if genomes_file else [])]
    chosen += [("sample", g) for g in sample_genomes(space, sample, config.search.seed)]
    entries: list[tuple[str, str, Genome | None, EvalResult]] = []
    seen: set[str] = set()
    for source, genome in chosen:
        if genome.hash in seen:
            continue
        seen.add(genome.hash)
        entries.append((evaluator.workload.label(genome), source, genome, _report(evaluator.evaluate(genome.to_json()), genome.hash)))
    if search_budget > 0:
        for genome, result in run_search(evaluator, space, config, search_budget):
            entries.append((evaluator.workload.label(genome), "search", genome, _report(result, genome.hash)))
    available = sorted(evaluator.workload.baselines(evaluator.preset))
    for name in baselines if baselines is not None else (config.baselines or available):
        entries.append((f"baseline:{name}", "baseline", None, _report(evaluator.evaluate_baseline(name), name)))
    rows = make_rows(entries, evaluator.workload.reference_baseline)
    out_dir = Path(out) if out else Path(config.out_dir) / f"bench-{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    stamp = {**evaluator.describe(), "baselines_available": available}
    write(rows, out_dir, f"{config.workload}/{config.preset} on {stamp['device']}", stamp)
    return rows, out_dir


def _report(result: EvalResult, what: str) -> EvalResult:
    print(f"  {result.status:13s} {_fmt(result.latency_ms, '10.4g')} ms  {what}  {result.message[:120]}", flush=True)
    return result
