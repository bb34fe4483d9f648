"""What each Serve verification mode costs a generation engine: `sampled` (guards, canaries, a re-scored sample)
against `all` (every token checked against the float64 reference before release).

    .venv/bin/python scripts/serve_mode_cost.py [--workload llama_serve] [--preset cpu] [--modes sampled,all]
        [--rounds 1] [--clients 16] [--requests 48] [--sandbox strict] [--verify-chunk 8] [--canary-every 8]
        [--rescore-fraction 0.05] [--seed 0] [--genes JSON] [--accuracy JSON]

One `ServedGenerator` in this process (its engine in the judge's jail, checked by the judge's check replay),
driven the way Serve's routes drive it: `--clients` threads, each taking the next of `--requests` greedy
requests (prompt and output lengths drawn once from `--seed` over the preset's trace bounds, the same shapes
for every mode; the prompts drawn afresh for each run so nothing cached flatters one) and reading its stream.
Every token is stamped on the client's clock when it receives it; `evo.core.stream_metrics` gives output
tokens/s, TTFT, TPOT and ITL. Under `sampled` each finished request is offered to the replica's `Rescorer` at
`--rescore-fraction`, as the app does. Modes alternate within a round (the order flips every round); two warm-up
requests before each run are not counted. The machine's load average is stamped on every run (the 2-core
development machine is shared). Prints one JSON line per run and a Markdown table (medians over rounds).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from evaluators.served.generator import ServedGenerator, ServedGeneratorError
from evaluators.served.guards import ServePolicy
from evaluators.settings import EvaluatorSettings
from evo.core.stream_metrics import RequestTimeline, serving_metrics
from evo.serving.rescoring import Rescorer
from evo.workloads import get_workload

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="llama_serve")
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--modes", default="sampled,all")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--sandbox", default="strict")
    parser.add_argument("--verify-chunk", type=int, default=8)
    parser.add_argument("--canary-every", type=int, default=8)
    parser.add_argument("--rescore-fraction", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--genes", default="{}", help="JSON genes replacing the default genome's (e.g. a lossy "
                        "linear_kernel; judged in the --accuracy mode)")
    parser.add_argument("--accuracy", default="{}", help='JSON evaluator.accuracy, e.g. {"mode": "budget", '
                        '"against": "bfloat16"} for a lossy genome')
    args = parser.parse_args()
    workload = get_workload(args.workload)
    preset = workload.presets()[args.preset]
    shapes = _shapes(preset, args.requests, np.random.default_rng(args.seed))
    started = time.perf_counter()
    genome = workload.gene_space(preset, _cpu()).default().with_genes(**json.loads(args.genes))
    served = ServedGenerator(args.workload, args.preset, genome.to_json(),
                             settings=EvaluatorSettings(sandbox=args.sandbox, accuracy=json.loads(args.accuracy)))
    print(json.dumps({"environment": _environment(), "start_s": time.perf_counter() - started,
                      "judged": served.judged.to_dict()}), flush=True)
    modes = args.modes.split(",")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    prompts = np.random.default_rng()  # fresh prompts every run
    try:
        for round_ in range(args.rounds):
            for mode in (modes if round_ % 2 == 0 else modes[::-1]):
                served.policy = ServePolicy(verify=mode, verify_chunk=args.verify_chunk, canary_every=args.canary_every)
                report = _run(served, shapes, prompts, args, mode)
                print(json.dumps({"mode": mode, "round": round_, **report}), flush=True)
                runs[mode].append(report)
    finally:
        served.close()
    keys = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms", "e2el_p50_ms", "verifier_busy_s")
    print("\n| mode | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | ITL p50 ms | E2E p50 ms "
          "| verifier busy s | errors |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for mode, reports in runs.items():
        med = {k: statistics.median(r[k] for r in reports) for k in (*keys, "errors")}
        print(f"| {mode} | {med['output_tok_s']:.1f} | {med['ttft_p50_ms']:.0f} | {med['ttft_p99_ms']:.0f} | "
              f"{med['tpot_p50_ms']:.1f} | {med['itl_p50_ms']:.1f} | {med['e2el_p50_ms']:.0f} | "
              f"{med['verifier_busy_s']:.1f} | {med['errors']:g} |")


def _shapes(preset, count: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """(prompt length, max_tokens) per request, uniform over the preset's trace bounds."""
    (p_lo, p_hi), (n_lo, n_hi) = preset.trace.prompt_len, preset.trace.output_len
    return [(int(rng.integers(p_lo, p_hi + 1)), int(rng.integers(n_lo, n_hi + 1))) for _ in range(count)]


