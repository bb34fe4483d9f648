"""The search benchmark: `python -m evo compare CONFIG --strategies agents,random,tpe --seeds N --budget E`
(or `--wall-s S` instead of `--budget E`).

Every strategy (`evo.bench.strategies`) runs on the config's gene space, preset and evaluator settings,
once per seed, with the plain `Evaluator` in this process. Results go through a content-addressed
cache in the benchmark directory, keyed by (workload, preset, device, evaluator settings, genome):
each genome is measured once and every strategy that proposes it gets the same measurement, so the
comparison costs the union of the genomes, and no strategy wins by timing noise. The cache is for
the benchmark only; a live search never reads it. Call workloads and generation workloads (whose
result's latency is the run's objective, ms per output token by default) run alike.

The budget (`Budget`) is equal for every run: `--budget E` evaluations (distinct genomes), or `--wall-s S`
seconds of charged time. A run is charged (`evo.bench.strategies.Meter`) what each of its evaluations
cost when it was measured (a cached result keeps the cost it had then, so every strategy pays the same for
the same genome), its own time (proposing, learning) and the wall time of the paired re-timings it ran
itself (the agents' intensification); nothing starts once its charge reaches S, what started before
finishes and counts. Each run's charged seconds are reported; with a wall budget a run's trajectory is its
evaluations up to where it stopped.

Per strategy: best latency at the budget, evaluations to come within 2% of the best latency any
strategy found (median and IQR over seeds; a seed that never gets there counts as never), the
evaluation time it would have cost uncached, its own proposing time and its charged seconds. With
`agents-warm`, each seed's agents run is followed by a second agents run (another seed) warm-started
from its lessons. Written to the benchmark directory (table.md, best_so_far.png, results.json) and
logged to MLflow.

**Against the default genome.** Every strategy evaluates the gene space's default genome first; each
distinct run's best is re-timed paired against it (`evo.bench.paired.retime_against_default`, the
intensify settings' calls, warm-up and minimum effect), so each run has a speedup over the default
(default's latency / its best's) with its 95% interval, and each strategy the median over its seeds. A
best that is the default genome is a speedup of 1.0 with no interval. The speedups by single timings
stand beside them, labelled so.

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
import warnings
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
from evo.bench.paired import AgainstDefault, Speedup, can_retime, retime_against_default
from evo.bench.strategies import Trajectory, run_agents, strategies
from evo.workloads.base import DeviceInfo

WITHIN = 0.02  # "found": within 2% of the best latency any strategy found
WARM = "agents-warm"
RULE = ("within 2% (paired): the re-timing of a run's best against the best found does not show it more than 2% "
        "slower (verdict equal or faster at a 2% minimum effect: the 95% interval of its latency / the best's "
        "starts below 1.02)")
WALL_EVALUATIONS = 10_000  # under a wall budget, a guard on evaluations per run (no real workload gets there)


@dataclass(frozen=True)
class Budget:
    """What each run may spend: `evaluations` (distinct genomes) or `wall_s` (charged seconds); exactly one."""

    evaluations: int | None = None
    wall_s: float | None = None

    def __post_init__(self) -> None:
        if (self.evaluations is None) == (self.wall_s is None):
            raise ValueError(f"give exactly one budget: --budget E (evaluations per run) or --wall-s S (charged "
                             f"seconds per run); got --budget {self.evaluations} and --wall-s {self.wall_s}")
        if self.evaluations is not None and not self.evaluations >= 1:
            raise ValueError(f"--budget must be >= 1 evaluation, got {self.evaluations}")
        if self.wall_s is not None and not 0 < self.wall_s < math.inf:
            raise ValueError(f"--wall-s must be a number of seconds > 0, got {self.wall_s}")

    @property
    def kind(self) -> str:
        return "evaluations" if self.evaluations is not None else "seconds"

    @property
    def max_evaluations(self) -> int:
        return self.evaluations or WALL_EVALUATIONS

    @property
    def wall_limit(self) -> float:
        return math.inf if self.wall_s is None else float(self.wall_s)

    def horizon(self, runs: dict[str, list[Trajectory]]) -> int:
        """Evaluations the trajectories are read over: the budget, or under a wall budget the longest run's
        (each run's steps end where it stopped)."""
        return self.evaluations or max((len(t.steps) for ts in runs.values() for t in ts), default=1)

    def describe(self) -> str:
        if self.evaluations is not None:
            return f"budget {self.evaluations} evaluations"
        return (f"budget {self.wall_s:g} s of charged time per run (its evaluations at their measured cost, its own "
                f"time, its own re-timings)")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "evaluations": self.evaluations, "wall_s": self.wall_s}


