"""One decode step of Kimi Linear's engine against one of the Llama serving engine's, at the same batch, paired.

    .venv/bin/python scripts/decode_step_compare.py                       # cpu presets, 16 rows, 1 thread
    .venv/bin/python scripts/decode_step_compare.py --kimi-set mla_cache=compressed --rows 8

Issue 32's bound: the hybrid's decode step within 1.5x of the Llama engine's at a similar parameter count and
batch (`cpu` presets: Kimi Linear 6.5 M parameters, 3.7 M read a token; Llama 4.9 M, all read). Both engines are
built in this process from hand-written code and genomes of their own gene spaces (defaults, or `--*-set`
values; no genome sources, so no untrusted code runs here), each fills `--rows` rows with prompts of
`--prompt` tokens, then their steps (every row decoded by one token) are timed interleaved, in random order
within each pair, over `--rounds` fresh fills. The ratio (Kimi / Llama) and its 95% interval come from the
paired samples (`evo.core.retiming.paired_timing`).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import yaml

from evo.core.retiming import MIN_PAIRS, paired_timing
from evo.workloads import get_workload
from evo.workloads.base import DeviceInfo
from evo.workloads.generation import GenerationRequest


def _gene(text: str) -> tuple[str, object]:
    """GENE=VALUE, the value read as YAML (as a config override's): true, 16, compressed."""
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected GENE=VALUE, e.g. mla_cache=compressed; got {text!r}")
    try:
        return name, yaml.safe_load(raw)
    except yaml.YAMLError:
        raise argparse.ArgumentTypeError(f"{text!r}: {raw!r} is not a YAML value") from None


def _filled(workload, preset, genes: dict, rows: int, prompt: int, rng: np.random.Generator):
    """The engine with `rows` requests admitted (their prefill done): it is ready to decode them together."""
    device = DeviceInfo("cpu", "cpu", 1)
    generator = workload.build_generator(workload.gene_space(preset, device).make(genes), preset, device)
    steps = preset.shape["N"] - 1
    for i in range(rows):
        generator.add(GenerationRequest(i, tuple(rng.integers(0, preset.shape["V"], prompt).tolist()), steps + 1))
    generator.step()  # admits and prefills every row (their first tokens)
    return generator, steps


def _timed(generator) -> float:
    start = time.perf_counter()
    generator.step()
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16, help="requests decoding together (default 16)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens of each (default 64)")
    p.add_argument("--steps", type=int, default=40, help="paired steps per round (default 40)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kimi-preset", default="cpu")
    p.add_argument("--llama-preset", default="cpu")
    p.add_argument("--kimi-set", nargs="*", type=_gene, default=[], metavar="GENE=VALUE")
    p.add_argument("--llama-set", nargs="*", type=_gene, default=[], metavar="GENE=VALUE")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed)
    engines = {"kimi_linear": (get_workload("kimi_linear"), args.kimi_preset, dict(args.kimi_set)),
               "llama_serve": (get_workload("llama_serve"), args.llama_preset, dict(args.llama_set))}
    samples: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        filled = {name: _filled(w, w.presets()[preset], genes, args.rows, args.prompt, rng)
                  for name, (w, preset, genes) in engines.items()}
        steps = min(args.steps, *(n for _, n in filled.values()))
        for name, (generator, _) in filled.items():
            _timed(generator)  # a warm step
        for _ in range(steps - 1):
            order = list(filled)
            rng.shuffle(order)
            for name in order:
                samples[name].append(_timed(filled[name][0]))
    if len(samples["kimi_linear"]) < MIN_PAIRS:
        p.error(f"{len(samples['kimi_linear'])} paired steps; an interval needs >= {MIN_PAIRS}: raise --steps or --rounds")
    timing = paired_timing("kimi_linear", "llama_serve", samples["kimi_linear"], samples["llama_serve"], 0.02)
    for name, (w, preset, genes) in engines.items():
        spec = w.presets()[preset].model
        print(f"{name:12s} {preset:8s} median step {statistics.median(samples[name]):7.3f} ms over"
              f" {len(samples[name])} steps of {args.rows} rows ({spec.parameters() / 1e6:.1f} M"
              f" parameters; genes {genes or 'default'})")
    print(f"kimi_linear / llama_serve decode step: {timing.ratio:.2f}x [95% {timing.low:.2f}, {timing.high:.2f}]"
          f" (issue 32's bound: 1.5x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
