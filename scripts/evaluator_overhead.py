"""What running engines apart from the judge costs, on one preset (KDA `cpu` by default).

    .venv/bin/python scripts/evaluator_overhead.py [--preset cpu] [--calls 21] [--threads 1]

Measures, for the preset's default genome, pinned to the same cores:
- start: forking the engine's process and building the engine there, against building it in-process;
- per call: the judge's wall clock around one call of the isolated engine (inputs written to the
  shared arena beforehand, outputs copied into it before the answer) against a plain in-process call
  on the same kind of fresh inputs;
- per candidate: a whole evaluation (`Evaluator.evaluate`), split into the isolation overhead above
  and the rest (checks, reference computations, timed calls).
Prints a Markdown table and the JSON it is made from.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from evaluators.judge.evaluator import Evaluator
from evaluators.sandbox.process import EngineProcess, workload_modules
from evaluators.settings import EvaluatorSettings
from evo.workloads import get_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="kda")
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--calls", type=int, default=21)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--evaluations", type=int, default=3)
    args = parser.parse_args()

    cores = tuple(sorted(os.sched_getaffinity(0))[: args.threads])
    settings = EvaluatorSettings(warmup=2, repeats=11)
    evaluator = Evaluator(args.workload, args.preset, settings, seed=2026, name="overhead", cores=cores)
    workload, preset, info = evaluator.workload, evaluator.preset, evaluator.device_info()
    genome = workload.gene_space(preset, info).default()
    case = evaluator._timing_case
    dtypes = {k: v for k, v in evaluator._dtypes.items()}
    draws = [workload.make_inputs(case, preset.dtype, "cpu", 1000 + i) for i in range(args.calls)]
    reference = workload.reference(draws[0])
    specs = {name: (tuple(reference[name].shape), dtype) for name, dtype in dtypes.items()}

    with EngineProcess("cpu", threads=info.threads) as warm:  # the zygote starts once per judge: not counted
        warm.launch()

    t0 = time.perf_counter()
    engine = workload.build(genome, preset, info)
    with torch.no_grad():
        engine(**draws[0])
    inprocess_build = time.perf_counter() - t0

    inprocess, isolated = [], []
    t0 = time.perf_counter()
    with EngineProcess("cpu", threads=info.threads) as process:
        process.launch(preload=workload_modules(workload))
        process.start(workload, preset, info, genome_json=genome.to_json())
        process.call(draws[0], specs)
        isolated_build = time.perf_counter() - t0
        for inputs in draws:  # alternate, so both see the same machine
            with torch.no_grad():
                t = time.perf_counter()
                engine(**inputs)
                inprocess.append((time.perf_counter() - t) * 1e3)
            isolated.append(process.call(inputs, specs).elapsed_s * 1e3)

    evaluations = [evaluator.evaluate(genome.to_json()) for _ in range(args.evaluations)]
    eval_s = statistics.median(r.eval_s for r in evaluations)
    calls = 1 + sum(len(stage) for stage in workload.check_cases(preset)) + settings.warmup + settings.repeats
    per_call = statistics.median(isolated) - statistics.median(inprocess)
    start = isolated_build - inprocess_build
    overhead = start + calls * per_call / 1e3
    figures = {
        "preset": preset.name, "threads": info.threads, "device": f"{info.kind}:{info.name}",
        "start_isolated_s": isolated_build, "start_in_process_s": inprocess_build,
        "call_isolated_ms": statistics.median(isolated), "call_in_process_ms": statistics.median(inprocess),
        "call_overhead_ms": per_call, "calls_per_candidate": calls, "evaluation_s": eval_s,
        "isolation_overhead_s": overhead, "isolation_overhead_fraction": overhead / eval_s,
        "statuses": [r.status for r in evaluations], "latencies_ms": [r.latency_ms for r in evaluations],
    }
    print(f"| {args.workload} {preset.name}, {info.threads} thread(s) | isolated | in-process | overhead |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| start + build + first call (s) | {isolated_build:.3f} | {inprocess_build:.3f} | {start:+.3f} |")
    print(f"| one call, median of {args.calls} (ms) | {figures['call_isolated_ms']:.3f} |"
          f" {figures['call_in_process_ms']:.3f} | {per_call:+.3f} |")
    print(f"| one evaluation ({calls} calls, s) | {eval_s:.2f} | | {overhead:+.3f} ({100 * overhead / eval_s:.1f}%) |")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
