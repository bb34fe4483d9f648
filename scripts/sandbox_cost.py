"""What the strict sandbox costs per candidate, against `sandbox: none`, on one preset (KDA `cpu_small`).

    .venv/bin/python scripts/sandbox_cost.py [--preset cpu_small] [--rounds 5] [--calls 15]

Interleaved rounds (none, strict, none, strict, ...), the default genome, pinned to the same cores:
- lifecycle: launch (fork, namespaces, mounts, cgroups, user switch, seccomp), configure, build, one
  call and close (kill, reap, verify nothing is left), in seconds;
- one call: the median judge-side latency of `--calls` calls of the built engine;
- one evaluation: `Evaluator.evaluate` of the default genome (status and latency).
Prints a Markdown table (medians over the rounds) and the JSON it is made from.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from evaluators.judge.evaluator import Evaluator
from evaluators.sandbox.guard import hidden_paths
from evaluators.sandbox.process import EngineProcess, workload_modules
from evaluators.settings import EvaluatorSettings

MODES = ("none", "strict")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="kda")
    parser.add_argument("--preset", default="cpu_small")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=15)
    args = parser.parse_args()

    evaluators = {m: Evaluator(args.workload, args.preset, EvaluatorSettings(sandbox=m), seed=7, name=f"cost-{m}")
                  for m in MODES}
    ev = evaluators["strict"]
    workload, preset, info = ev.workload, ev.preset, ev.device_info()
    genome = workload.gene_space(preset, info).default().to_json()
    case = ev._timing_case
    draws = [workload.make_inputs(case, preset.dtype, "cpu", 100 + i) for i in range(args.calls)]
    specs = ev._specs(case)
    figures: dict[str, dict[str, list]] = {m: {"lifecycle_s": [], "call_ms": [], "eval_s": [], "latency_ms": [],
                                               "status": []} for m in MODES}
    EngineProcess("cpu").launch()  # the zygote starts once per judge: not counted
    for _ in range(args.rounds):
        for mode in MODES:
            t0 = time.perf_counter()
            process = EngineProcess("cpu", threads=info.threads, sandbox=mode,
                                    hidden=hidden_paths(workload) if mode == "strict" else ())
            process.launch(preload=workload_modules(workload))
            process.start(workload, preset, info, genome_json=genome, timeout_s=300)
            process.call(draws[0], specs)
            calls = [process.call(x, specs).elapsed_s * 1e3 for x in draws]
            process.close()
            figures[mode]["lifecycle_s"].append(time.perf_counter() - t0 - sum(calls) / 1e3)
            figures[mode]["call_ms"].append(statistics.median(calls))
            r = evaluators[mode].evaluate(genome)
            figures[mode]["eval_s"].append(r.eval_s)
            figures[mode]["latency_ms"].append(r.latency_ms)
            figures[mode]["status"].append(r.status)
    med = {m: {k: statistics.median(v) for k, v in f.items() if k != "status"} for m, f in figures.items()}
    print(f"| {args.workload} {preset.name}, {info.threads} thread(s), medians of {args.rounds} rounds"
          " | sandbox none | sandbox strict | strict - none |")
    print("| --- | ---: | ---: | ---: |")
    for key, label in (("lifecycle_s", "launch + build + first call + close (s)"),
                       ("call_ms", f"one call, median of {args.calls} (ms)"),
                       ("eval_s", "one evaluation (s)"), ("latency_ms", "evaluated latency (ms)")):
        a, b = med["none"][key], med["strict"][key]
        print(f"| {label} | {a:.4g} | {b:.4g} | {b - a:+.3g} |")
    print("statuses:", {m: figures[m]["status"] for m in MODES})
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
