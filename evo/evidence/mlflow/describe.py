"""What MLflow shows of a search in words: the parent run's description and the model version's tags.

The description (`mlflow.note.content`, Markdown, on the run's Overview) opens with the claim: the
paired speedup with its 95% interval over one baseline (`claim_sentence`), in its first line, since
the UI folds a description after about 150 px ("Show more"); then the best engine's single timing,
labelled as one, each baseline's speedup (paired first, single timing after), its fraction of the
roofline floor, and links to the lineage page and the registered model. The model version's
description opens with the same sentence, and its tags carry it (`claim`) and the loss that comes with it
(`accuracy_mode`: exact, budget, or tolerance for a call engine; `accuracy`: a generation engine's loss against the
float64 reference, `loss_words`). Its links are UI routes relative to the page (`#/experiments/...`), so they
work on whatever host the UI runs; the run's ids are filled in when the outbox creates the run
(`RUN_ID`, `EXPERIMENT_ID` below). Numbers are rounded to what the measurement supports.
"""
from __future__ import annotations

import math
from pathlib import Path

from evo.evidence.claims import best_accuracy, claim_sentence, loss_mode, loss_words
from evo.evidence.floor import floor_text
from evo.evidence.mlflow.links import artifact_path, model_version_path
from evo.evidence.serving_table import serving_markdown
from evo.evidence.summary import Summary, baseline_not_compared, baselines_measured

RUN_ID, EXPERIMENT_ID = "<run_id>", "<experiment_id>"  # placeholders the outbox fills in at replay
NOTE_TAG = "mlflow.note.content"  # the run's (and experiment's) description in the UI
LINEAGE_ARTIFACT = "lineage/lineage.html"
MODE_TAG = "accuracy_mode"  # exact, budget or tolerance: on the run and on every registered version


def ms(value: float | None, digits: int = 3) -> str:
    return f"{value:.{digits}f} ms" if value is not None and math.isfinite(value) else "-"


def speedup_text(summary: Summary, baseline: str) -> str:
    """'paired 2.63x, 95% [2.28, 2.87]; single timing 4.55x', or 'single timing 4.55x (not re-timed paired)'."""
    single = summary.speedups.get(baseline)
    single_text = f"single timing {single:.2f}x" if _finite(single) else "single timing -"
    if baseline not in summary.speedup_ci:
        return f"{single_text} (not re-timed paired)"
    low, high = summary.speedup_ci[baseline]
    return f"paired {summary.speedup_paired[baseline]:.2f}x, 95% [{low:.2f}, {high:.2f}]; {single_text}"


def single_timing_text(summary: Summary) -> str:
    """The best engine's own timing, labelled: one evaluation's median, not a claim."""
    return (f"Single timing (one evaluation's median, not a claim): {ms(summary.best_latency_ms)} "
            f"(IQR {ms(summary.best_latency_spread_ms)}) on {summary.device}")


def roofline_text(summary: Summary) -> str | None:
    """The best engine's fraction of the run's floor, never above 100% (evo.evidence.floor.floor_text)."""
    return floor_text(summary.roofline)


