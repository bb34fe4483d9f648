"""Time a run's best engine against every baseline, in one process, with the same check and timing.

    .venv/bin/python scripts/benchmark.py RUN_DIR [--threads 1] [--repeats 21] [--paired-calls 16]

Each engine goes through the evaluator's full correctness cascade on fresh inputs before timing
(median and IQR of repeats, warm-up apart, rotated inputs). Then the best engine is re-timed paired
against every baseline that passed, all interleaved in one run (`evaluators.judge.paired`): the speedups
claimed are those ratios with their 95% intervals and verdicts. Prints a Markdown table and writes
benchmark.json into RUN_DIR, stamped with device, threads and versions.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(".inductor_cache"))

from evaluators.judge.evaluator import Evaluator  # noqa: E402
from evaluators.settings import EvaluatorSettings  # noqa: E402
from evo.evidence.journal import write_json  # noqa: E402
from evo.workloads import get_workload  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--threads", type=int, default=1, help="pinned cores (the search's evaluators.threads)")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--paired-calls", type=int, default=16,
                        help="paired calls per engine in the re-timing of the best against the baselines (0: none)")
    args = parser.parse_args()

    summary = json.loads((args.run_dir / "summary.json").read_text())
    if not summary.get("best_genome"):
        print(f"{args.run_dir} has no best genome", file=sys.stderr)
        return 1
    workload = get_workload(summary["workload"])
    preset = workload.presets()[summary["preset"]]
    settings = EvaluatorSettings(warmup=3, repeats=args.repeats, build_timeout_s=900, baseline_build_timeout_s=900)
    cores = tuple(sorted(os.sched_getaffinity(0))[: args.threads])
    evaluator = Evaluator(summary["workload"], summary["preset"], settings, args.seed, "benchmark", cores)

    results = {"best": evaluator.evaluate(json.dumps(summary["best_genome"]))}
    for name in workload.baselines(preset):
        results[name] = evaluator.evaluate_baseline(name)
    roofline = workload.roofline(preset, evaluator.measure_rates())
    best = results["best"]
    passing = {n: r for n, r in results.items() if n != "best" and r.ok}
    top = min(passing, key=lambda n: passing[n].latency_ms) if passing else None

    paired = {}
    if args.paired_calls and best.ok and passing:
        for t in evaluator.retime([json.dumps(summary["best_genome"]), *(f"baseline:{n}" for n in passing)],
                                  calls=args.paired_calls, warmup=3, reason="benchmark"):
            paired[t.b.removeprefix("baseline:")] = t

    shape = " ".join(f"{k}={v}" for k, v in preset.shape.items())
    print(f"KDA forward, preset {preset.name} ({shape}, {preset.dtype}), {best.device}, {args.threads} thread(s)")
    print("| engine | status | median ms | IQR ms | max rel err | speedup of best (single timings) "
          "| speedup of best, paired [95%] | verdict on best |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, r in results.items():
        label = f"best engine `{summary['best_hash']}`" if name == "best" else name
        speed = best.latency_ms / best.latency_ms if name == "best" else r.latency_ms / best.latency_ms
        t = paired.get(name)
        claim = ("— | —" if t is None else f"failed | {t.message[:60]}" if t.verdict == "failed"
                 else f"{t.speedup[0]:.2f}x [{t.speedup[1]:.2f}, {t.speedup[2]:.2f}] | {t.verdict}")
        print(f"| {label} | {r.status} | {r.latency_ms:.2f} | {r.latency_spread_ms:.2f} | {r.max_rel_error:.1e} |"
              f" {speed:.2f}x | {claim} |")
    fraction = roofline.floor_ms / best.latency_ms
    print(f"\nbest engine vs best baseline ({top}): {passing[top].latency_ms / best.latency_ms:.2f}x single timings"
          + (f", {paired[top].speedup[0]:.2f}x [95% {paired[top].speedup[1]:.2f}, {paired[top].speedup[2]:.2f}]"
             f" paired ({paired[top].verdict})" if top in paired else "") if top else "")
    print(f"roofline floor {roofline.floor_ms:.3f} ms ({roofline.flops / 1e9:.2f} GFLOP at "
          f"{roofline.rates.flops_per_s / 1e9:.0f} GFLOP/s, {roofline.bytes / 1e6:.1f} MB at "
          f"{roofline.rates.bytes_per_s / 1e9:.1f} GB/s): best engine at {100 * fraction:.1f}% of the floor")
    write_json(args.run_dir / "benchmark.json", {
        "threads": args.threads, "results": {n: r.to_dict() for n, r in results.items()},
        "best_baseline": top, "speedup_vs_best_baseline": passing[top].latency_ms / best.latency_ms if top else None,
        "roofline_floor_ms": roofline.floor_ms, "fraction_of_roofline": fraction,
        "speedup_ci": {n: [t.speedup[1], t.speedup[2]] for n, t in paired.items()},
        "speedup_paired": {n: t.speedup[0] for n, t in paired.items()},
        "retimings": [t.to_dict() for t in paired.values()],
    })
    return 0 if best.ok else 1


if __name__ == "__main__":
    sys.exit(main())
