"""What MLflow shows of a search in words: the parent run's description and the model version's tags.

The description (`mlflow.note.content`, Markdown, on the run's Overview) states the best engine, its
latency with its spread, its speedup over each baseline (single timing, and the final paired
re-timing with its 95% interval), its fraction of the roofline floor, and links to the lineage page
and the registered model. Its links are UI routes relative to the page (`#/experiments/...`), so they
work on whatever host the UI runs; the run's ids are filled in when the outbox creates the run
(`RUN_ID`, `EXPERIMENT_ID` below). Numbers are rounded to what the measurement supports.
"""
from __future__ import annotations

import math
from pathlib import Path

from evo.evidence.mlflow.links import artifact_path, model_version_path
from evo.evidence.summary import Summary

RUN_ID, EXPERIMENT_ID = "<run_id>", "<experiment_id>"  # placeholders the outbox fills in at replay
NOTE_TAG = "mlflow.note.content"  # the run's (and experiment's) description in the UI
LINEAGE_ARTIFACT = "lineage/lineage.html"


def ms(value: float | None, digits: int = 3) -> str:
    return f"{value:.{digits}f} ms" if value is not None and math.isfinite(value) else "-"


def speedup_text(summary: Summary, baseline: str) -> str:
    """'4.55x (paired 2.63x, 95% [2.28, 2.87])', or the single timing's ratio alone."""
    single = summary.speedups.get(baseline)
    text = f"{single:.2f}x" if single is not None and math.isfinite(single) else "-"
    if baseline in summary.speedup_ci:
        low, high = summary.speedup_ci[baseline]
        text += f" (paired {summary.speedup_paired[baseline]:.2f}x, 95% [{low:.2f}, {high:.2f}])"
    return text


def roofline_text(summary: Summary) -> str | None:
    roof = summary.roofline or {}
    fraction = roof.get("fraction_of_floor")
    if fraction is None or not math.isfinite(fraction):
        return None
    return f"{100 * fraction:.1f}% of the roofline floor ({ms(roof.get('floor_ms'))})"


def run_description(summary: Summary, run_dir: Path | str, status: str = "FINISHED") -> str:
    """The parent run's Markdown description, with `RUN_ID` and `EXPERIMENT_ID` left to fill in."""
    lines = [f"## {summary.workload} / {summary.preset}: " + ("search " + status.lower() if status != "FINISHED"
                                                              else "search finished")]
    if not summary.found:
        lines.append("No correct engine was found" + (" (no summary: the run failed before it made one)."
                                                      if not summary.workload else "."))
    else:
        lines.append(f"**Best engine `{summary.best_hash}`**: {ms(summary.best_latency_ms)} "
                     f"(IQR {ms(summary.best_latency_spread_ms)}), max relative error {summary.best_max_rel_error:.1e}, "
                     f"timed on {summary.device}.")
        lines += ["", "| baseline | latency | speedup (single timing; paired, 95% interval) |", "| --- | ---: | --- |"]
        for name, base in sorted(summary.baselines.items(), key=lambda kv: -summary.speedups.get(kv[0], 0)):
            lines.append(f"| {name} | {ms(base.get('latency_ms'))} | "
                         f"{speedup_text(summary, name) if base.get('status') == 'ok' else base.get('status')} |")
        lines.append("")
        roof = roofline_text(summary)
        facts = [f"{summary.speedup_vs_best_baseline:.2f}x faster than the best baseline ({summary.best_baseline})"]
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
    for name in summary.speedups:
        tags[f"speedup.{name}"] = speedup_text(summary, name)
    for name, (low, high) in summary.speedup_ci.items():  # the paired 95% interval alone, for filters
        tags[f"speedup_ci.{name}"] = f"[{low:.3f}, {high:.3f}]"
    roof = roofline_text(summary)
    if roof:
        tags["roofline"] = roof
    return tags


def version_description(summary: Summary, run_name: str, experiment_id: str | None, run_id: str | None) -> str:
    """The model version's Markdown description."""
    run = f"[{run_name}](#/experiments/{experiment_id}/runs/{run_id})" if experiment_id and run_id else run_name
    best = summary.best_baseline
    lines = [f"{summary.workload} engine `{summary.best_hash}` for preset `{summary.preset}`, found by the search "
             f"{run}: {ms(summary.best_latency_ms)} (IQR {ms(summary.best_latency_spread_ms)}) on {summary.device}"
             + (f", {speedup_text(summary, best)} faster than {best}" if best else "") + "."]
    roof = roofline_text(summary)
    if roof:
        lines.append(f"{roof[0].upper()}{roof[1:]}.")
    lines.append("Inputs and outputs: the signature (the workload's request schema; -1 marks a free axis). "
                 "MLflow cannot mark a tensor optional, so optional inputs are listed and `predict` requires them; "
                 "the HTTP server of `python -m evo serve` accepts them optional.")
    return "\n\n".join(lines)


def _model_name_version(uri: str) -> tuple[str, str]:
    name, _, version = uri.removeprefix("models:/").rpartition("/")
    return name, version
