"""What a run can claim, in words, claim first: the paired speedups with their intervals lead, single
timings follow labelled as such, and whatever the claim does not cover is named (a baseline that was
not measured, a candidate that looked faster and was never re-timed). The one place the claim is
worded: the terminal summary and `evo report` (`claim_lines`), the MLflow run and model version and the
lineage page (`claim_sentence`), `/v1/engine` and `evo serve` (`EngineRecord.claim`, by `pick_baseline`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from evo.evidence.serving_table import serving_lines
from evo.evidence.summary import Summary, baseline_not_compared, baselines_measured

DEFAULT_MIN_EFFECT = 0.02


def pick_baseline(workload: str, speedup_paired: Mapping[str, float], speedup_ci: Mapping[str, Sequence[float]],
                  speedups: Mapping[str, float]) -> tuple[str, bool] | None:
    """(the baseline a claim is against, whether it is paired): the workload's reference baseline where it
    was re-timed paired, else the one with the smallest paired speedup (the fastest baseline: the modest
    claim); without paired figures, the same rule over the single timings; None when nothing was measured."""
    paired = {n: v for n, v in speedup_paired.items() if n in speedup_ci and _finite(v)}
    pool = paired or {n: v for n, v in speedups.items() if _finite(v)}
    if not pool:
        return None
    reference = _reference_baseline(workload)
    return (reference if reference in pool else min(pool, key=pool.get)), bool(paired)


def claimed_baseline(summary: Summary) -> str | None:
    """The baseline the run's claim is against (`pick_baseline`)."""
    picked = pick_baseline(summary.workload, summary.speedup_paired, summary.speedup_ci, summary.speedups)
    return picked[0] if picked else None


def claim_sentence(summary: Summary, code: str = "`") -> str:
    """The run's claim, before any single timing: 'HASH is 2.63x faster than NAME (paired, 95% [2.28, 2.87])',
    'equal within noise to' or 'slower than' when the interval says so, or 'not re-timed paired: single
    timing only' with the single timing's ratio. `code` quotes the hash (Markdown's backtick; "" for text)."""
    if not summary.found:
        return "No correct engine was found"
    engine, vs = f"{code}{summary.best_hash}{code}", claimed_baseline(summary)
    if vs is None:
        return f"{engine}: no baseline was measured, so there is no speedup to claim"
    if paired_verdict(summary, vs) is None:
        return f"{engine}: not re-timed paired: single timing only, {summary.speedups[vs]:.2f}x vs {vs} (single timing)"
    return f"{engine} is {speedup_claim(summary, vs)}"


def paired_verdict(summary: Summary, baseline: str) -> str | None:
    """'faster' / 'slower' / 'equal' for the best engine against `baseline` by the final paired
    re-timing's interval and the run's minimum effect; None when there is no paired figure."""
    if baseline not in summary.speedup_ci:
        return None
    low, high = summary.speedup_ci[baseline]  # of the speedup (baseline's latency / the best's)
    effect = summary.intensification.get("min_effect", DEFAULT_MIN_EFFECT)
    if low >= 1.0 / (1.0 - effect):
        return "faster"
    if high <= 1.0 / (1.0 + effect):
        return "slower"
    return "equal"


def speedup_claim(summary: Summary, baseline: str) -> str:
    """'2.63x faster than NAME (paired, 95% [2.28, 2.87])', or what stands in its place (equal within
    noise, slower, single timing only, not compared and why)."""
    verdict = paired_verdict(summary, baseline)
    if verdict is not None:
        low, high = summary.speedup_ci[baseline]
        speedup, interval = summary.speedup_paired[baseline], f"(paired, 95% [{low:.2f}, {high:.2f}])"
        return {"faster": f"{speedup:.2f}x faster than {baseline} {interval}",
                "slower": f"slower than {baseline}: {speedup:.2f}x {interval}",
                "equal": f"equal within noise to {baseline}: {speedup:.2f}x {interval}"}[verdict]
    single = summary.speedups.get(baseline)
    if single is not None and math.isfinite(single):
        return f"{single:.2f}x against {baseline} by single timing only (not confirmed by a paired re-timing)"
    return baseline_not_compared(baseline, summary.baselines.get(baseline, {})) or f"{baseline}: not measured"


def short_claim(summary: Summary) -> str:
    """The claim in a few words, for a title: '6.06x vs NAME [5.39, 6.53] paired' ('' when there is none)."""
    vs = claimed_baseline(summary) if summary.found else None
    if vs is None:
        return ""
    verdict = paired_verdict(summary, vs)
    if verdict is None:
        return f"{summary.speedups[vs]:.2f}x vs {vs}, single timing only"
    (low, high), estimate = summary.speedup_ci[vs], summary.speedup_paired[vs]
    return (f"{estimate:.2f}x vs {vs} [{low:.2f}, {high:.2f}] paired"
            + {"faster": "", "equal": ": equal within noise", "slower": ": slower"}[verdict])


def claim_lines(summary: Summary) -> list[str]:
    """The summary's claim, first thing a reader sees: the engine, its paired speedups, what is not covered."""
    if not summary.found:
        return ["no correct engine was found"]
    confirmed = "its wins confirmed by paired re-timing" if summary.intensification else \
        "chosen by single timing: paired re-timing was off"
    lines = [claim_sentence(summary, code=""), f"  best engine {summary.best_hash} ({confirmed}); against each baseline:"]
    compared = sorted((n for n in summary.baselines if n in summary.speedup_ci),
                      key=lambda n: summary.speedup_paired[n])
    single_only = sorted((n for n, v in summary.speedups.items() if n not in summary.speedup_ci), key=str)
    failed = sorted(n for n, b in summary.baselines.items() if b.get("status") != "ok")
    for name in compared + single_only + failed:
        lines.append(f"  {speedup_claim(summary, name)}")
    if summary.best_baseline:
        lines.append(f"  best baseline {summary.best_baseline} ({baselines_measured(summary)})")
    race = summary.final_race
    if race:
        moved = race.get("winner") != race.get("before")
        lines.append(f"  final race: {len(race.get('contenders', []))} never re-timed candidate(s) that looked faster "
                     f"raced the incumbent paired; " + (f"{race['winner']} won (was {race['before']})" if moved
                                                        else "the incumbent held"))
    for item in summary.unexamined:
        lines.append(f"  unexamined: {item['hash']} looked faster ({item['latency_ms']:.3f} ms, one single timing)"
                     f" and was never re-timed: {item['reason']}")
    # a generation engine is scored on its tokens (near ties allowed): it has no relative error to show
    error = (f", max rel error {summary.best_max_rel_error:.2e}" if _finite(summary.best_max_rel_error)
             else ", every request's tokens those of the float64 reference" if summary.serving else "")
    lines.append(f"  single timing {summary.best_latency_ms:.3f} ms (IQR {summary.best_latency_spread_ms:.3f}; one"
                 f" evaluation's median, not a claim){error}")
    return lines + serving_lines(summary)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _reference_baseline(workload: str) -> str | None:
    """The workload's reference baseline (what a user runs today), None for a workload that cannot be loaded."""
    from evo.workloads import get_workload

    try:
        return get_workload(workload).reference_baseline
    except ValueError:  # unknown, or not importable here: the modest rule picks the baseline
        return None
