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

"Within 2%" is judged by paired re-timing when the evaluator can (`evo.bench.paired`; the real one,
with `search.intensify.enabled`), not by single timings, whose noise on a shared machine is larger
than 2%: each run's best at the budget (by its single timing; distinct genomes once) is re-timed,
interleaved, against the best found (the genome with the best single timing, replaced once by the
fastest genome a first round showed faster than it), and a run's best is **within 2%** when that
re-timing does not show it more than 2% slower: its verdict at a 2% minimum effect is `equal` or
`faster`, that is the 95% interval of (its latency / the best's) starts below 1.02. An A/A pair (the
same engine twice) passes this rule 19 times in 20, a rule on the interval's upper end (<= 1.02)
would fail it whenever the noise is wider than 2%. Evaluations to within 2% (paired) count until a
run first evaluated a genome so confirmed (the re-timed ones and the best found). The agents runs
intensify as in a run (their challengers re-timed paired before a win counts); every re-timing is in
results.json. The single-timing columns stay, labelled so.
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
from evo.driver.rundir import search_space
from evo.evidence.journal import write_json
from evo.core.genome import Genome, canonical_json
from evo.core.records import EvalResult
from evo.core.retiming import EQUAL, FASTER, IntensifySettings, PairedTiming
from evo.core.seeds import derive_seed
from evo.bench.paired import can_retime
from evo.bench.strategies import Trajectory, run_agents, strategies
from evo.workloads.base import DeviceInfo

WITHIN = 0.02  # "found": within 2% of the best latency any strategy found
WARM = "agents-warm"
RULE = ("within 2% (paired): the re-timing of a run's best against the best found does not show it more than 2% "
        "slower (verdict equal or faster at a 2% minimum effect: the 95% interval of its latency / the best's "
        "starts below 1.02)")