def _run(served: ServedGenerator, shapes, rng: np.random.Generator, args, mode: str) -> dict:
    vocab = served.vocab
    rescorer = Rescorer(lambda loaded, why: print(json.dumps({"rescoring_failed": why}), flush=True))
    rescorer.fraction = args.rescore_fraction if mode == "sampled" else 0.0
    loaded = SimpleNamespace(engine=served, record=SimpleNamespace(genome=SimpleNamespace(hash=served.label)))
    for _ in range(2):  # warm-up, not counted
        list(served.submit(rng.integers(0, vocab, 16).tolist(), 8))
    _settle(served)
    busy0, canaries0 = served.guard_info()["verifier"]["busy_s"], served.stats["canaries"]
    asks = [(rng.integers(0, vocab, p).tolist(), n) for p, n in shapes]
    timelines: list[RequestTimeline | None] = [None] * len(asks)
    errors = []
    lock, next_i = threading.Lock(), [0]
    load0 = os.getloadavg()[0]

    def client() -> None:
        while True:
            with lock:
                i, next_i[0] = next_i[0], next_i[0] + 1
            if i >= len(asks):
                return
            prompt, n = asks[i]
            sent = time.perf_counter()
            stamps, tokens = [], []
            try:
                stream = served.submit(prompt, n)
                for token in stream:
                    stamps.append(time.perf_counter())
                    tokens.append(token.token)
            except ServedGeneratorError as exc:
                errors.append(str(exc))
                return
            timelines[i] = RequestTimeline(sent, tuple(stamps), len(prompt))
            rescorer.offer(loaded, [(stream.request, tokens)])

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = [t for t in timelines if t is not None]
    end = max(t.token_s[-1] for t in done)
    shifted = [RequestTimeline(t.sent_s - start, tuple(s - start for s in t.token_s), t.prompt_len) for t in done]
    metrics = serving_metrics(shifted, end - start)
    rescorer.wait_idle()
    _settle(served)
    return {"requests": len(done), "errors": len(errors), "output_tokens": metrics.total_output_tokens,
            "duration_s": metrics.duration_s, "output_tok_s": metrics.output_throughput,
            "ttft_p50_ms": metrics.ttft_ms["median"], "ttft_p99_ms": metrics.ttft_ms["p99"],
            "tpot_p50_ms": metrics.tpot_ms["median"], "itl_p50_ms": metrics.itl_ms["median"],
            "e2el_p50_ms": metrics.e2el_ms["median"],
            "verifier_busy_s": served.guard_info()["verifier"]["busy_s"] - busy0,
            "rescored": rescorer.stats["sampled"], "canaries": served.stats["canaries"] - canaries0,
            "failure": None if served.failure is None else str(served.failure),
            "load_avg_1m": [load0, os.getloadavg()[0]]}


def _settle(served: ServedGenerator, timeout_s: float = 600.0) -> None:
    """Until the canaries and verifications still queued are done (they must not spill into the next run)."""
    deadline = time.monotonic() + timeout_s
    while not served.idle and served.failure is None and time.monotonic() < deadline:
        time.sleep(0.05)


def _cpu():
    from evaluators.machine import device as devices

    return devices.device_info("cpu", 1)


def _environment() -> dict:
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    commit = git("rev-parse", "--short", "HEAD") + ("+uncommitted" if git("status", "--porcelain", "--untracked-files=no")
                                                    else "")
    return {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "commit": commit,
            "at": time.strftime("%Y-%m-%d %H:%M")}


if __name__ == "__main__":
    main()
