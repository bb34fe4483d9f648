"""A generation run's serving figures as a table, `vllm bench serve`'s names: one row per engine (the best,
then each baseline), one replay of its evaluation each, and under it the final re-timing's paired 95%
intervals of the best engine's figures against each baseline (the claims). Text for the terminal and
`evo report`, Markdown for MLflow."""
from __future__ import annotations

import math

from evo.core.fidelity import SCREEN
from evo.evidence.summary import Summary

COLUMNS = (("output tok/s", "output_throughput", None), ("req/s", "request_throughput", None),
           ("TTFT p50", "ttft_ms", "median"), ("TTFT p99", "ttft_ms", "p99"), ("TPOT p50", "tpot_ms", "median"),
           ("TPOT p99", "tpot_ms", "p99"), ("ITL p50", "itl_ms", "median"), ("E2E p50", "e2el_ms", "median"),
           ("goodput req/s", "request_goodput", None))
PAIRED = (("output tok/s", "output_throughput"), ("TTFT p50", "ttft_median_ms"), ("TTFT p99", "ttft_p99_ms"),
          ("TPOT p50", "tpot_median_ms"), ("TPOT p99", "tpot_p99_ms"), ("E2E p50", "e2el_median_ms"))


def _value(serving: dict, key: str, stat: str | None) -> str:
    value = serving.get(key)
    if stat is not None:
        value = (value or {}).get(stat)
    return f"{value:.4g}" if isinstance(value, (int, float)) and math.isfinite(value) else "-"


def _rows(summary: Summary) -> list[list[str]]:
    order = ["best", *sorted(n for n in summary.serving if n != "best")]
    return [[name if name != "best" else f"best {summary.best_hash or ''}".strip(),
             *(_value(summary.serving[name], key, stat) for _, key, stat in COLUMNS)]
            for name in order if name in summary.serving]


def _paired(summary: Summary) -> list[str]:
    lines = []
    for baseline, figures in sorted(summary.serving_paired.items()):
        parts = [f"{label} {f[0]:.3g}x [{f[1]:.3g}, {f[2]:.3g}]" for label, key in PAIRED if (f := figures.get(key))]
        if parts:
            lines.append(f"{baseline}: " + ", ".join(parts))
    return lines


def serving_lines(summary: Summary) -> list[str]:
    """The table as aligned text ([] for a call workload)."""
    if not summary.serving:
        return []
    head = ["engine", *(label for label, _, _ in COLUMNS)]
    rows = _rows(summary)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    trace = summary.serving.get("best") or next(iter(summary.serving.values()))
    counts = sorted({str(figures.get("requests", "?")) for figures in summary.serving.values()})
    screened = " (the best's a screening replay, shorter)" if summary.best_fidelity == SCREEN else ""
    lines = [f"  serving (ms; one replay of {' or '.join(counts)} requests{screened}, {trace.get('arrival', '?')} arrivals"
             f" at concurrency {trace.get('concurrency', '?')}, on the judge's clock):", fmt(head), *map(fmt, rows)]
    paired = _paired(summary)
    if paired:
        lines.append("  the best engine's figures / each baseline's, paired 95% intervals (final re-timing):")
        lines += [f"    {line}" for line in paired]
    return lines


def serving_markdown(summary: Summary) -> str:
    """The table in Markdown ("" for a call workload)."""
    if not summary.serving:
        return ""
    head = ["engine", *(label for label, _, _ in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(summary)]
    paired = _paired(summary)
    if paired:
        lines += ["", "Best / baseline, paired 95% intervals (final re-timing):", *(f"- {line}" for line in paired)]
    return "\n".join(lines)
