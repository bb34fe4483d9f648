"""Microbenchmark of the int8 projection kernels (`int8`) against the float F.linear they replace.

    .venv/bin/python -m evo.workloads.llama.int8_bench                 # llama_serve cpu preset, rows 1 and 16
    .venv/bin/python -m evo.workloads.llama.int8_bench --threads 1 --rows 1 4 16

Shapes: the decoder projections of the preset's model ([out, in]: packed qkv, o, packed gate_up, down).
Per shape, row count and activation dtype: F.linear on the float weight, torch.mm on it pretransposed (the
default weight_layout), and each int8 kernel on the quantised one, timed interleaved in a random order each
round (so a busy host slows all alike), on inputs rotated over 8 buffers; median and interquartile range in us.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from evo.workloads.llama.int8 import dequantised, int8pack, quantise_rows
from evo.workloads.llama_serve.presets import PRESETS


def projection_shapes(preset: str) -> dict[str, tuple[int, int]]:
    m = PRESETS[preset].model
    D, hd, I = m.hidden, m.head_dim, m.intermediate
    return {"qkv": ((m.heads + 2 * m.kv_heads) * hd, D), "o": (D, m.heads * hd), "gate_up": (2 * I, D), "down": (D, I)}


def _candidates(N: int, K: int, rows: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    w = torch.randn(N, K, generator=gen) / K**0.5
    q, scale = quantise_rows(w)
    scale, wd = scale.to(dtype), w.to(dtype)
    wt = wd.t().contiguous()
    xs = [torch.randn(rows, K, generator=gen).to(dtype) for _ in range(8)]
    return {"F.linear": lambda i: F.linear(xs[i % 8], wd), "mm_pretransposed": lambda i: torch.mm(xs[i % 8], wt),
            "int8pack": lambda i: int8pack(xs[i % 8], q, scale), "dequantised": lambda i: dequantised(xs[i % 8], q, scale)}


def time_interleaved(fns: dict, rounds: int, rng: np.random.Generator) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for i in range(rounds + 20):  # the first 20 rounds warm up
        for name in rng.permutation(names):
            start = time.perf_counter()
            fns[name](i)
            if i >= 20:
                times[name].append((time.perf_counter() - start) * 1e6)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--rounds", type=int, default=400)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {platform.processor() or platform.machine()}, "
          f"{args.threads} threads, preset {args.preset}; median [IQR] us")
    gen, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    for dtype in (torch.float32, torch.bfloat16):
        for rows in args.rows:
            for name, (N, K) in projection_shapes(args.preset).items():
                times = time_interleaved(_candidates(N, K, rows, dtype, gen), args.rounds, rng)
                cells = []
                for kernel, t in times.items():
                    q1, med, q3 = statistics.quantiles(t, n=4)
                    cells.append(f"{kernel} {med:7.1f} [{q1:.0f}-{q3:.0f}]")
                print(f"{str(dtype)[6:]:8s} rows={rows:2d} {name:7s} {N}x{K}: " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
