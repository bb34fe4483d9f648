"""The search benchmark: `python -m evo compare CONFIG --strategies agents,random,tpe --seeds N --budget E`.

Every strategy (`evo.bench.strategies`) runs on the config's gene space, preset and evaluator settings,
once per seed, with the plain `Evaluator` in this process. Results go through a content-addressed
cache in the benchmark directory, keyed by (workload, preset, device, evaluator settings, genome):
each genome is measured once and every strategy that proposes it gets the same measurement, so the
comparison costs the union of the genomes, and no strategy wins by timing noise. The cache is for
the benchmark only; a live search never reads it.

Per strategy: best latency at the budget, evaluations to come within 2% of the best latency any
strategy found (median and IQR over seeds; a seed that never gets there counts as never), the
evaluation time it would have cost uncached and its own proposing time. With `agents-warm`, each
seed's agents run is followed by a second agents run (another seed) warm-started from its lessons.
Written to the benchmark directory (table.md, best_so_far.png, results.json) and logged to MLflow.
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

import numpy as np

from evo.driver.config import RunConfig
from evo.evidence.journal import write_json
from evo.core.genome import Genome, canonical_json
from evo.core.records import EvalResult
from evo.core.seeds import derive_seed
from evo.bench.strategies import Trajectory, run_agents, strategies
from evo.workloads.base import DeviceInfo

WITHIN = 0.02  # "found": within 2% of the best latency any strategy found
WARM = "agents-warm"


class CachedEvaluator:
    """`evaluate(genome_json)` through a directory of results, one JSON file per (context, genome)."""

    def __init__(self, inner, cache_dir: Path, context: dict) -> None:
        self.inner = inner
        self.dir = Path(cache_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.context = canonical_json(context)
        self.hits = self.misses = 0

    def key(self, genome_hash: str) -> str:
        import hashlib

        return hashlib.sha256(f"{self.context}|{genome_hash}".encode()).hexdigest()[:24]

    def evaluate(self, genome_json: str) -> EvalResult:
        genome_hash = Genome.from_json(genome_json).hash
        path = self.dir / f"{self.key(genome_hash)}.json"
        if path.exists():
            self.hits += 1
            return EvalResult.from_dict(json.loads(path.read_text())["result"])
        self.misses += 1
        result = self.inner.evaluate(genome_json)
        write_json(path, {"context": json.loads(self.context), "genome": json.loads(genome_json),
                          "result": result.to_dict()})
        return result


@dataclass(frozen=True)
class Row:
    strategy: str
    seeds: int
    best_ms: tuple[float, float, float]  # median, q25, q75 of the best latency at the budget
    evals: tuple[float, float, float]  # median, q25, q75 of evaluations to within 2% (inf: never)
    reached: int  # seeds that got within 2%
    eval_s: float  # median over seeds of the evaluation time its genomes cost when measured
    propose_s: float  # median over seeds of the strategy's own time


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """Median, 25th and 75th percentile by nearest rank (no interpolation: 'never' (inf) stays inf)."""
    v = np.sort(np.asarray(values, dtype=float))
    pick = lambda q: float(v[min(len(v) - 1, max(0, int(math.ceil(q * len(v))) - 1))])  # noqa: E731
    return pick(0.5), pick(0.25), pick(0.75)


def summarise(runs: dict[str, list[Trajectory]], budget: int) -> tuple[float, list[Row]]:
    best = min((t.best_so_far(budget)[-1] for ts in runs.values() for t in ts), default=math.inf)
    rows = []
    for name, ts in runs.items():
        rows.append(Row(name, len(ts), quartiles([t.best_so_far(budget)[-1] for t in ts]),
                        quartiles([t.evals_to_reach(best * (1 + WITHIN)) for t in ts]),
                        sum(math.isfinite(t.evals_to_reach(best * (1 + WITHIN))) for t in ts),
                        float(np.median([sum(s.eval_s for s in t.steps if math.isfinite(s.eval_s)) for t in ts])),
                        float(np.median([t.propose_s for t in ts]))))
    return best, rows


def _fmt(x: float, budget: int, digits: int = 0) -> str:
    return f">{budget}" if not math.isfinite(x) else f"{x:.{digits}f}"


def table(rows: list[Row], best: float, budget: int) -> str:
    lines = [f"Best latency any strategy found: **{best:.3f} ms**; 'within 2%' means <= {best * (1 + WITHIN):.3f} ms.",
             "",
             "| strategy | seeds | best ms at budget, median [IQR] | evals to within 2%, median [IQR] | seeds within 2% "
             "| eval time s (median) | own time s (median) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r.strategy} | {r.seeds} | {r.best_ms[0]:.3f} [{r.best_ms[1]:.3f}, {r.best_ms[2]:.3f}] "
                     f"| {_fmt(r.evals[0], budget)} [{_fmt(r.evals[1], budget)}, {_fmt(r.evals[2], budget)}] "
                     f"| {r.reached}/{r.seeds} | {r.eval_s:.1f} | {r.propose_s:.2f} |")
    by = {r.strategy: r for r in rows}
    if "agents" in by:
        for other, target in (("random", 0.5), ("tpe", 0.8)):
            if other in by:
                a, o = by["agents"].evals[0], by[other].evals[0]
                ratio = a / o if math.isfinite(a) and math.isfinite(o) else math.nan
                verdict = "met" if ratio <= target else "missed"
                lines.append(f"\nagents / {other} (median evaluations to within 2%): "
                             f"{_fmt(a, budget)} / {_fmt(o, budget)} = {ratio:.2f} (target <= {target}: {verdict})")
    return "\n".join(lines) + "\n"


def warm_table(pairs: list[tuple[Trajectory, Trajectory]], budget: int) -> str:
    """First run (agents) vs a second run warm-started from its lessons: evaluations to the first run's best."""
    first = [t.evals_to_reach(t.best_so_far(budget)[-1]) for t, _ in pairs]
    second = [w.evals_to_reach(t.best_so_far(budget)[-1]) for t, w in pairs]
    second2 = [w.evals_to_reach(t.best_so_far(budget)[-1] * (1 + WITHIN)) for t, w in pairs]
    f, s, s2 = quartiles(first), quartiles(second), quartiles(second2)
    ratio = s[0] / f[0] if math.isfinite(s[0]) and f[0] else math.nan
    return (f"\n| warm start ({len(pairs)} seeds) | evals, median [IQR] |\n| --- | ---: |\n"
            f"| first run: to its own best | {_fmt(f[0], budget)} [{_fmt(f[1], budget)}, {_fmt(f[2], budget)}] |\n"
            f"| warm-started run: to the first run's best | {_fmt(s[0], budget)} [{_fmt(s[1], budget)}, "
            f"{_fmt(s[2], budget)}] |\n"
            f"| warm-started run: to within 2% of it | {_fmt(s2[0], budget)} [{_fmt(s2[1], budget)}, "
            f"{_fmt(s2[2], budget)}] |\n\n"
            f"warm / first: {ratio:.2f} (target <= 0.3: {'met' if ratio <= 0.3 else 'missed'}). The warm-started run "
            f"re-measures the lessons' best genomes first; through the shared cache a re-measurement returns the "
            f"first measurement, so this shows that the lessons are used, not timing noise on a second run.\n")