class CachedEvaluator:
    """`evaluate(genome_json)` through a directory of results, one JSON file per (context, genome)."""

    def __init__(self, inner, cache_dir: Path, context: dict) -> None:
        self.inner = inner
        self.dir = Path(cache_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.context = canonical_json(context)
        self.hits = self.misses = 0
        self.genomes: dict[str, str] = {}  # hash -> genome JSON of every genome asked for (to re-time them)

    def key(self, genome_hash: str) -> str:
        import hashlib

        return hashlib.sha256(f"{self.context}|{genome_hash}".encode()).hexdigest()[:24]

    def evaluate(self, genome_json: str) -> EvalResult:
        genome_hash = Genome.from_json(genome_json).hash
        self.genomes.setdefault(genome_hash, genome_json)
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
    # Judged by paired re-timing against the best found (`PairedBests`; nan and -1 when not re-timed):
    paired_ratio: tuple[float, float, float] = (math.nan,) * 3  # median, q25, q75 of (run's best / best found)
    paired_evals: tuple[float, float, float] = (math.nan,) * 3  # evaluations to within 2% (paired; inf: never)
    paired_reached: int = -1  # seeds whose best is within 2% (paired)
    retimings: int = 0  # paired re-timings the strategy ran itself (the agents' intensification), all seeds


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """Median, 25th and 75th percentile by nearest rank (no interpolation: 'never' (inf) stays inf)."""
    v = np.sort(np.asarray(values, dtype=float))
    pick = lambda q: float(v[min(len(v) - 1, max(0, int(math.ceil(q * len(v))) - 1))])  # noqa: E731
    return pick(0.5), pick(0.25), pick(0.75)


@dataclass(frozen=True)
class PairedBests:
    """The runs' bests re-timed against the best found: `timings[h]` has a = h, b = `reference`."""

    reference: str  # genome hash of the best found
    timings: dict[str, PairedTiming]
    rounds: int  # 2 when a first round found a genome faster than the first reference

    def ratio(self, genome_hash: str) -> float:
        """Its latency / the best found's, paired (1 for the best found itself; inf: not re-timed or failed)."""
        if genome_hash == self.reference:
            return 1.0
        t = self.timings.get(genome_hash)
        return t.ratio if t is not None and math.isfinite(t.ratio) else math.inf

    def within(self, genome_hash: str) -> bool:
        """Within 2% of the best found by `RULE`."""
        t = self.timings.get(genome_hash)
        return genome_hash == self.reference or (t is not None and t.verdict in (EQUAL, FASTER))

    def evals_to_within(self, trajectory: Trajectory, budget: int) -> float:
        """Evaluations until the run first evaluated a genome within 2% (1-based; inf if never)."""
        for i, step in enumerate(trajectory.steps[:budget], 1):
            if step.status == "ok" and self.within(step.genome_hash):
                return float(i)
        return math.inf

    def to_dict(self) -> dict:
        return {"rule": RULE, "reference": self.reference, "rounds": self.rounds,
                "timings": [t.to_dict() for t in self.timings.values()]}


def retime_bests(judge, runs: dict[str, list[Trajectory]], budget: int, genomes: dict[str, str],
                 settings: IntensifySettings, out: TextIO) -> PairedBests | None:
    """Each run's best (distinct genomes) re-timed paired against the best found; when some genome comes
    out faster than it by 2%, once more against the fastest of those. None when no run found one."""
    ends = [(t.best_so_far(budget)[-1], t.best_hash(budget)) for ts in runs.values() for t in ts]
    ends = [(ms, h) for ms, h in ends if h]
    if not ends:
        return None
    reference = min(ends)[1]
    bests = sorted({h for _, h in ends})
    print(f"paired re-timing: {len(bests) - 1} distinct best(s) against the best found {reference[:12]}, "
          f"{settings.calls} paired calls each", file=out, flush=True)

    def against(reference: str) -> dict[str, PairedTiming]:
        timings = {}
        for h in bests:
            if h != reference:
                timings[h] = judge.retime([genomes[h], genomes[reference]], calls=settings.calls,
                                          warmup=settings.warmup, min_effect=WITHIN, reason="compare")[0]
                print(f"  paired  {timings[h].describe()}", file=out, flush=True)
        return timings

    timings = against(reference)
    faster = [t for t in timings.values() if t.verdict == FASTER]
    if not faster:
        return PairedBests(reference, timings, 1)
    reference = min(faster, key=lambda t: (t.ratio, t.a)).a
    print(f"  {reference[:12]} is faster than the best found: re-timing against it", file=out, flush=True)
    return PairedBests(reference, against(reference), 2)


def summarise(runs: dict[str, list[Trajectory]], budget: int,
              paired: PairedBests | None = None) -> tuple[float, list[Row]]:
    best = min((t.best_so_far(budget)[-1] for ts in runs.values() for t in ts), default=math.inf)
    rows = []
    for name, ts in runs.items():
        judged = {}
        if paired is not None:
            judged = {"paired_ratio": quartiles([paired.ratio(t.best_hash(budget)) for t in ts]),
                      "paired_evals": quartiles([paired.evals_to_within(t, budget) for t in ts]),
                      "paired_reached": sum(paired.within(t.best_hash(budget)) for t in ts)}
        rows.append(Row(name, len(ts), quartiles([t.best_so_far(budget)[-1] for t in ts]),
                        quartiles([t.evals_to_reach(best * (1 + WITHIN)) for t in ts]),
                        sum(math.isfinite(t.evals_to_reach(best * (1 + WITHIN))) for t in ts),
                        float(np.median([sum(s.eval_s for s in t.steps if math.isfinite(s.eval_s)) for t in ts])),
                        float(np.median([t.propose_s for t in ts])), **judged,
                        retimings=sum(len(t.retimings) for t in ts)))
    return best, rows


def _fmt(x: float, budget: int, digits: int = 0) -> str:
    return f">{budget}" if not math.isfinite(x) else f"{x:.{digits}f}"


def _ratio(x: float) -> str:
    return f"{x:.3f}" if math.isfinite(x) else "—"


def table(rows: list[Row], best: float, budget: int, paired: PairedBests | None = None) -> str:
    judged = paired is not None
    lines = [f"Best latency any strategy found (single timing): **{best:.3f} ms**; 'within 2%' by single timings "
             f"means <= {best * (1 + WITHIN):.3f} ms" + (f"; {RULE}, against `{paired.reference[:16]}`." if judged
                                                          else "; not re-timed (the evaluator cannot re-time paired)."),
             "",
             "| strategy | seeds | best ms at budget, median [IQR] | evals to within 2% (single timings), median [IQR] "
             "| seeds within 2% (single timings) | best / best found (paired), median [IQR] "
             "| evals to within 2% (paired), median [IQR] | seeds within 2% (paired) | re-timings in the search "
             "| eval time s (median) | own time s (median) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        pr, pe = r.paired_ratio, r.paired_evals
        lines.append(f"| {r.strategy} | {r.seeds} | {r.best_ms[0]:.3f} [{r.best_ms[1]:.3f}, {r.best_ms[2]:.3f}] "
                     f"| {_fmt(r.evals[0], budget)} [{_fmt(r.evals[1], budget)}, {_fmt(r.evals[2], budget)}] "
                     f"| {r.reached}/{r.seeds} "
                     + (f"| {_ratio(pr[0])} [{_ratio(pr[1])}, {_ratio(pr[2])}] "
                        f"| {_fmt(pe[0], budget)} [{_fmt(pe[1], budget)}, {_fmt(pe[2], budget)}] "
                        f"| {r.paired_reached}/{r.seeds} " if r.paired_reached >= 0 else "| — | — | — ")
                     + f"| {r.retimings} | {r.eval_s:.1f} | {r.propose_s:.2f} |")
    by = {r.strategy: r for r in rows}
    if "agents" in by:
        for other, target in (("random", 0.5), ("tpe", 0.8)):
            if other in by:
                use_paired = by["agents"].paired_reached >= 0
                a, o = (by["agents"].paired_evals[0], by[other].paired_evals[0]) if use_paired else \
                    (by["agents"].evals[0], by[other].evals[0])
                if math.isfinite(a) and not math.isfinite(o):  # the other's median never got there: a bound
                    bound = a / (budget + 1)
                    ratio_text = f"<= {bound:.2f}"
                    verdict = "met" if bound <= target else "not decided at this budget"
                else:
                    ratio = a / o if math.isfinite(a) else math.nan
                    ratio_text, verdict = f"{ratio:.2f}", "met" if ratio <= target else "missed"
                lines.append(f"\nagents / {other} (median evaluations to within 2%, "
                             f"{'paired' if use_paired else 'single timings'}): "
                             f"{_fmt(a, budget)} / {_fmt(o, budget)} = {ratio_text} (target <= {target}: {verdict})")
    return "\n".join(lines) + "\n"


def bests_table(paired: PairedBests, runs: dict[str, list[Trajectory]], budget: int) -> str:
    """One line per distinct run's best: who ended on it, its single timing, its paired ratio to the best
    found [95%] and the verdict."""
    ends: dict[str, list[str]] = {}
    single: dict[str, float] = {}
    for name, ts in runs.items():
        for t in ts:
            h = t.best_hash(budget)
            if h:
                ends.setdefault(h, []).append(f"{name}/{t.seed}")
                single[h] = t.best_so_far(budget)[-1]
    lines = ["", f"Each run's best re-timed paired against the best found (`{paired.reference[:16]}`, "
                 f"{single.get(paired.reference, math.nan):.3f} ms single){' in a second round' if paired.rounds == 2 else ''}:",
             "", "| genome | runs ending on it (strategy/seed) | single ms | latency / best found [95%] | within 2% |",
             "| --- | --- | ---: | ---: | --- |"]
    for h in sorted(ends, key=lambda h: (paired.ratio(h), h)):
        t = paired.timings.get(h)
        if h == paired.reference:
            ratio, verdict = "1 (the best found)", "yes"
        elif t is None or t.verdict == "failed":
            ratio, verdict = "failed" if t else "not re-timed", "no" + (f" ({t.message[:80]})" if t else "")
        else:
            word = "equal within noise" if t.verdict == EQUAL else t.verdict
            ratio = f"{t.ratio:.3f} [{t.low:.3f}, {t.high:.3f}]"
            verdict = f"{'yes' if paired.within(h) else 'no'} ({word})"
        lines.append(f"| `{h[:16]}` | {', '.join(ends[h])} | {single[h]:.3f} | {ratio} | {verdict} |")
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
        from evaluators.judge.evaluator import Evaluator

        evaluator = Evaluator(config.workload, config.preset, config.evaluator, derive_seed(config.search.seed, "compare"),
                              "compare-0", tuple(range(config.evaluators.threads)))
    info = evaluator.device_info() if hasattr(evaluator, "device_info") else DeviceInfo("cpu", "synthetic", 1)
    space = search_space(config, workload, preset, info)
    context = {"workload": config.workload, "preset": config.preset, "device": f"{info.kind}:{info.name}",
               "threads": info.threads, "evaluator": config.evaluator.to_dict()}
    cached = CachedEvaluator(evaluator, bench_dir / "cache", context)
    judge = evaluator if config.search.intensify.enabled and can_retime(evaluator) else None  # re-times, uncached
    available = strategies(config.search, judge)
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
                second = run_agents(space, cached, budget, derive_seed(seed, "warm"), config.search, lessons, WARM,
                                    judge=judge)
                warm_pairs.append((first, second))
                trajectory = second
            else:
                trajectory = available[name](space, cached, budget, seed)
            runs.setdefault(name, []).append(trajectory)
            retimed = (f" | re-timed {len(trajectory.retimings)}: {trajectory.incumbent[:12] or '-'} confirmed"
                       if judge is not None and trajectory.strategy.startswith("agents") else "")
            print(f"  {name:14s} seed {seed:3d}: best {trajectory.best_so_far(budget)[-1]:8.3f} ms "
                  f"| cache {cached.hits} hits, {cached.misses} measured{retimed} | {time.monotonic() - started:6.0f} s",
                  file=out, flush=True)

    paired_started = time.monotonic()
    paired = (retime_bests(judge, runs, budget, cached.genomes, config.search.intensify, out)
              if judge is not None else None)
    paired_s = time.monotonic() - paired_started
    best, rows = summarise(runs, budget, paired)
    text = (f"Search benchmark: `{config.workload}` preset `{config.preset}` on {context['device']}, "
            f"{len(space.genes)} genes, budget {budget} evaluations, {seeds} seeds; "
            f"{cached.misses} distinct genomes measured.\n\n" + table(rows, best, budget, paired))
    if paired is not None:
        text += bests_table(paired, runs, budget)
    if warm_pairs:
        text += warm_table(warm_pairs, budget)
    (bench_dir / "table.md").write_text(text)
    plot(runs, budget, best, bench_dir / "best_so_far.png",
         f"{config.workload}/{config.preset}: best-so-far vs evaluations (median, IQR band over {seeds} seeds)")
    results = {"config": config.to_dict(), "strategies": names, "seeds": seeds, "budget": budget, "context": context,
               "best_ms": best, "measured": cached.misses, "cache_hits": cached.hits,
               "wall_s": time.monotonic() - started,
               "paired": {**paired.to_dict(), "wall_s": paired_s} if paired is not None else None,
               "search_retimings": sum(len(t.retimings) for ts in runs.values() for t in ts),
               "search_retime_s": sum(t.retime_s for ts in runs.values() for t in ts),
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
                if r.paired_reached >= 0:
                    metrics[f"{r.strategy}.seeds_within_2pct_paired"] = r.paired_reached
                    if math.isfinite(r.paired_ratio[0]):
                        metrics[f"{r.strategy}.paired_ratio_median"] = r.paired_ratio[0]
                    if math.isfinite(r.paired_evals[0]):
                        metrics[f"{r.strategy}.evals_to_2pct_paired_median"] = r.paired_evals[0]
            mlflow.log_metrics({k.replace("+", "_plus_"): v for k, v in metrics.items()})
            for name in ("table.md", "best_so_far.png", "results.json"):
                mlflow.log_artifact(str(bench_dir / name))
            return run.info.run_id
    except Exception as exc:  # the benchmark's files are on disk; MLflow is a copy
        print(f"warning: logging the benchmark to MLflow failed: {type(exc).__name__}: {exc}", file=out, flush=True)
        return None
