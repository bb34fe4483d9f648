"""What a run can claim, in words, claim first: the paired speedups with their intervals lead, single
timings follow labelled as such, and whatever the claim does not cover is named (a baseline that was
not measured, a candidate that looked faster and was never re-timed). The one place the claim is
worded: the terminal summary and `evo report` (`claim_lines`), the MLflow run and model version and the
lineage page (`claim_sentence`), `/v1/engine` and `evo serve` (`EngineRecord.claim`, by `pick_baseline`).

Every claim of a generation engine carries its loss against the float64 reference (`loss_words`, from the
evaluation's `EvalResult.accuracy`, `evaluators.judge.accuracy`): a speed bought with bfloat16 weights is
worded with what it cost, '... (paired, 95% [1.70, 2.10]) at top-1 agreement 99.4% [99.1, 99.6], mean gap
0.003 logits (budget mode)', and an exact engine says so, '... (exact mode: every token the float64
reference's, near ties allowed)'. A call engine's claim has no such words (its relative error is checked).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from evo.core.fidelity import SCREEN
from evo.evidence.serving_table import serving_lines
from evo.evidence.summary import Summary, baseline_not_compared, baselines_measured

DEFAULT_MIN_EFFECT = 0.02
EXACT, BUDGET = "exact", "budget"  # the accuracy contract's modes (evaluators.settings.ACCURACY_MODES)
TOLERANCE = "tolerance"  # a call engine's: no accuracy record, its outputs within the workload's relative error


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
        claim = f"{engine}: no baseline was measured, so there is no speedup to claim"
    elif paired_verdict(summary, vs) is None:
        claim = f"{engine}: not re-timed paired: single timing only, {summary.speedups[vs]:.2f}x vs {vs} (single timing)"
    else:
        claim = f"{engine} is {speedup_claim(summary, vs)}"
    return with_loss(claim, best_accuracy(summary))


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
        return with_loss(f"{summary.speedups[vs]:.2f}x vs {vs}, single timing only", best_accuracy(summary), short=True)
    (low, high), estimate = summary.speedup_ci[vs], summary.speedup_paired[vs]
    return with_loss(f"{estimate:.2f}x vs {vs} [{low:.2f}, {high:.2f}] paired"
                     + {"faster": "", "equal": ": equal within noise", "slower": ": slower"}[verdict],
                     best_accuracy(summary), short=True)


def claim_lines(summary: Summary) -> list[str]:
    """The summary's claim, first thing a reader sees: the engine, its paired speedups, what is not covered."""
    if not summary.found:
        return ["no correct engine was found"]
    confirmed = _how_chosen(summary.intensification)
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
    for name, why in sorted(summary.final_missing.items()):
        lines.append(f"  missing: no paired figure against {name}: {why}")
    for item in summary.unexamined:
        lines.append(f"  unexamined: {item['hash']} looked faster ({item['latency_ms']:.3f} ms, one single timing)"
                     f" and was never re-timed: {item['reason']}")
    if summary.search_end:
        lines.append(f"  search: {summary.search_end}")
    # a generation engine is scored on its tokens: no relative error, its loss against float64 instead
    accuracy = best_accuracy(summary)
    error = (f", max rel error {summary.best_max_rel_error:.2e}" if _finite(summary.best_max_rel_error)
             else ", every request's tokens those of the float64 reference" if summary.serving and not accuracy else "")
    fidelity = " at screen fidelity (shorter replays)" if summary.best_fidelity == SCREEN else ""
    lines.append(f"  single timing {summary.best_latency_ms:.3f} ms (IQR {summary.best_latency_spread_ms:.3f}; one"
                 f" evaluation's median{fidelity}, not a claim){error}")
    return lines + accuracy_lines(accuracy) + serving_lines(summary)


# ---------------------------------------------------------------------------------------------- the loss
def best_accuracy(summary: Summary) -> dict:
    """The best engine's accuracy record (`EvalResult.accuracy`), {} for a call engine or an older summary."""
    return dict(summary.accuracy.get("best") or {})


def loss_mode(accuracy: Mapping) -> str:
    """'exact' or 'budget' (the accuracy contract's mode), 'tolerance' for a call engine (no accuracy record)."""
    return str(accuracy.get("mode") or TOLERANCE) if accuracy else TOLERANCE


def loss_words(accuracy: Mapping, short: bool = False) -> str:
    """What an engine loses against the float64 reference, as every claim words it ('' for a call engine):
    budget mode 'top-1 agreement 99.4% [99.1, 99.6], mean gap 0.003 logits (budget mode)' (short: '99.4% top-1');
    exact mode 'exact mode: every token the float64 reference's, near ties allowed' (short: 'exact tokens')."""
    mode = loss_mode(accuracy)
    text = "" if short else real_text_words(accuracy)
    if mode == EXACT:
        return "exact tokens" if short else f"exact mode: every token the float64 reference's, near ties allowed{text}"
    if mode == TOLERANCE:
        return ""
    agreement = accuracy.get("agreement")
    if not _finite(agreement):
        return f"no step scored ({mode} mode)"
    if short:
        return f"{_pct(agreement)} top-1"
    return (f"top-1 agreement {_pct(agreement)} {_pct_interval(accuracy.get('agreement_ci'))}, mean gap "
            f"{_gap(accuracy.get('mean_gap'))} logits ({mode} mode){text}")