def plot(runs: dict[str, list[Trajectory]], budget: int, best: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    x = np.arange(1, budget + 1)
    for name, ts in runs.items():
        curves = np.vstack([t.best_so_far(budget) for t in ts])
        curves[~np.isfinite(curves)] = np.nan
        median = np.nanmedian(curves, axis=0)
        q25, q75 = np.nanpercentile(curves, 25, axis=0), np.nanpercentile(curves, 75, axis=0)
        (line,) = ax.plot(x, median, label=f"{name} (median of {len(ts)})")
        ax.fill_between(x, q25, q75, color=line.get_color(), alpha=0.18)
    ax.axhline(best * (1 + WITHIN), color="grey", ls="--", lw=1, label="within 2% of the best found")
    ax.set_xlabel("evaluations")
    ax.set_ylabel("best latency so far (ms)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def compare(config: RunConfig, names: list[str], seeds: int, budget: int, bench_dir: Path | None = None,
            evaluator=None, out: TextIO = sys.stdout, log_mlflow: bool | None = None) -> dict:
    """Run the benchmark; returns what results.json holds. `evaluator` (tests: the synthetic one)
    replaces the real in-process Evaluator."""
    from evo.workloads import get_workload

    available = strategies(config.search)
    unknown = [n for n in names if n not in available and n != WARM]
    if unknown or not names:
        raise ValueError(f"unknown strategies {unknown}; allowed: {[*available, WARM]}")
    if seeds < 1 or budget < 1:
        raise ValueError(f"--seeds and --budget must be >= 1, got {seeds} and {budget}")
    started = time.monotonic()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    bench_dir = Path(bench_dir or Path(config.out_dir) / f"compare-{config.name}-{stamp}").resolve()
    bench_dir.mkdir(parents=True, exist_ok=True)
    workload = get_workload(config.workload)
    preset = workload.presets()[config.preset]
    if evaluator is None:
        from evaluators.evaluator import Evaluator

        evaluator = Evaluator(config.workload, config.preset, config.evaluator, derive_seed(config.search.seed, "compare"),
                              "compare-0", tuple(range(config.evaluators.threads)))
    info = evaluator.device_info() if hasattr(evaluator, "device_info") else DeviceInfo("cpu", "synthetic", 1)
    space = workload.gene_space(preset, info)
    if config.genes:
        space = space.restrict(config.genes)
    context = {"workload": config.workload, "preset": config.preset, "device": f"{info.kind}:{info.name}",
               "threads": info.threads, "evaluator": config.evaluator.to_dict()}
    cached = CachedEvaluator(evaluator, bench_dir / "cache", context)
    print(f"benchmark directory: {bench_dir}\nstrategies {names}, {seeds} seeds, budget {budget} evaluations, "
          f"on {context['device']}", file=out, flush=True)

    runs: dict[str, list[Trajectory]] = {}
    warm_pairs: list[tuple[Trajectory, Trajectory]] = []
    for name in names:
        for i in range(seeds):
            seed = config.search.seed + i
            if name == WARM:
                first = next((t for t in runs.get("agents", []) if t.seed == seed), None)
                first = first or available["agents"](space, cached, budget, seed)
                lessons = replace(first.lessons, preset=config.preset)
                second = run_agents(space, cached, budget, derive_seed(seed, "warm"), config.search, lessons, WARM)
                warm_pairs.append((first, second))
                trajectory = second
            else:
                trajectory = available[name](space, cached, budget, seed)
            runs.setdefault(name, []).append(trajectory)
            print(f"  {name:14s} seed {seed:3d}: best {trajectory.best_so_far(budget)[-1]:8.3f} ms "
                  f"| cache {cached.hits} hits, {cached.misses} measured | {time.monotonic() - started:6.0f} s",
                  file=out, flush=True)

    best, rows = summarise(runs, budget)
    text = (f"Search benchmark: `{config.workload}` preset `{config.preset}` on {context['device']}, "
            f"{len(space.genes)} genes, budget {budget} evaluations, {seeds} seeds; "
            f"{cached.misses} distinct genomes measured.\n\n" + table(rows, best, budget))
    if warm_pairs:
        text += warm_table(warm_pairs, budget)
    (bench_dir / "table.md").write_text(text)
    plot(runs, budget, best, bench_dir / "best_so_far.png",
         f"{config.workload}/{config.preset}: best-so-far vs evaluations (median, IQR band over {seeds} seeds)")
    results = {"config": config.to_dict(), "strategies": names, "seeds": seeds, "budget": budget, "context": context,
               "best_ms": best, "measured": cached.misses, "cache_hits": cached.hits,
               "wall_s": time.monotonic() - started,
               "rows": [r.__dict__ for r in rows], "trajectories": [t.to_dict() for ts in runs.values() for t in ts]}
    write_json(bench_dir / "results.json", results)
    print("\n" + text, file=out, flush=True)
    if log_mlflow if log_mlflow is not None else config.mlflow.enabled:
        results["mlflow_run_id"] = _log_mlflow(config, bench_dir, rows, best, names, seeds, budget, out)
    print(f"benchmark directory: {bench_dir}", file=out, flush=True)
    return results


def _log_mlflow(config: RunConfig, bench_dir: Path, rows: list[Row], best: float, names: list[str], seeds: int,
                budget: int, out: TextIO) -> str | None:
    """One MLflow run (experiment `<experiment>-compare`, or the config's experiment if its name ends in
    'compare') with the table, plot and results as artifacts."""
    try:
        import mlflow

        from evo.evidence.mlflow.outbox import tracking_uri

        mlflow.set_tracking_uri(tracking_uri(config.mlflow.tracking_uri))
        name = config.mlflow.experiment
        mlflow.set_experiment(name if name.endswith("compare") else f"{name}-compare")
        with mlflow.start_run(run_name=bench_dir.name) as run:
            mlflow.log_params({"workload": config.workload, "preset": config.preset, "strategies": ",".join(names),
                               "seeds": seeds, "budget": budget, "bench_dir": str(bench_dir)})
            metrics = {"best_ms": best}
            for r in rows:
                metrics[f"{r.strategy}.best_ms_median"] = r.best_ms[0]
                if math.isfinite(r.evals[0]):
                    metrics[f"{r.strategy}.evals_to_2pct_median"] = r.evals[0]
                metrics[f"{r.strategy}.seeds_within_2pct"] = r.reached
            mlflow.log_metrics({k.replace("+", "_plus_"): v for k, v in metrics.items()})
            for name in ("table.md", "best_so_far.png", "results.json"):
                mlflow.log_artifact(str(bench_dir / name))
            return run.info.run_id
    except Exception as exc:  # the benchmark's files are on disk; MLflow is a copy
        print(f"warning: logging the benchmark to MLflow failed: {type(exc).__name__}: {exc}", file=out, flush=True)
        return None