class CachedEvaluator:
    """`evaluate(genome_json)` through a directory of results, one JSON file per (context, genome)."""

    def __init__(self, inner, cache_dir: Path, context: dict, screen: dict | None = None) -> None:
        """`screen`: every evaluation a screening one (`search.screen`, `evo.core.fidelity`), for every strategy."""
        self.inner, self.screen = inner, screen
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
        result = self.inner.evaluate(genome_json, screen=self.screen) if self.screen else self.inner.evaluate(genome_json)
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
    charged_s: float = math.nan  # median over seeds of a run's charged seconds (`evo.bench.strategies.Meter`)
    # Median over seeds of the default genome's latency / the run's best's (`RunLine`; nan: none):
    default_speedup: float = math.nan  # paired (`AgainstDefault`)
    default_speedup_single: float = math.nan  # by single timings


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """Median, 25th and 75th percentile by nearest rank (no interpolation: 'never' (inf) stays inf)."""
    v = np.sort(np.asarray(values, dtype=float))
    pick = lambda q: float(v[min(len(v) - 1, max(0, int(math.ceil(q * len(v))) - 1))])  # noqa: E731
    return pick(0.5), pick(0.25), pick(0.75)


@dataclass(frozen=True)
class RunLine:
    """One run (strategy, seed): what it spent, its best, and that best against the default genome."""

    strategy: str
    seed: int
    evaluations: int
    charged_s: float
    best_hash: str  # "" when no engine passed
    best_ms: float  # its single timing
    single_speedup: float  # the default's single timing / the best's (nan: no best, or the default failed)
    speedup: Speedup | None  # paired against the default (None: not re-timed; the default itself: 1.0, no interval)

    def paired_text(self, default: str) -> str:
        if not self.best_hash:
            return "no correct engine"
        if self.best_hash == default:
            return "1 (the best is the default genome: no interval)"
        return self.speedup.text() if self.speedup is not None else "not re-timed"

    def to_dict(self) -> dict:
        speedup = self.speedup.__dict__ if self.speedup is not None else None
        return {**self.__dict__, "speedup": speedup}


def run_lines(runs: dict[str, list[Trajectory]], horizon: int, default: str,
              against: AgainstDefault | None) -> list[RunLine]:
    """Every run's best against the default genome (`default`: its hash), paired where re-timed."""
    default_ms = next((s.latency_ms for ts in runs.values() for t in ts for s in t.steps
                       if s.genome_hash == default and s.status == "ok"), math.nan)
    lines = []
    for name, ts in runs.items():
        for t in ts:
            h, ms = t.best_hash(horizon), float(t.best_so_far(horizon)[-1])
            paired = against.speedup(h) if against is not None and h else None
            lines.append(RunLine(name, t.seed, min(len(t.steps), horizon), t.charged_s, h, ms if h else math.nan,
                                 default_ms / ms if h else math.nan, paired))
    return lines


def _median(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.median(finite)) if finite else math.nan


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


def summarise(runs: dict[str, list[Trajectory]], budget: int, paired: PairedBests | None = None,
              lines: list[RunLine] = ()) -> tuple[float, list[Row]]:
    """Best latency found and a row per strategy; `budget`: the evaluations its trajectories are read over."""
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
                        retimings=sum(len(t.retimings) for t in ts),
                        charged_s=_median([t.charged_s for t in ts]),
                        default_speedup=_median([x.speedup.estimate for x in lines
                                                 if x.strategy == name and x.speedup is not None]),
                        default_speedup_single=_median([x.single_speedup for x in lines if x.strategy == name])))
    return best, rows


def _fmt(x: float, never: str, digits: int = 0) -> str:
    return never if not math.isfinite(x) else f"{x:.{digits}f}"


def _ratio(x: float) -> str:
    return f"{x:.3f}" if math.isfinite(x) else "—"


