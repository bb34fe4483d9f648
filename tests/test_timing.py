"""Timing hygiene: rotation, warm-up apart, repeats, median/IQR, machine rates."""
from __future__ import annotations

import math
import time

import torch

from evaluators.timing import Timing, measure_rates, num_threads, summarize, time_engine


def test_timing_rotates_input_sets_and_keeps_warmup_apart():
    sets = [{"x": torch.full((4,), float(i))} for i in range(3)]
    seen: list[int] = []

    def engine(x):
        seen.append(id(x))
        return {"o": x * 2}

    timing = time_engine(engine, sets, device="cpu", warmup=2, repeats=7)
    ids = [id(s["x"]) for s in sets]
    assert seen == [ids[i % 3] for i in range(2)] + [ids[i % 3] for i in range(7)]
    assert len(timing.samples_ms) == 7
    assert math.isfinite(timing.median_ms) and timing.median_ms >= 0 and timing.spread_ms >= 0


def test_min_timing_s_extends_repeats():
    timing = time_engine(lambda: time.sleep(0.01) or {}, [{}], device="cpu", warmup=0, repeats=2, min_timing_s=0.1)
    assert len(timing.samples_ms) >= 9
    assert 9 <= timing.median_ms < 50


def test_summary_is_median_and_iqr():
    t = summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert t == Timing(3.0, 2.0, (1.0, 2.0, 3.0, 4.0, 100.0))


def test_num_threads_is_restored():
    before = torch.get_num_threads()
    with num_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_measure_rates_are_positive_and_finite():
    rates = measure_rates("cpu", threads=1, repeats=3)
    for value in (rates.flops_per_s, rates.bytes_per_s):
        assert math.isfinite(value) and value > 0
    assert rates.flops_per_s > 1e8 and rates.bytes_per_s > 1e7  # far below any real machine