def real_text_words(accuracy: Mapping) -> str:
    """'; on the Zen of Python: next-token accuracy 38.2% (float64 38.5%, perplexity 12.3)' for a checkpoint
    with a tokenizer (`EvalResult.accuracy['real_text']`), '' otherwise."""
    quality = accuracy.get("real_text") or {}
    if not _finite(quality.get("engine_top1")):
        return ""
    return (f"; on {quality.get('text', 'real text')} ({quality.get('positions')} positions): next-token accuracy "
            f"{_pct(quality['engine_top1'])} (float64 {_pct(quality.get('reference_top1'))}, perplexity "
            f"{quality.get('reference_perplexity', float('nan')):.4g})")


def with_loss(claim: str, accuracy: Mapping, short: bool = False) -> str:
    """`claim` followed by its loss (`loss_words`): '... at top-1 agreement ...' in budget mode, '... (exact
    mode: ...)' in exact mode (short: '..., exact tokens'); `claim` itself for a call engine."""
    words = loss_words(accuracy, short)
    if not words:
        return claim
    if loss_mode(accuracy) == EXACT:
        return f"{claim}, {words}" if short else f"{claim} ({words})"
    return f"{claim} at {words}"


def accuracy_lines(accuracy: Mapping) -> list[str]:
    """The loss in full for the terminal and `evo report`: the figures with their intervals, the largest gap and
    where, near ties, and in budget mode the budget and where it comes from ([] for a call engine)."""
    mode = loss_mode(accuracy)
    if mode == TOLERANCE:
        return []
    head = "exact mode: every token the float64 reference's pick or a near tie" if mode == EXACT else f"{mode} mode"
    if not _finite(accuracy.get("agreement")):
        return [f"  accuracy ({head}): no step scored"]
    a = accuracy
    where = f" at {a['max_gap_at']}" if a.get("max_gap") and a.get("max_gap_at") else ""
    ties = f"the other token in {a.get('tie_flips', 0)} of {a.get('ties', 0)} near ties" + (
        f" (p = {a['tie_p']:.2g} for honest rounding)" if _finite(a.get("tie_p")) else "")
    lines = [f"  accuracy ({head}): top-1 agreement {_pct(a['agreement'])} {_pct_interval(a.get('agreement_ci'))}, "
             f"mean gap {_gap(a.get('mean_gap'))} {_gap_interval(a.get('mean_gap_ci'))} logits, largest gap "
             f"{_gap(a.get('max_gap'))}{where}",
             f"    over {a.get('steps', '?')} steps of {a.get('requests', '?')} requests, teacher-forced on its own "
             f"tokens against float64; {ties}"]
    budget = accuracy.get("budget")
    if budget:
        short = "".join(f", <= {_gap(gap)} after <= {n} tokens" for n, gap in budget.get("short_max_gap") or ())
        if budget.get("recheck"):  # a step past it held to an honest execution of its own context
            short += f" (past it: {budget.get('factor', 2):g} x an honest {budget['recheck']} execution of its context)"
        lines.append(f"    budget: top-1 agreement >= {_pct(budget.get('min_agreement'))}, mean gap <= "
                     f"{_gap(budget.get('max_mean_gap'))}, largest gap <= {_gap(budget.get('max_gap'))} logits{short}, near "
                     f"ties within {_gap(budget.get('tie_window'))} not steered (p >= {budget.get('tie_alpha', '?')}); "
                     f"{budget.get('basis') or 'basis not recorded'}")
    return lines


def _pct(value: object) -> str:
    return f"{100 * value:.1f}%" if _finite(value) else "-"


def _pct_interval(ci: object) -> str:
    low, high = ci if isinstance(ci, (list, tuple)) and len(ci) == 2 else (None, None)
    return f"[{100 * low:.1f}, {100 * high:.1f}]" if _finite(low) and _finite(high) else "[-]"


def _gap(value: object) -> str:
    """A gap in logits to two significant digits (inf where a token lay outside the reference's nucleus)."""
    return f"{value:.2g}" if isinstance(value, (int, float)) and not math.isnan(value) else "-"


def _gap_interval(ci: object) -> str:
    low, high = ci if isinstance(ci, (list, tuple)) and len(ci) == 2 else (None, None)
    return f"[{_gap(low)}, {_gap(high)}]"


def _how_chosen(intensification: Mapping) -> str:
    """How the best engine was chosen: by paired re-timings, or by single timing (re-timing off, or on but never
    run: no candidate challenged the first best)."""
    if not intensification:
        return "chosen by single timing: paired re-timing was off"
    if not intensification.get("retimings"):
        return "chosen by single timing: paired re-timing was on but ran no re-timing"
    return f"its wins confirmed by {intensification['retimings']} paired re-timing(s)"


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _reference_baseline(workload: str) -> str | None:
    """The workload's reference baseline (what a user runs today), None for a workload that cannot be loaded."""
    from evo.workloads import get_workload

    try:
        return get_workload(workload).reference_baseline
    except ValueError:  # unknown, or not importable here: the modest rule picks the baseline
        return None
