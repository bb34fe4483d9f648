"""Timing helpers: median/IQR, thread scoping, the machine's ceilings per arithmetic."""
from __future__ import annotations

import math

import pytest
import torch

from evaluators.judge.timing import ARITHMETIC, Timing, floor_rates, measure_rates, num_threads, summarize
from evo.workloads.base import MachineRates
from evo.workloads.kda import WORKLOAD as KDA


def test_summary_is_median_and_iqr():
    t = summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert t == Timing(3.0, 2.0, (1.0, 2.0, 3.0, 4.0, 100.0))


def test_num_threads_is_restored():
    before = torch.get_num_threads()
    with num_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_measure_rates_are_positive_finite_and_per_arithmetic():
    rates = measure_rates("cpu", "float32", threads=1, repeats=3)
    for value in (rates.flops_per_s, rates.bytes_per_s):
        assert math.isfinite(value) and value > 0
    assert rates.flops_per_s > 1e8 and rates.bytes_per_s > 1e7  # far below any real machine
    assert set(rates.matmul_flops) == {"float32"} and rates.flops_per_s == rates.matmul_flops["float32"]
    bf16 = measure_rates("cpu", "bfloat16", threads=1, repeats=3)
    assert set(bf16.matmul_flops) == {"float32", "bfloat16"}  # no tf32 on a CPU
    assert bf16.flops_per_s == max(bf16.matmul_flops.values())


# Measured on one H200 (shared/ENVIRONMENT.md): bf16 773 TFLOP/s, tf32 434, fp32 50.7; copy 4.1 TB/s.
H200 = {"float32": 50.7e12, "tf32": 434e12, "bfloat16": 773e12}


def test_the_floor_uses_the_arithmetic_the_preset_allows():
    h200 = KDA.presets()["h200"]
    rates = floor_rates(h200.dtype, H200, 4.1e12)
    floor = KDA.roofline(h200, rates).floor_ms
    assert 0.2 < floor < 0.3  # memory bound: ~1.0 GB moved at 4.1 TB/s
    assert not 1.3 < floor  # an engine at FlashKDA's ~1.3 ms is not below the floor: not suspect
    fp32_only = KDA.roofline(h200, MachineRates(H200["float32"], 4.1e12)).floor_ms
    assert fp32_only > 1.3  # the old fp32-sgemm floor (1.68 ms) would have called it suspect
    assert floor_rates("float32", H200, 4.1e12).flops_per_s == H200["float32"]  # tf32 fails fp32 tolerance
    assert ARITHMETIC["bfloat16"] == ("float32", "tf32", "bfloat16")
    with pytest.raises(ValueError, match="no matmul rate"):
        floor_rates("bfloat16", {"float64": 1.0}, 1.0)


def test_merged_max_keeps_the_higher_of_each_rate():
    a = MachineRates(1.0, 5.0, {"float32": 1.0})
    b = MachineRates(2.0, 3.0, {"float32": 0.5, "bfloat16": 2.0})
    assert a.merged_max(b) == MachineRates(2.0, 5.0, {"float32": 1.0, "bfloat16": 2.0})


def test_tf32_switch_uses_the_current_api_and_restores_it():
    """Once the current fp32_precision API was used, the legacy allow_tf32 read raises; the switch the
    rate measurement uses must not read it (a CPU test: the flags are process-wide settings)."""
    from evaluators.judge.timing import matmul_tf32

    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    try:
        matmul.fp32_precision = "ieee"  # the current API, used
        with matmul_tf32(True):
            assert matmul.fp32_precision == "tf32"
        assert matmul.fp32_precision == "ieee"
        with matmul_tf32(False):
            assert matmul.fp32_precision == "ieee"
    finally:
        matmul.fp32_precision = before
