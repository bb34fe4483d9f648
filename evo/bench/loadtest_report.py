"""The numbers of a serving load test, from what each request recorded on the client clock.

Pure functions of `RequestRecord`s (no network, no clock), so the math is unit-tested on synthetic
timestamps. Names and definitions follow `vllm bench serve`, so its readers recognise them:

- TTFT: first content chunk minus request start.
- ITL: the gaps between consecutive content chunks of a request (every gap of every request pooled).
- TPOT: (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token.
- E2EL: end of the stream minus request start.
- Output tokens: the server's `usage.completion_tokens` when it sent usage, else the generated text
  re-encoded by the tokenizer (as vLLM does), else the content chunks (a server may send a token's
  partial UTF-8 bytes as an empty chunk, so chunks can undercount).
- Throughputs divide by the benchmark's duration (first request sent to last stream closed).
- Goodput: requests per second that met every SLO given (`ttft:MS`, `tpot:MS`, `e2el:MS`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from evo.core.records import null_for_nan

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it. Times are seconds on the client's monotonic clock, relative to
    the benchmark's start; `chunk_times` are the arrivals of the chunks that carried content."""

    index: int
    start: float
    end: float
    chunk_times: tuple[float, ...] = ()
    input_len: int = 0  # prompt tokens of the dataset (the server's usage.prompt_tokens wins when sent)
    output_len: int = 0  # max_tokens asked
    prompt_tokens: int | None = None  # usage.prompt_tokens
    completion_tokens: int | None = None  # usage.completion_tokens
    error: str | None = None
    generated_text: str = ""
    text_tokens: int | None = None  # the generated text re-encoded by the tokenizer (used without usage)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        """The server's usage; without it the text re-encoded (as vLLM does); else the content chunks."""
        for count in (self.completion_tokens, self.text_tokens):
            if count is not None:
                return count
        return len(self.chunk_times)

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.input_len

    @property
    def e2el(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> float:
        """A stream that never carried content counts its whole latency as time to first token."""
        return (self.chunk_times[0] if self.chunk_times else self.end) - self.start

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.e2el - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` -> `{"ttft": 200.0, "tpot": 50.0}` (milliseconds); a bad item raises
    ValueError naming it and what is allowed."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput: got {item!r}; allowed: NAME:MILLISECONDS with NAME one of "
                             f"{', '.join(GOODPUT_METRICS)} (e.g. ttft:200 tpot:50)")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not math.isfinite(ms) or ms < 0:
            raise ValueError(f"--goodput: got {item!r}; the SLO must be a number of milliseconds >= 0")
        slos[name] = ms
    return slos


def percentile_key(p: float) -> str:
    """vLLM's spelling of a percentile in metric names: 99 -> 'p99', 99.9 -> 'p99.9'."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float | None]:
    """mean/median/std/pX of `values_s` (seconds) in milliseconds; None when there is no value."""
    import numpy as np  # here, so `python -m evo --help` does not load numpy

    array = np.asarray(values_s, dtype=np.float64) * 1000.0
    out: dict[str, float | None] = {}
    empty = array.size == 0
    out[f"mean_{name}_ms"] = None if empty else float(array.mean())
    out[f"median_{name}_ms"] = None if empty else float(np.median(array))
    out[f"std_{name}_ms"] = None if empty else float(array.std())
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = None if empty else float(np.percentile(array, p))
    return out


def _meets(record: RequestRecord, slos: Mapping[str, float]) -> bool:
    values_ms = {"ttft": record.ttft * 1000, "e2el": record.e2el * 1000,
                 "tpot": (record.tpot or 0.0) * 1000}  # one output token: no per-token time to miss
    return all(values_ms[name] <= limit for name, limit in slos.items())


def compute_metrics(records: Sequence[RequestRecord], duration_s: float, *,
                    percentile_metrics: Sequence[str] = METRICS, metric_percentiles: Sequence[float] = (99,),
                    goodput: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The benchmark's numbers, keyed as `vllm bench serve` keys its result JSON (times in ms).

    `records` in any order; failed ones count only as failures. `duration_s` is the wall time of the
    whole benchmark. Percentile stats are given for `percentile_metrics` only; mean and median always."""
    done = sorted((r for r in records if r.ok), key=lambda r: r.index)
    failed = sorted((r for r in records if not r.ok), key=lambda r: (r.end, r.index))
    duration = max(duration_s, 1e-9)
    total_in = sum(r.input_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    metrics: dict[str, Any] = {
        "duration": duration_s, "completed": len(done), "failed": len(failed), "num_prompts": len(records),
        "first_error": f"request {failed[0].index}: {failed[0].error}" if failed else None,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(done) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "output_len_mismatch": sum(r.output_tokens != r.output_len for r in done),
        "usage_missing": sum(r.completion_tokens is None for r in done),  # counted from text or chunks instead
    }
    if goodput:
        metrics["request_goodput"] = sum(_meets(r, goodput) for r in done) / duration
        metrics["goodput_slos_ms"] = dict(goodput)
    values = {"ttft": [r.ttft for r in done], "tpot": [t for r in done if (t := r.tpot) is not None],
              "itl": [gap for r in done for gap in r.itls], "e2el": [r.e2el for r in done]}
    for name in METRICS:
        stats = _stats(name, values[name], metric_percentiles if name in percentile_metrics else ())
        metrics.update(stats if name in percentile_metrics else
                       {k: v for k, v in stats.items() if k.startswith(("mean_", "median_"))})
    return metrics


def render_table(metrics: Mapping[str, Any], *, percentile_metrics: Sequence[str] = METRICS,
                 metric_percentiles: Sequence[float] = (99,), max_concurrency: int | None = None,
                 request_rate: float = math.inf, label: str | None = None) -> str:
    """The result block `vllm bench serve` prints, with our failed-request line and first error."""
    lines = ["{s:{c}^{n}}".format(s=f" Serving Benchmark Result{f' ({label})' if label else ''} ", n=50, c="=")]

    def row(title: str, value: Any, fmt: str = ".2f") -> None:
        text = "n/a" if value is None else format(value, fmt) if isinstance(value, float) else str(value)
        lines.append(f"{title:<40} {text:<10}")

    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    row("Maximum request concurrency:", max_concurrency if max_concurrency else "unlimited")
    row("Request rate configured (RPS):", "inf" if math.isinf(request_rate) else float(request_rate))
    row("Benchmark duration (s):", float(metrics["duration"]))
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Request throughput (req/s):", float(metrics["request_throughput"]))
    if "request_goodput" in metrics:
        row("Request goodput (req/s):", float(metrics["request_goodput"]))
    row("Output token throughput (tok/s):", float(metrics["output_throughput"]))
    row("Total token throughput (tok/s):", float(metrics["total_token_throughput"]))
    if metrics.get("output_len_mismatch"):
        row("Requests not at their output length:", metrics["output_len_mismatch"])
    if metrics.get("usage_missing"):
        row("Requests without usage (tokens counted):", metrics["usage_missing"])
    for name in METRICS:
        if name not in percentile_metrics:
            continue
        upper = name.upper()
        lines.append("{s:{c}^{n}}".format(s=METRIC_TITLES[name], n=50, c="-"))
        row(f"Mean {upper} (ms):", metrics.get(f"mean_{name}_ms"))
        row(f"Median {upper} (ms):", metrics.get(f"median_{name}_ms"))
        for p in metric_percentiles:
            key = percentile_key(p)
            row(f"{key.upper()} {upper} (ms):", metrics.get(f"{key}_{name}_ms"))
    lines.append("=" * 50)
    if metrics.get("first_error"):
        lines.append(f"first error: {metrics['first_error']}")
    return "\n".join(lines)


def per_request_lists(records: Sequence[RequestRecord]) -> dict[str, list]:
    """vLLM's per-request arrays (seconds), in request index order, plus start/end times."""
    ordered = sorted(records, key=lambda r: r.index)
    return {"input_lens": [r.input_tokens for r in ordered],
            "output_lens": [r.output_tokens if r.ok else 0 for r in ordered],
            "ttfts": [r.ttft if r.ok else 0.0 for r in ordered],
            "itls": [r.itls if r.ok else [] for r in ordered],
            "e2els": [r.e2el if r.ok else 0.0 for r in ordered],
            "start_times": [r.start for r in ordered],
            "errors": [r.error or "" for r in ordered],
            "generated_texts": [r.generated_text for r in ordered]}


def write_result(path: str, result: Mapping[str, Any]) -> None:
    """The result JSON (NaN/inf written as null, so any JSON reader takes it)."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(null_for_nan(dict(result)), handle, indent=1)
        handle.write("\n")
