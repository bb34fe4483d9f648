"""The run's summary: best engine, baselines, speedups, roofline fraction, lineage, counts."""
from __future__ import annotations

import math
from typing import Any

from evo.core.records import STATUSES, SUSPECT, EvalResult
from evo.core.search import Search
from evo.workloads.base import Roofline


def best_baseline(baselines: dict[str, EvalResult]) -> tuple[str, EvalResult] | None:
    """The fastest baseline that passed the correctness check."""
    ok = [(name, r) for name, r in baselines.items() if r.ok]
    return min(ok, key=lambda item: item[1].latency_ms) if ok else None


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


def make_summary(search: Search, baselines: dict[str, EvalResult], roofline: Roofline | None,
                 workload: str, preset: str, wall_s: float) -> dict[str, Any]:
    best = search.best()
    latency = best.result.latency_ms if best else math.nan
    top = best_baseline(baselines)
    counts = {s: 0 for s in STATUSES}
    for item in search.known.values():
        counts[item.result.status] += 1
    return {
        "workload": workload,
        "preset": preset,
        "best_hash": best.proposal.hash if best else None,
        "best_genome": best.proposal.genome.to_dict() if best else None,
        "best_latency_ms": latency,
        "best_latency_spread_ms": best.result.latency_spread_ms if best else math.nan,
        "best_max_rel_error": best.result.max_rel_error if best else math.nan,
        "device": best.result.device if best else "",
        "threads": best.result.threads if best else 0,
        "baselines": {name: {"status": r.status, "latency_ms": r.latency_ms, "latency_spread_ms": r.latency_spread_ms,
                             "max_rel_error": r.max_rel_error, "message": r.message} for name, r in baselines.items()},
        "best_baseline": top[0] if top else None,
        "best_baseline_latency_ms": top[1].latency_ms if top else math.nan,
        "speedup_vs_best_baseline": (top[1].latency_ms / latency) if top and best else math.nan,
        "speedups": speedups(latency, baselines),
        "roofline": None if roofline is None else {
            "floor_ms": roofline.floor_ms, "flops": roofline.flops, "bytes": roofline.bytes,
            "flops_per_s": roofline.rates.flops_per_s, "bytes_per_s": roofline.rates.bytes_per_s,
            "fraction_of_floor": roofline.floor_ms / latency if best else math.nan,
        },
        "lineage": lineage(search, best.proposal.hash) if best else [],
        "evaluations": search.evaluations,
        "generations": search.generation,
        "status_counts": counts,
        "suspects": suspects(search),
        "wall_s": wall_s,
    }
