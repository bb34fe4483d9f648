"""The run's summary: best engine, baselines, speedups, roofline fraction, lineage, counts.

`Summary` is the record; `summary.json` is its `to_dict` (written by the driver, read by resume, serving,
the registry and MLflow). `Summary.from_dict` reads any summary.json this project wrote: keys added
since take their defaults, keys it does not know are ignored.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evo.core.records import STATUSES, SUSPECT, EvalResult, Evaluated, nan_for_null
from evo.core.fidelity import FULL
from evo.core.retiming import DEFAULT_REASON, FAILED, VERDICTS, PairedTiming, not_timed, paired_figures
from evo.core.search import RaceResult, Search
from evo.evidence.floor import RunFloor
from evo.workloads.base import Roofline

SUMMARY_FILE = "summary.json"


def best_baseline(baselines: dict[str, EvalResult]) -> tuple[str, EvalResult] | None:
    """The fastest baseline that passed the correctness check."""
    ok = [(name, r) for name, r in baselines.items() if r.ok]
    return min(ok, key=lambda item: item[1].latency_ms) if ok else None


def baseline_not_compared(name: str, baseline: dict[str, Any]) -> str | None:
    """'torch_compile: timeout — build + first call took longer than ...; not compared' for a baseline
    (a `Summary.baselines` entry) that failed or timed out, None for one that was measured: one line
    for the terminal, the MLflow description and the report alike."""
    status = baseline.get("status")
    if status == "ok":
        return None
    message = " ".join(str(baseline.get("message") or "no message").split())
    return f"{name}: {status} — {message[:300]}; not compared"


def baselines_measured(summary: Summary) -> str:
    """Which baselines "faster than the best baseline" covers: 'of those measured: a, b' (all of them, or
    'of those measured: a; not compared: b, c'), or 'no baseline was measured'."""
    compared = summary.baselines_compared or sorted(n for n, b in summary.baselines.items() if b.get("status") == "ok")
    others = sorted(set(summary.baselines) - set(compared))
    if not compared:
        return "no baseline was measured"
    return f"of those measured: {', '.join(compared)}" + (f"; not compared: {', '.join(others)}" if others else "")


def speedups(latency_ms: float, baselines: dict[str, EvalResult]) -> dict[str, float]:
    return {name: r.latency_ms / latency_ms for name, r in baselines.items() if r.ok and math.isfinite(latency_ms)}


def lineage(search: Search, genome_hash: str) -> list[dict[str, Any]]:
    """The best engine's ancestry, newest first, following first parents back to a seed."""
    chain, seen = [], set()
    while genome_hash in search.known and genome_hash not in seen:
        seen.add(genome_hash)
        item = search.known[genome_hash]
        chain.append({"hash": genome_hash, "generation": item.proposal.generation, "agent": item.proposal.agent,
                      "move": item.proposal.move, "parents": list(item.proposal.parents),
                      "latency_ms": item.result.latency_ms})
        if not item.proposal.parents:
            break
        genome_hash = item.proposal.parents[0]
    return chain


def suspects(search: Search) -> list[dict[str, Any]]:
    """Results that timed below the roofline floor: never ranked, listed so a person can look."""
    return [{"hash": h, "latency_ms": item.result.latency_ms, "roofline_floor_ms": item.result.roofline_floor_ms,
             "message": item.result.message}
            for h, item in sorted(search.known.items()) if item.result.status == SUSPECT]


