"""`python -m evo bench`: genomes and every baseline evaluated in this one process, side by side.

No Ray and no MLflow on the import chain (GPU boxes often have neither): the plain
`evaluators.judge.evaluator.Evaluator` builds, checks and times each engine; an optional short search runs
with the in-process agents (`operators.team.LocalTeam`), intensifying as a run does. Writes
results.parquet, table.md and table.json under the output folder; logs to MLflow only when it is
importable and enabled.

Every speedup claimed is paired (`evo.bench.paired`, with `search.intensify`'s calls, warm-up and
minimum effect): after the single timings, each engine (the genomes given or sampled, and the short
search's best) is re-timed interleaved against every baseline that passed, in one run per engine, and
the reference baseline against the other baselines. The table gives the speedup against the reference
as a ratio with its 95% interval and the verdict; table.json every baseline's (`speedup_ci`:
baseline -> [low, high], `speedup_paired`, `verdicts`) and every re-timing record. With
`search.intensify.enabled: false` nothing is re-timed and only the single timings are shown.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from evo.driver.config import RunConfig
from evo.driver.rundir import search_space
from evo.core.genome import Genome, GeneSpace
from evo.core.records import EvalResult
from evo.core.retiming import PairedTiming
from evo.core.seeds import derive_seed
from evo.bench.paired import LocalRetimer, can_retime, retime_against, speedup


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
    genome_hash: str = ""  # the engine's identity in the re-timing records ("baseline:<name>" for baselines)
    # From the paired re-timing against `reference` (nan / "" when not re-timed): its latency / this one's
    paired_speedup: float = math.nan
    paired_low: float = math.nan  # the 95% interval of paired_speedup
    paired_high: float = math.nan
    paired_verdict: str = ""  # this engine against the reference: faster, slower, equal (within noise), failed


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
    """A short search, agents and evaluator in this process: ask, evaluate, tell, until done; its
    challengers re-timed paired in the same evaluator (`search.intensify`), as in a run."""
    from evo.core.search import Search
    from operators.team import LocalTeam

    settings = replace(config.search, max_evaluations=budget)
    retimer = LocalRetimer(evaluator) if can_retime(evaluator) else None
    search = Search(space, settings, LocalTeam(list(settings.agents), space, settings.seed), retimer=retimer)
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


def reference_of(entries: list[tuple[str, str, Genome | None, EvalResult]], reference_baseline: str | None) -> str:
    """"baseline:<name>" the speedups are against: `reference_baseline` (the workload's: what a user runs
    today) when it passed, else the fastest baseline that passed by its single timing; "" if none passed."""
    baselines = {n: r.latency_ms for n, _, _, r in entries if r.ok and n.startswith("baseline:")}
    wanted = f"baseline:{reference_baseline}" if reference_baseline else None
    return wanted if wanted in baselines else min(baselines, key=baselines.get, default="")


def make_rows(entries: list[tuple[str, str, Genome | None, EvalResult]],
              reference_baseline: str | None = None, retimings: Sequence[PairedTiming] = ()) -> list[BenchRow]:
    """Table rows with roofline fractions and speedups against the reference (`reference_of`): from the
    single timings, and from the paired `retimings` where they timed the row's engine against it."""
    reference = reference_of(entries, reference_baseline)
    ref_ms = next((r.latency_ms for n, _, _, r in entries if n == reference), math.nan)
    rows = []
    for name, source, genome, r in entries:
        median = r.latency_ms if r.ok else math.nan
        paired = speedup(retimings, r.genome_hash, reference) if reference and r.ok else None
        rows.append(BenchRow(
            engine=name, source=source, status=r.status, median_ms=median,
            iqr_ms=r.latency_spread_ms if r.ok else math.nan, max_rel_error=r.max_rel_error,
            roofline_floor_ms=r.roofline_floor_ms, fraction_of_roofline=r.roofline_floor_ms / median,
            speedup=ref_ms / median, reference=reference.removeprefix("baseline:"),
            build_s=r.build_s, message=r.message[:300], genome=genome.to_json() if genome else "",
            genome_hash=r.genome_hash,
            **({"paired_speedup": paired.estimate, "paired_low": paired.low, "paired_high": paired.high,
                "paired_verdict": paired.verdict} if paired else {})))
    return sorted(rows, key=lambda row: (math.isnan(row.median_ms), row.median_ms))