def table(rows: list[Row], best: float, budget: int, paired: PairedBests | None = None, wall: bool = False) -> str:
    """The strategies' table; `budget`: the evaluations the trajectories were read over; `wall`: the runs had a
    wall budget (a run that never got within 2% is then 'never', not '>budget')."""
    judged, never = paired is not None, "never" if wall else f">{budget}"
    lines = [f"Best latency any strategy found (single timing): **{best:.3f} ms**; 'within 2%' by single timings "
             f"means <= {best * (1 + WITHIN):.3f} ms" + (f"; {RULE}, against `{paired.reference[:16]}`." if judged
                                                          else "; not re-timed (the evaluator cannot re-time paired)."),
             "",
             "| strategy | seeds | best ms at budget, median [IQR] | evals to within 2% (single timings), median [IQR] "
             "| seeds within 2% (single timings) | best / best found (paired), median [IQR] "
             "| evals to within 2% (paired), median [IQR] | seeds within 2% (paired) | re-timings in the search "
             "| eval time s (median) | own time s (median) | charged s (median) "
             "| speedup over the default (single timings), median | speedup over the default (paired), median |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        pr, pe = r.paired_ratio, r.paired_evals
        lines.append(f"| {r.strategy} | {r.seeds} | {r.best_ms[0]:.3f} [{r.best_ms[1]:.3f}, {r.best_ms[2]:.3f}] "
                     f"| {_fmt(r.evals[0], never)} [{_fmt(r.evals[1], never)}, {_fmt(r.evals[2], never)}] "
                     f"| {r.reached}/{r.seeds} "
                     + (f"| {_ratio(pr[0])} [{_ratio(pr[1])}, {_ratio(pr[2])}] "
                        f"| {_fmt(pe[0], never)} [{_fmt(pe[1], never)}, {_fmt(pe[2], never)}] "
                        f"| {r.paired_reached}/{r.seeds} " if r.paired_reached >= 0 else "| — | — | — ")
                     + f"| {r.retimings} | {r.eval_s:.1f} | {r.propose_s:.2f} | {r.charged_s:.1f} "
                     f"| {_speedup(r.default_speedup_single)} | {_speedup(r.default_speedup)} |")
    by = {r.strategy: r for r in rows}
    if "agents" in by:
        for other, target in (("random", 0.5), ("tpe", 0.8)):
            if other in by:
                use_paired = by["agents"].paired_reached >= 0
                a, o = (by["agents"].paired_evals[0], by[other].paired_evals[0]) if use_paired else \
                    (by["agents"].evals[0], by[other].evals[0])
                if math.isfinite(a) and not math.isfinite(o) and wall:  # runs of unequal length: no bound
                    ratio_text, verdict = "—", "not decided at this budget"
                elif math.isfinite(a) and not math.isfinite(o):  # the other's median never got there: a bound
                    bound = a / (budget + 1)
                    ratio_text = f"<= {bound:.2f}"
                    verdict = "met" if bound <= target else "not decided at this budget"
                else:
                    ratio = a / o if math.isfinite(a) else math.nan
                    ratio_text, verdict = f"{ratio:.2f}", "met" if ratio <= target else "missed"
                lines.append(f"\nagents / {other} (median evaluations to within 2%, "
                             f"{'paired' if use_paired else 'single timings'}): "
                             f"{_fmt(a, never)} / {_fmt(o, never)} = {ratio_text} (target <= {target}: {verdict})")
    return "\n".join(lines) + "\n"


def _speedup(x: float) -> str:
    return f"{x:.2f}x" if math.isfinite(x) else "—"


def runs_table(lines: list[RunLine], default: str, against: AgainstDefault | None, budget: Budget) -> str:
    """One line per run: what it spent, its best, and its speedup over the default genome [95%]."""
    how = (f"re-timed paired against it ({len(against.timings)} re-timings; speedup = the default's latency / the "
           f"best's, 95% interval, verdict at the intensify settings' minimum effect)" if against is not None
           else "not re-timed paired (the evaluator cannot re-time): single timings only")
    out = ["", f"Each run's best against the default genome `{default[:16]}`, {how}. Charged s ({budget.kind} "
               f"budget): its evaluations at their measured cost, its own time and its own re-timings.", "",
           "| run (strategy/seed) | evaluations | charged s | best | best ms (single) "
           "| speedup over the default (single timings) | speedup over the default (paired) [95%] |",
           "| --- | ---: | ---: | --- | ---: | ---: | --- |"]
    for x in lines:
        out.append(f"| {x.strategy}/{x.seed} | {x.evaluations} | {x.charged_s:.1f} | `{x.best_hash[:16] or '-'}` "
                   f"| {x.best_ms:.3f} | {_speedup(x.single_speedup)} | {x.paired_text(default)} |")
    return "\n".join(out) + "\n"


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


def warm_table(pairs: list[tuple[Trajectory, Trajectory]], budget: int, never: str = "") -> str:
    """First run (agents) vs a second run warm-started from its lessons: evaluations to the first run's best."""
    never = never or f">{budget}"
    first = [t.evals_to_reach(t.best_so_far(budget)[-1]) for t, _ in pairs]
    second = [w.evals_to_reach(t.best_so_far(budget)[-1]) for t, w in pairs]
    second2 = [w.evals_to_reach(t.best_so_far(budget)[-1] * (1 + WITHIN)) for t, w in pairs]
    f, s, s2 = quartiles(first), quartiles(second), quartiles(second2)
    ratio = s[0] / f[0] if math.isfinite(s[0]) and f[0] else math.nan
    return (f"\n| warm start ({len(pairs)} seeds) | evals, median [IQR] |\n| --- | ---: |\n"
            f"| first run: to its own best | {_fmt(f[0], never)} [{_fmt(f[1], never)}, {_fmt(f[2], never)}] |\n"
            f"| warm-started run: to the first run's best | {_fmt(s[0], never)} [{_fmt(s[1], never)}, "
            f"{_fmt(s[2], never)}] |\n"
            f"| warm-started run: to within 2% of it | {_fmt(s2[0], never)} [{_fmt(s2[1], never)}, "
            f"{_fmt(s2[2], never)}] |\n\n"
            f"warm / first: {ratio:.2f} (target <= 0.3: {'met' if ratio <= 0.3 else 'missed'}). The warm-started run "
            f"re-measures the lessons' best genomes first; through the shared cache a re-measurement returns the "
            f"first measurement, so this shows that the lessons are used, not timing noise on a second run.\n")


def plot(runs: dict[str, list[Trajectory]], budget: int, best: float, path: Path, title: str,
         wall_s: float | None = None) -> None:
    """Best-so-far against evaluations, or with `wall_s` against charged seconds (to the longest run's end)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    if wall_s is None:
        x = np.arange(1, budget + 1)
        curve = lambda t: t.best_so_far(budget)  # noqa: E731
    else:
        trajectories = [t for ts in runs.values() for t in ts if t.steps]
        start = min((t.steps[0].charged_s for t in trajectories), default=0.0)  # no run knows anything before
        end = max([wall_s, *(t.charged_s for t in trajectories if math.isfinite(t.charged_s))])
        x = np.linspace(start, end, 200)
        curve = lambda t: t.best_by_charge(x)  # noqa: E731
    for name, ts in runs.items():
        curves = np.vstack([curve(t) for t in ts])
        curves[~np.isfinite(curves)] = np.nan
        with warnings.catch_warnings():  # a point where no seed has a correct engine yet stays empty
            warnings.simplefilter("ignore", RuntimeWarning)
            median = np.nanmedian(curves, axis=0)
            q25, q75 = np.nanpercentile(curves, 25, axis=0), np.nanpercentile(curves, 75, axis=0)
        (line,) = ax.plot(x, median, label=f"{name} (median of {len(ts)})")
        ax.fill_between(x, q25, q75, color=line.get_color(), alpha=0.18)
    ax.axhline(best * (1 + WITHIN), color="grey", ls="--", lw=1, label="within 2% of the best found")
    ax.set_xlabel("evaluations" if wall_s is None else "charged seconds")
    ax.set_ylabel("best latency so far (ms)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def compare(config: RunConfig, names: list[str], seeds: int, budget: int | None = None, bench_dir: Path | None = None,
            evaluator=None, out: TextIO = sys.stdout, log_mlflow: bool | None = None,
            wall_s: float | None = None) -> dict:
    """Run the benchmark at `budget` evaluations or `wall_s` charged seconds per run (exactly one); returns
    what results.json holds. `evaluator` (tests: the synthetic one) replaces the real in-process Evaluator."""
    from evo.workloads import get_workload

    available = strategies(config.search)
    unknown = [n for n in names if n not in available and n != WARM]
    if unknown or not names:
        raise ValueError(f"unknown strategies {unknown}; allowed: {[*available, WARM]}")
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    limit = Budget(budget, wall_s)
    started = time.monotonic()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    bench_dir = Path(bench_dir or Path(config.out_dir) / f"compare-{config.name}-{stamp}").resolve()
    bench_dir.mkdir(parents=True, exist_ok=True)
    workload = get_workload(config.workload)
    preset = workload.presets()[config.preset]
    if evaluator is None:
        from evaluators.judge.evaluator import Evaluator

        import os

        cores = tuple(sorted(os.sched_getaffinity(0))[:config.evaluators.threads])  # the first this process may use
        evaluator = Evaluator(config.workload, config.preset, config.evaluator, derive_seed(config.search.seed, "compare"),
                              "compare-0", cores)
    info = evaluator.device_info() if hasattr(evaluator, "device_info") else DeviceInfo("cpu", "synthetic", 1)
    space = search_space(config, workload, preset, info)
    context = {"workload": config.workload, "preset": config.preset, "device": f"{info.kind}:{info.name}",
               "threads": info.threads, "evaluator": config.evaluator.to_dict()}
    screen = config.search.screen.to_evaluator()  # every strategy screens alike; paired figures stay full fidelity
    if screen:
        context["screen"] = screen
    cached = CachedEvaluator(evaluator, bench_dir / "cache", context, screen)
    judge = evaluator if config.search.intensify.enabled and can_retime(evaluator) else None  # re-times, uncached
    print(f"benchmark directory: {bench_dir}\nstrategies {names}, {seeds} seeds, {limit.describe()}, "
          f"on {context['device']}", file=out, flush=True)
    runs, warm_pairs = _run_strategies(config, names, seeds, limit, space, cached, judge, out, started)

    horizon = limit.horizon(runs)
    paired_started = time.monotonic()
    paired = (retime_bests(judge, runs, horizon, cached.genomes, config.search.intensify, out)
              if judge is not None else None)
    default = space.default()
    against = _retime_default(judge, runs, horizon, cached.genomes, default.to_json(), config.search.intensify, out,
                              paired)
    paired_s = time.monotonic() - paired_started
    lines = run_lines(runs, horizon, default.hash, against)
    best, rows = summarise(runs, horizon, paired, lines)
    wall = limit.wall_s is not None
    text = (f"Search benchmark: `{config.workload}` preset `{config.preset}` on {context['device']}, "
            f"{len(space.genes)} genes, {limit.describe()}, {seeds} seeds; "
            f"{cached.misses} distinct genomes measured.\n\n" + table(rows, best, horizon, paired, wall)
            + runs_table(lines, default.hash, against, limit))
    if paired is not None:
        text += bests_table(paired, runs, horizon)
    if warm_pairs:
        text += warm_table(warm_pairs, horizon, "never" if wall else "")
    (bench_dir / "table.md").write_text(text)
    plot(runs, horizon, best, bench_dir / "best_so_far.png",
         f"{config.workload}/{config.preset}: best-so-far vs {'charged seconds' if wall else 'evaluations'} "
         f"(median, IQR band over {seeds} seeds)", limit.wall_s)
    results = {"config": config.to_dict(), "strategies": names, "seeds": seeds, "budget": limit.to_dict(),
               "context": context, "best_ms": best, "measured": cached.misses, "cache_hits": cached.hits,
               "wall_s": time.monotonic() - started,
               "paired": {**paired.to_dict(), "wall_s": paired_s} if paired is not None else None,
               "default": default.hash, "against_default": against.to_dict() if against is not None else None,
               "search_retimings": sum(len(t.retimings) for ts in runs.values() for t in ts),
               "search_retime_s": sum(t.retime_s for ts in runs.values() for t in ts),
               "rows": [r.__dict__ for r in rows], "runs": [x.to_dict() for x in lines],
               "trajectories": [t.to_dict() for ts in runs.values() for t in ts]}
    write_json(bench_dir / "results.json", results)
    print("\n" + text, file=out, flush=True)
    if log_mlflow if log_mlflow is not None else config.mlflow.enabled:
        results["mlflow_run_id"] = _log_mlflow(config, bench_dir, rows, best, names, seeds, limit, out)
    print(f"benchmark directory: {bench_dir}", file=out, flush=True)
    return results


def _run_strategies(config: RunConfig, names: list[str], seeds: int, limit: Budget, space, cached: CachedEvaluator,
                    judge, out: TextIO, started: float
                    ) -> tuple[dict[str, list[Trajectory]], list[tuple[Trajectory, Trajectory]]]:
    """Every strategy once per seed at the budget; with agents-warm, the (first, warm-started) pairs."""
    available = strategies(config.search, judge)
    spend = dict(budget=limit.max_evaluations, wall_s=limit.wall_limit)
    runs: dict[str, list[Trajectory]] = {}
    warm_pairs: list[tuple[Trajectory, Trajectory]] = []
    for name in names:
        for i in range(seeds):
            seed = config.search.seed + i
            if name == WARM:
                first = next((t for t in runs.get("agents", []) if t.seed == seed), None)
                first = first or available["agents"](space, cached, seed=seed, **spend)
                lessons = replace(first.lessons, preset=config.preset)
                second = run_agents(space, cached, seed=derive_seed(seed, "warm"), settings=config.search,
                                    lessons=lessons, name=WARM, judge=judge, **spend)
                warm_pairs.append((first, second))
                trajectory = second
            else:
                trajectory = available[name](space, cached, seed=seed, **spend)
            runs.setdefault(name, []).append(trajectory)
            retimed = (f" | re-timed {len(trajectory.retimings)}: {trajectory.incumbent[:12] or '-'} confirmed"
                       if judge is not None and trajectory.strategy.startswith("agents") else "")
            print(f"  {name:14s} seed {seed:3d}: best {trajectory.best_so_far(len(trajectory.steps) or 1)[-1]:8.3f} ms "
                  f"| {len(trajectory.steps)} evaluations, charged {trajectory.charged_s:.1f} s "
                  f"| cache {cached.hits} hits, {cached.misses} measured{retimed} "
                  f"| {time.monotonic() - started:6.0f} s",
                  file=out, flush=True)
    return runs, warm_pairs


def _retime_default(judge, runs: dict[str, list[Trajectory]], horizon: int, genomes: dict[str, str],
                    default_json: str, settings: IntensifySettings, out: TextIO,
                    paired: PairedBests | None = None) -> AgainstDefault | None:
    """The runs' distinct bests re-timed paired against the default genome (None without a judge); when the
    best found is the default and the minimum effects agree, `paired`'s re-timings already are these."""
    if judge is None:
        return None
    default = Genome.from_json(default_json).hash
    if paired is not None and paired.reference == default and settings.min_effect == WITHIN:
        print("paired re-timing against the default genome: the best found is the default (done above)",
              file=out, flush=True)
        return AgainstDefault(default, tuple(paired.timings.values()))
    bests = sorted({t.best_hash(horizon) for ts in runs.values() for t in ts} - {""})
    engines = [genomes[h] for h in bests]
    print(f"paired re-timing against the default genome: {len([g for g in engines if g != default_json])} distinct "
          f"best(s), {settings.calls} paired calls each", file=out, flush=True)
    return retime_against_default(judge, engines, default_json, settings,
                                  say=lambda line: print(line, file=out, flush=True))


def _log_mlflow(config: RunConfig, bench_dir: Path, rows: list[Row], best: float, names: list[str], seeds: int,
                budget: Budget, out: TextIO) -> str | None:
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
                               "seeds": seeds, "budget_kind": budget.kind,
                               "budget": budget.evaluations if budget.wall_s is None else budget.wall_s,
                               "bench_dir": str(bench_dir)})
            metrics = {"best_ms": best}
            for r in rows:
                metrics[f"{r.strategy}.best_ms_median"] = r.best_ms[0]
                if math.isfinite(r.evals[0]):
                    metrics[f"{r.strategy}.evals_to_2pct_median"] = r.evals[0]
                metrics[f"{r.strategy}.seeds_within_2pct"] = r.reached
                for key, value in (("charged_s_median", r.charged_s),
                                   ("speedup_over_default_median", r.default_speedup),
                                   ("speedup_over_default_single_median", r.default_speedup_single)):
                    if math.isfinite(value):
                        metrics[f"{r.strategy}.{key}"] = value
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