def run_description(summary: Summary, run_dir: Path | str, status: str = "FINISHED") -> str:
    """The parent run's Markdown description, with `RUN_ID` and `EXPERIMENT_ID` left to fill in."""
    # the claim in the first line: the UI shows about 150 px of a description before "Show more"
    lines = [f"**{claim_sentence(summary)}.**"]
    run = f"{summary.workload} / {summary.preset}: search " + (status.lower() if status != "FINISHED" else "finished")
    if not summary.found:
        lines.append(run + (" (no summary: the run failed before it made one)." if not summary.workload else "."))
    else:
        loss = loss_words(best_accuracy(summary))  # a generation engine's tokens against float64, else the call's error
        lines.append(f"{run}. {single_timing_text(summary)}, "
                     + (f"{loss}." if loss else f"max relative error {summary.best_max_rel_error:.1e}."))
        if summary.unexamined:  # by name: a faster-looking candidate nobody examined is part of the result
            lines.append(f"{len(summary.unexamined)} candidate(s) looked faster by a single timing and were never"
                         " re-timed paired: " + "; ".join(f"`{u['hash']}` ({ms(u['latency_ms'])}): {u['reason']}"
                                                          for u in summary.unexamined) + ".")
        lines += ["", "| baseline | latency (single timing) | speedup: paired, 95% interval; single timing |",
                  "| --- | ---: | --- |"]
        paired_first = lambda kv: (kv[0] not in summary.speedup_ci,  # noqa: E731 - then by speedup, largest first
                                   -summary.speedup_paired.get(kv[0], summary.speedups.get(kv[0], 0)))
        for name, base in sorted(summary.baselines.items(), key=paired_first):
            failed = baseline_not_compared(name, base)  # why it was not compared, in its row
            why = failed.removeprefix(f"{name}: ").replace("|", "\\|") if failed else None
            lines.append(f"| {name} | {ms(base.get('latency_ms'))} | {why or speedup_text(summary, name)} |")
        lines.append("")
        if table := serving_markdown(summary):  # a generation engine's figures, as users compare servers
            lines += [f"Serving figures ({summary.serving.get('best', {}).get('objective', 'ms_per_output_token')} is"
                      " the latency above; times in ms):", "", table, ""]
        roof = roofline_text(summary)
        facts = [f"By single timing: {summary.speedup_vs_best_baseline:.2f}x faster than the best baseline ({summary.best_baseline})"
                 f" {baselines_measured(summary)}"]
        lines.append("; ".join(facts + ([roof] if roof else [])) + ".")
    counts = ", ".join(f"{k} {v}" for k, v in summary.status_counts.items() if v)
    lines.append(f"{summary.evaluations} evaluations ({counts or 'none'}) in {summary.generations} generations"
                 + (f", {summary.wall_s:.0f} s." if math.isfinite(summary.wall_s) else "."))
    lines += ["", f"**Lineage**: [the lineage page]({artifact_path(EXPERIMENT_ID, RUN_ID, LINEAGE_ARTIFACT)}) "
                  "(how the best engine came to be: every candidate, its parents, moves and latencies); "
                  "one child run per generation below."]
    if summary.registered_model:
        name, version = _model_name_version(summary.registered_model)
        lines.append(f"**Registered model**: [`{summary.registered_model}`]({model_version_path(name, version)}); "
                     f"serve it with `python -m evo serve {summary.registered_model}`.")
    lines.append(f"Run directory: `{run_dir}`.")
    return "\n".join(lines)


def version_tags(summary: Summary, run_id: str | None, run_dir: Path | str) -> dict[str, str]:
    """Tags of a registered engine version: what it is and what the search measured, rounded."""
    tags = {"genome_hash": str(summary.best_hash), "workload": summary.workload, "preset": summary.preset,
            "device": summary.device, "latency_ms": f"{summary.best_latency_ms:.4f}",
            "latency": f"{ms(summary.best_latency_ms)} (IQR {ms(summary.best_latency_spread_ms)})",
            "max_rel_error": f"{summary.best_max_rel_error:.1e}", "run_id": str(run_id), "run_dir": str(run_dir)}
    tags["claim"] = claim_sentence(summary).replace("`", "")
    tags[MODE_TAG] = loss_mode(best_accuracy(summary))  # every version: the champion rule reads it (registry.promote)
    if loss := loss_words(best_accuracy(summary)):
        tags["accuracy"] = loss
    for name in summary.speedups:
        tags[f"speedup.{name}"] = speedup_text(summary, name)
    for name, (low, high) in summary.speedup_ci.items():  # the paired estimate and its 95% interval, for filters
        tags[f"speedup_ci.{name}"] = f"[{low:.3f}, {high:.3f}]"
        tags[f"speedup_paired.{name}"] = f"{summary.speedup_paired[name]:.3f}"
    roof = roofline_text(summary)
    if roof:
        tags["roofline"] = roof
    return tags


def version_description(summary: Summary, run_name: str, experiment_id: str | None, run_id: str | None) -> str:
    """The model version's Markdown description."""
    run = f"[{run_name}](#/experiments/{experiment_id}/runs/{run_id})" if experiment_id and run_id else run_name
    best = summary.best_baseline
    lines = [f"**{claim_sentence(summary)}.**",  # the claim first, as on the run
             f"{summary.workload} engine `{summary.best_hash}` for preset `{summary.preset}`, found by the search "
             f"{run}. {single_timing_text(summary)}"
             + (f"; against {best}, the best baseline: {speedup_text(summary, best)}" if best else "") + "."]
    roof = roofline_text(summary)
    if roof:
        lines.append(f"{roof[0].upper()}{roof[1:]}.")
    lines.append("Inputs and outputs: the signature (the workload's request schema; -1 marks a free axis). "
                 "MLflow cannot mark a tensor optional, so optional inputs are listed and `predict` requires them; "
                 "the HTTP server of `python -m evo serve` accepts them optional.")
    return "\n\n".join(lines)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _model_name_version(uri: str) -> tuple[str, str]:
    name, _, version = uri.removeprefix("models:/").rpartition("/")
    return name, version
