"""Timing helpers: device sync, median and IQR of timed calls, and the machine's ceilings (matmul
FLOP/s per arithmetic, copy bandwidth) for the roofline floor. The calls themselves are timed by the
judge around each call to an isolated engine (evaluators/sandbox/process.py, evaluators/judge/evaluator.py).
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from evaluators.machine.device import sync  # noqa: F401 - the judge's timers sync through it
from evo.workloads.base import MachineRates


@dataclass(frozen=True)
class Timing:
    """Latency of one engine: median and interquartile range of the timed calls, in milliseconds."""

    median_ms: float
    spread_ms: float
    samples_ms: tuple[float, ...]


def summarize(samples_ms: Sequence[float]) -> Timing:
    q1, median, q3 = np.percentile(np.asarray(samples_ms, dtype=np.float64), [25, 50, 75])
    return Timing(float(median), float(q3 - q1), tuple(float(s) for s in samples_ms))


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


# The arithmetic an engine may use for a preset of each I/O dtype (see MachineRates).
ARITHMETIC: dict[str, tuple[str, ...]] = {"float32": ("float32",), "bfloat16": ("float32", "tf32", "bfloat16"),
                                          "float16": ("float32", "tf32", "float16")}


def measure_rates(device: str, preset_dtype: str = "float32", threads: int | None = None,
                  repeats: int = 7) -> MachineRates:
    """Matmul FLOP/s (square gemm) for each arithmetic the preset allows (tf32 on CUDA only) and copy
    bandwidth (bytes read + written per second), each from the fastest of `repeats` after a warm-up: a
    ceiling is what the machine can do, and load from other processes only ever slows a repeat down."""
    cuda = torch.device(device).type == "cuda"
    allowed = ARITHMETIC.get(preset_dtype, ("float32",))
    rates: dict[str, float] = {}
    with num_threads(threads), torch.no_grad():
        for arithmetic in allowed:
            if arithmetic == "tf32" and not cuda:
                continue
            rates[arithmetic] = _matmul_rate(device, arithmetic, repeats)
        numel = (1 << 28) if cuda else (1 << 24)  # copy: 1 GiB on GPU, 64 MiB on CPU (beyond caches)
        src = torch.ones(numel, device=device)
        dst = torch.empty_like(src)
        copy_s = _best_seconds(lambda: dst.copy_(src), device, repeats)
        nbytes = src.numel() * src.element_size()
        del src, dst
    return MachineRates(flops_per_s=max(rates.values()), bytes_per_s=2.0 * nbytes / copy_s, matmul_flops=rates)


def probe_rates(device: str, preset_dtype: str = "float32", threads: int | None = None, probes: int = 3,
                repeats: int = 3, pause_s: float = 0.05) -> MachineRates:
    """The best of `probes` short `measure_rates` probes, a pause apart so one burst of load from other
    processes does not spoil them all (each rate its maximum)."""
    best = measure_rates(device, preset_dtype, threads, repeats)
    for _ in range(probes - 1):
        time.sleep(pause_s)
        best = best.merged_max(measure_rates(device, preset_dtype, threads, repeats))
    return best


def floor_rates(preset_dtype: str, matmul_flops: dict[str, float], bytes_per_s: float) -> MachineRates:
    """MachineRates from known rates (e.g. published or measured elsewhere): the floor uses the fastest
    arithmetic the preset allows."""
    allowed = [matmul_flops[a] for a in ARITHMETIC.get(preset_dtype, ("float32",)) if a in matmul_flops]
    if not allowed:
        raise ValueError(f"no matmul rate for the arithmetic a {preset_dtype} preset allows "
                         f"({ARITHMETIC.get(preset_dtype)}); got {sorted(matmul_flops)}")
    return MachineRates(max(allowed), bytes_per_s, dict(matmul_flops))


def _matmul_rate(device: str, arithmetic: str, repeats: int) -> float:
    cuda = torch.device(device).type == "cuda"
    n = 4096 if cuda else 1024  # ~15 ms for fp32 at 145 GFLOP/s on 2 CPU cores
    if not cuda and arithmetic != "float32":
        n = 512  # CPU bf16 gemm is slow; keep the measurement short
    dtype = torch.float32 if arithmetic in ("float32", "tf32") else getattr(torch, arithmetic)
    with matmul_tf32(arithmetic == "tf32") if cuda else nullcontext():
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        out = torch.empty(n, n, device=device, dtype=dtype)
        seconds = _best_seconds(lambda: torch.mm(a, b, out=out), device, repeats)
    return 2.0 * n**3 / seconds


@contextmanager
def matmul_tf32(enabled: bool) -> Iterator[None]:
    """cuBLAS float32 matmuls in tf32 (True) or full float32 (False) inside the block, the previous
    setting restored after. Uses torch's current API (`torch.backends.cuda.matmul.fp32_precision`);
    the legacy `allow_tf32` flag only where that is absent (torch < 2.9): reading the legacy flag
    raises once anything in the process has used the current API."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        previous = matmul.fp32_precision
        matmul.fp32_precision = "tf32" if enabled else "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = previous
        return
    previous_flag = matmul.allow_tf32
    matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        matmul.allow_tf32 = previous_flag


def _best_seconds(fn, device: str, repeats: int) -> float:
    fn()
    sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - start)
    return float(min(samples))