def _fmt(x: float, spec: str) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def markdown(rows: list[BenchRow], title: str) -> str:
    """The table as Markdown: engine, status, median, IQR, error, fraction of roofline, speedup from the
    single timings, and the paired speedup [95% interval] with its verdict."""
    ref = next((r.reference for r in rows if r.reference), "") or "none"
    lines = [f"### {title}", "",
             f"| engine | source | status | median ms | IQR ms | max rel err | fraction of roofline | speedup vs {ref} "
             f"(single timings) | paired speedup vs {ref} [95%] | verdict |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        paired = (f"{_fmt(r.paired_speedup, '.2f')}x [{_fmt(r.paired_low, '.2f')}, {_fmt(r.paired_high, '.2f')}]"
                  if r.paired_verdict else "—")
        verdict = {"": "—", "equal": "equal within noise"}.get(r.paired_verdict, r.paired_verdict)
        lines.append(f"| {r.engine} | {r.source} | {r.status} | {_fmt(r.median_ms, '.4g')} | {_fmt(r.iqr_ms, '.3g')} | "
                     f"{_fmt(r.max_rel_error, '.2e')} | {_fmt(r.fraction_of_roofline, '.3f')} | {_fmt(r.speedup, '.2f')}x "
                     f"| {paired} | {verdict} |")
    if not any(r.paired_verdict for r in rows):
        lines.append("\nNo paired re-timing (search.intensify.enabled is false, or fewer than one engine and one"
                     " baseline passed): the speedups above are single timings.")
    return "\n".join(lines) + "\n"


def write(rows: list[BenchRow], out_dir: Path, title: str, stamp: dict, retimings: Sequence[PairedTiming] = ()) -> None:
    """results.parquet (one row per engine), table.md and table.json (each row with its paired speedup
    against every baseline it was re-timed with, and every re-timing record)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir.mkdir(parents=True, exist_ok=True)
    records = [asdict(r) for r in rows]
    pq.write_table(pa.Table.from_pylist(records), out_dir / "results.parquet")
    (out_dir / "table.md").write_text(markdown(rows, title))
    baselines = sorted({r.genome_hash for r in rows if r.source == "baseline"})
    for record in records:
        paired = {b: speedup(retimings, record["genome_hash"], b) for b in baselines}
        paired = {b: s for b, s in paired.items() if s is not None}
        record["speedup_ci"] = {b.removeprefix("baseline:"): [s.low, s.high] for b, s in paired.items()}
        record["speedup_paired"] = {b.removeprefix("baseline:"): s.estimate for b, s in paired.items()}
        record["verdicts"] = {b.removeprefix("baseline:"): s.verdict for b, s in paired.items()}
    table = {"title": title, "environment": stamp, "rows": records, "retimings": [t.to_dict() for t in retimings]}
    (out_dir / "table.json").write_text(json.dumps(_finite(table), indent=1))


def _finite(value):
    """`value` with every non-finite float as None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


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
            if math.isfinite(r.paired_speedup):
                mlflow.log_metrics({f"paired_speedup_{i:02d}": r.paired_speedup, f"paired_low_{i:02d}": r.paired_low,
                                    f"paired_high_{i:02d}": r.paired_high})
        mlflow.log_artifacts(str(out_dir))
        return f"MLflow run {run.info.run_id}"


def bench(config: RunConfig, genomes_file: str | None, sample: int, search_budget: int,
          baselines: list[str] | None, out: str | None) -> tuple[list[BenchRow], Path]:
    """Evaluate the chosen genomes, a short search's genomes and every baseline; write the table."""
    from evaluators.judge.evaluator import Evaluator  # torch loads here, not at `python -m evo --help`

    evaluator = Evaluator(config.workload, config.preset, config.evaluator, derive_seed(config.search.seed, "bench"),
                          name="bench")
    space = search_space(config, evaluator.workload, evaluator.preset, evaluator.device_info())
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
    retimings = retime_entries(evaluator, entries, config) if config.search.intensify.enabled else []
    rows = make_rows(entries, evaluator.workload.reference_baseline, retimings)
    out_dir = Path(out) if out else Path(config.out_dir) / f"bench-{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    stamp = {**evaluator.describe(), "baselines_available": available}
    write(rows, out_dir, f"{config.workload}/{config.preset} on {stamp['device']}", stamp, retimings)
    return rows, out_dir


def retime_entries(evaluator, entries: list[tuple[str, str, Genome | None, EvalResult]],
                   config: RunConfig) -> list[PairedTiming]:
    """The paired re-timings behind the table's claims: every passing genome given or sampled and the
    search's best (by its single timing) against every passing baseline; the reference baseline against
    the others."""
    reference = reference_of(entries, evaluator.workload.reference_baseline)
    ok_baselines = [n for n, source, _, r in entries if source == "baseline" and r.ok]
    chosen = [(g, r) for _, source, g, r in entries if source in ("genome", "sample") and r.ok]
    searched = [(g, r) for _, source, g, r in entries if source == "search" and r.ok]
    if searched:
        best = min(searched, key=lambda e: e[1].latency_ms)
        chosen += [best] if best[0].hash not in {g.hash for g, _ in chosen} else []
    if not ok_baselines or not chosen:
        return []
    print(f"paired re-timing: {len(chosen)} engine(s) against {len(ok_baselines)} baseline(s), "
          f"{config.search.intensify.calls} paired calls each", flush=True)
    settings = config.search.intensify
    timings = retime_against(evaluator, [g.to_json() for g, _ in chosen], ok_baselines, settings)
    return timings + retime_against(evaluator, [reference], [b for b in ok_baselines if b != reference], settings)


def _report(result: EvalResult, what: str) -> EvalResult:
    print(f"  {result.status:13s} {_fmt(result.latency_ms, '10.4g')} ms  {what}  {result.message[:120]}", flush=True)
    return result