@dataclass(frozen=True)
class Summary:
    """What a run found, as `summary.json` holds it. Latencies in ms; NaN where nothing was measured."""

    workload: str = ""
    preset: str = ""
    best_hash: str | None = None  # None: no correct engine
    best_genome: dict[str, Any] | None = None  # Genome.to_dict() of the best engine
    best_latency_ms: float = math.nan
    best_latency_spread_ms: float = math.nan  # interquartile range of its timed repeats
    best_max_rel_error: float = math.nan
    device: str = ""  # what timed the best engine
    threads: int = 0
    baselines: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> status, latency, spread, error, message
    best_baseline: str | None = None  # the fastest correct baseline
    baselines_compared: list[str] = field(default_factory=list)  # the measured (ok) baselines: what "faster than
    # the best baseline" covers; the others (failed, timed out) are in `baselines` with their status and message
    best_baseline_latency_ms: float = math.nan
    speedup_vs_best_baseline: float = math.nan
    speedups: dict[str, float] = field(default_factory=dict)  # baseline name -> its latency / the best's
    roofline: dict[str, Any] | None = None  # floor_ms, flops, bytes, flops_per_s, bytes_per_s, fraction_of_floor
    # (never above 1: below_floor), source, revisions, revised_from_ms (evo.evidence.floor.RunFloor.entry)
    lineage: list[dict[str, Any]] = field(default_factory=list)  # the best's ancestry, newest first
    evaluations: int = 0
    generations: int = 0
    status_counts: dict[str, int] = field(default_factory=dict)
    suspects: list[dict[str, Any]] = field(default_factory=list)  # timed below the roofline floor, never ranked
    wall_s: float = math.nan
    mlflow_run_id: str | None = None  # the MLflow parent run, once MLflow was reached
    registered_model: str | None = None  # models:/NAME/VERSION of the best engine, when registered
    stopped: bool = False  # stopped by a signal: `python -m evo resume` continues it
    warm_start: str | None = None  # whose lessons seeded this run
    best_sources: dict[str, str] = field(default_factory=dict)  # code hash -> source of the best's code genes
    # From the final paired re-timing of the best engine against each baseline (evo.core.retiming):
    speedup_ci: dict[str, list[float]] = field(default_factory=dict)  # baseline -> [low, high], 95%, of its
    # latency / the best's (the `speedups` above are single timings; these are paired)
    speedup_paired: dict[str, float] = field(default_factory=dict)  # baseline -> the paired estimate
    intensification: dict[str, Any] = field(default_factory=dict)  # re-timings: how many, by verdict, seconds
    final_race: dict[str, Any] = field(default_factory=dict)  # the race of never re-timed, faster-looking
    # candidates against the incumbent before the winner was declared (evo.core.search.RaceResult.to_dict)
    unexamined: list[dict[str, Any]] = field(default_factory=list)  # hash, latency_ms, reason: candidates that
    # looked faster than the winner (single timing) and were never re-timed, with why
    # A generation workload's serving metrics (`vllm bench serve`'s names), one replay of its evaluation each:
    # "best" and each baseline by name (`EvalResult.serving`); the final re-timing's paired intervals of each
    # metric, best against each baseline (`serving_paired`: baseline -> metric -> [estimate, low, high] of the
    # best's value / the baseline's); empty for call workloads
    serving: dict[str, dict[str, Any]] = field(default_factory=dict)
    serving_paired: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # A generation engine's loss against the float64 reference under the run's accuracy contract (mode, top-1
    # agreement, gaps, near ties, the budget): "best" and each baseline by name (`EvalResult.accuracy`); empty
    # for call workloads. Every claim carries the best's (evo.evidence.claims.loss_words)
    accuracy: dict[str, dict[str, Any]] = field(default_factory=dict)
    # how the best's single timing was measured: "full", or "screen" (shorter replays, `evo.core.fidelity`), when
    # `speedups` stay empty: only the final paired re-timing, at full fidelity, compares it with the baselines
    best_fidelity: str = "full"
    final_missing: dict[str, str] = field(default_factory=dict)  # baseline -> why it has no final paired figure
    # the final paired re-timing of the best engine against the run's default genome (what the search, not the
    # default, earned): hash (the default's), speedup [estimate, low, high] (the default's latency / the best's)
    # and a generation engine's figures (metric -> [estimate, low, high] of the best's value / the default's);
    # empty when the default is the best or was not timed
    vs_default: dict[str, Any] = field(default_factory=dict)
    search_end: str = ""  # why the search started no more generations early, to keep its end in search.max_wall_s

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Summary:
        """From `to_dict` output after a JSON round trip (NaN written as null), of this or an older version."""
        if not isinstance(data, dict):
            raise ValueError(f"a summary is a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**nan_for_null(cls, {k: v for k, v in data.items() if k in names}))

    @classmethod
    def read(cls, path: Path) -> Summary:
        """The summary.json at `path`; FileNotFoundError or ValueError (json.JSONDecodeError) as they come."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    @property
    def found(self) -> bool:
        """Whether the run found a correct engine."""
        return bool(self.best_genome)


def make_summary(search: Search, baselines: dict[str, EvalResult], roofline: RunFloor | Roofline | None,
                 workload: str, preset: str, wall_s: float, race: RaceResult | None = None, **run: Any) -> Summary:
    """The summary of `search`; `race`: its final race, if it ran one; `run` sets what only the driver
    knows (mlflow_run_id, stopped, warm_start, ...)."""
    best = search.best()
    latency = best.result.latency_ms if best else math.nan
    fidelity = best.result.fidelity if best else FULL
    comparable = {n: r for n, r in baselines.items() if r.fidelity == fidelity}  # single timings of one fidelity
    top = best_baseline(baselines)
    counts = {s: 0 for s in STATUSES}
    for item in search.known.values():
        counts[item.result.status] += 1
    return Summary(
        workload=workload,
        preset=preset,
        best_hash=best.proposal.hash if best else None,
        best_genome=best.proposal.genome.to_dict() if best else None,
        best_latency_ms=latency,
        best_latency_spread_ms=best.result.latency_spread_ms if best else math.nan,
        best_max_rel_error=best.result.max_rel_error if best else math.nan,
        device=best.result.device if best else "",
        threads=best.result.threads if best else 0,
        baselines={name: {"status": r.status, "latency_ms": r.latency_ms, "latency_spread_ms": r.latency_spread_ms,
                             "max_rel_error": r.max_rel_error, "message": r.message} for name, r in baselines.items()},
        best_baseline=top[0] if top else None,
        baselines_compared=sorted(name for name, r in baselines.items() if r.ok),
        best_baseline_latency_ms=top[1].latency_ms if top else math.nan,
        speedup_vs_best_baseline=(top[1].latency_ms / latency) if top and best and top[0] in comparable else math.nan,
        speedups=speedups(latency, comparable),
        roofline=None if roofline is None else (
            roofline if isinstance(roofline, RunFloor) else RunFloor(roofline)).entry(latency),
        lineage=lineage(search, best.proposal.hash) if best else [],
        evaluations=search.evaluations,
        generations=search.generation,
        status_counts=counts,
        suspects=suspects(search),
        wall_s=wall_s,
        intensification=intensification(search),
        final_race=race.to_dict() if race is not None and race.contenders else {},
        unexamined=[u.to_dict() for u in race.unexamined] if race is not None else [],
        serving=_by_engine(best, baselines, "serving"),
        accuracy=_by_engine(best, baselines, "accuracy"),
        best_fidelity=fidelity,
        search_end=search.stopped_for_end,
        **run,
    )


def _by_engine(best: Evaluated | None, baselines: dict[str, EvalResult], name: str) -> dict[str, dict[str, Any]]:
    """An EvalResult dict field (`serving`, `accuracy`) of "best" and each baseline by name, where it is not empty."""
    results = [*([("best", best.result)] if best else []), *baselines.items()]
    return {engine: dict(getattr(r, name)) for engine, r in results if getattr(r, name)}


def intensification(search: Search) -> dict[str, Any]:
    """The search's paired re-timings in numbers (empty when it re-timed nothing)."""
    timings = list(search.retimings)
    if not timings and not search.intensifying:
        return {}
    budget = search.settings.intensify.budget(search.settings.max_evaluations)
    return {"retimings": len(timings), "budget": budget, **{v: sum(t.verdict == v for t in timings) for v in VERDICTS},
            "wall_s": float(sum(t.wall_s for t in timings if math.isfinite(t.wall_s))),
            "min_effect": search.settings.intensify.min_effect}


def with_final_retimings(summary: Summary, timings: list[PairedTiming]) -> Summary:
    """`summary` with the speedups of the final paired re-timing (a = the best engine, b = "baseline:NAME"):
    the speedup over a baseline is b's latency / a's = 1 / ratio, its interval [1/high, 1/low]."""
    ci, paired, figures, missing, default = {}, {}, {}, {}, {}
    for t in timings:
        if not_timed(t) and t.b.startswith("baseline:"):
            missing[t.b.removeprefix("baseline:")] = "the run was stopped before its paired re-timing finished"
        if t.reason == DEFAULT_REASON and t.verdict != FAILED:
            default = {"hash": t.b, "speedup": list(t.speedup), "figures": paired_figures(t) or {}}
        if t.verdict == FAILED or not t.b.startswith("baseline:"):
            continue
        name = t.b.removeprefix("baseline:")
        estimate, low, high = t.speedup
        ci[name], paired[name] = [low, high], estimate
        if found := paired_figures(t):
            figures[name] = found
    return dataclasses.replace(summary, speedup_ci=ci, speedup_paired=paired, serving_paired=figures,
                               final_missing=missing, vs_default=default)
