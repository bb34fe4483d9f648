"""Timing hygiene: warm-up apart, device sync around every timer, inputs rotated, median and IQR.

Also measures the machine's ceilings (fp32 matmul FLOP/s, copy bandwidth) for the roofline floor.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch

from evo.workloads.base import Engine, MachineRates


@dataclass(frozen=True)
class Timing:
    """Latency of one engine: median and interquartile range of the timed calls, in milliseconds."""

    median_ms: float
    spread_ms: float
    samples_ms: tuple[float, ...]


def sync(device: str) -> None:
    """Wait for queued device work, so a timer read covers the work and only the work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def summarize(samples_ms: Sequence[float]) -> Timing:
    q1, median, q3 = np.percentile(np.asarray(samples_ms, dtype=np.float64), [25, 50, 75])
    return Timing(float(median), float(q3 - q1), tuple(float(s) for s in samples_ms))


def time_engine(
    engine: Engine,
    input_sets: Sequence[Mapping[str, object]],
    *,
    device: str,
    warmup: int,
    repeats: int,
    min_timing_s: float | None = None,
) -> Timing:
    """Time `engine`: `warmup` untimed calls, then at least `repeats` timed calls (more if
    `min_timing_s` asks for it), call i using input set i mod len(input_sets)."""
    if not input_sets:
        raise ValueError("time_engine needs at least one input set")
    n = len(input_sets)
    for i in range(warmup):
        engine(**input_sets[i % n])
    sync(device)
    samples: list[float] = []
    total_s = 0.0
    i = 0
    while i < repeats or (min_timing_s is not None and total_s < min_timing_s):
        inputs = input_sets[i % n]
        sync(device)
        start = time.perf_counter()
        engine(**inputs)
        sync(device)
        elapsed = time.perf_counter() - start
        samples.append(elapsed * 1e3)
        total_s += elapsed
        i += 1
    return summarize(samples)


@contextmanager
def num_threads(threads: int | None) -> Iterator[None]:
    """Temporarily set torch's intra-op thread count (None: leave it)."""
    previous = torch.get_num_threads()
    if threads is not None and threads != previous:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)


def measure_rates(device: str, threads: int | None = None, repeats: int = 7) -> MachineRates:
    """fp32 matmul FLOP/s (square sgemm) and copy bandwidth (bytes read + written per second),
    each the median of `repeats` after a warm-up."""
    cuda = torch.device(device).type == "cuda"
    n = 4096 if cuda else 1024  # sgemm size: ~15 ms at 145 GFLOP/s on 2 CPU cores
    numel = (1 << 28) if cuda else (1 << 24)  # copy: 1 GiB on GPU, 64 MiB on CPU (beyond caches)
    with num_threads(threads), torch.no_grad():
        a = torch.randn(n, n, device=device)
        b = torch.randn(n, n, device=device)
        out = torch.empty(n, n, device=device)
        matmul_s = _median_seconds(lambda: torch.mm(a, b, out=out), device, repeats)
        del a, b, out
        src = torch.ones(numel, device=device)
        dst = torch.empty_like(src)
        copy_s = _median_seconds(lambda: dst.copy_(src), device, repeats)
        nbytes = src.numel() * src.element_size()
        del src, dst
    return MachineRates(flops_per_s=2.0 * n**3 / matmul_s, bytes_per_s=2.0 * nbytes / copy_s)


def _median_seconds(fn, device: str, repeats: int) -> float:
    fn()
    sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))
