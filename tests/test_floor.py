"""One sound roofline floor per run (issue 29): a machine-rate probe that reads low once must neither make
an honest engine look faster than the machine allows nor print a fraction of the floor above 100%."""
from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest

from evaluators.judge import calibration
from evaluators.judge import evaluator as evaluator_module
from evaluators.judge.evaluator import Evaluator
from evaluators.settings import EvaluatorSettings
from evo.core.records import OK
from evo.driver.progress import SUMMARY
from evo.driver.run import _print_summary, measure_floor, settle_floor
from evo.evidence.floor import RunFloor, floor_text
from evo.evidence.mlflow.describe import roofline_text
from evo.evidence.summary import Summary
from evo.workloads.base import MachineRates, Roofline
from tests import fake_workload as fw

FAST = EvaluatorSettings(warmup=1, repeats=3)
LOW = MachineRates(flops_per_s=1e6, bytes_per_s=1e6, matmul_flops={"float32": 1e6})  # a probe under load
GOOD = MachineRates(flops_per_s=1e15, bytes_per_s=1e15, matmul_flops={"float32": 1e15})  # what the machine does


class Probe:
    """The machine-rate probe: reads low the first `low` times, then what the machine really does."""

    def __init__(self, low: int = 1) -> None:
        self.low, self.calls = low, 0

    def __call__(self, *args, **kwargs) -> MachineRates:
        self.calls += 1
        return LOW if self.calls <= self.low else GOOD


class LocalPool:
    """The pool's rate calls on one plain evaluator (no Ray)."""

    def __init__(self, ev: Evaluator) -> None:
        self.ev = ev

    def calibrate(self):
        return self.ev.calibration()

    def use_rates(self, rates: MachineRates) -> None:
        self.ev.use_rates(rates)

    def best_rates(self) -> MachineRates:
        return self.ev.measure_rates(again=True)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.ENV, str(tmp_path / "rates"))
    return tmp_path / "rates"


def parts_for(ev: Evaluator) -> SimpleNamespace:
    return SimpleNamespace(pool=LocalPool(ev), workload=ev.workload, preset=ev.preset)


def percentages(text: str) -> list[float]:
    return [float(p) for p in re.findall(r"(\d+(?:\.\d+)?)%", text)]


def test_a_probe_that_reads_low_once_is_revised_and_never_printed_above_100(fake, cache, monkeypatch, tmp_path,
                                                                           caplog):
    probe = Probe(low=1)
    monkeypatch.setattr(evaluator_module, "probe_rates", probe)
    ev = Evaluator(fake, "cpu", FAST, seed=1, name="ev")
    parts = parts_for(ev)
    floor = measure_floor(parts)  # the driver's one floor: from the low probe, far too high
    low_floor_ms = ev.workload.roofline(ev.preset, LOW).floor_ms
    assert floor.floor_ms == low_floor_ms and floor.source == calibration.MEASURED
    assert ev.roofline_floor_ms() == floor.floor_ms  # the evaluator judges by the floor the summary shows

    result = ev.evaluate(fw.genome_json("cumsum"))  # far below the low floor: the evaluator re-measures
    assert result.status == OK, result.message
    assert probe.calls == 2
    sound_ms = ev.workload.roofline(ev.preset, GOOD).floor_ms
    assert result.roofline_floor_ms == sound_ms < result.latency_ms  # honest, judged by the sound floor
    assert calibration.cached(ev._rates_key) == GOOD  # the machine's calibration was raised

    best = SimpleNamespace(result=result, proposal=SimpleNamespace(hash="h1"))
    settled = settle_floor(parts, SimpleNamespace(best=lambda: best), floor)
    assert settled.floor_ms == sound_ms and len(settled.revisions) == 1
    entry = settled.entry(result.latency_ms)
    assert entry["revised_from_ms"] == low_floor_ms and entry["source"] == "revised"
    assert entry["revisions"][0]["from_ms"] == low_floor_ms and "h1" in entry["revisions"][0]["reason"]
    assert 0 < entry["fraction_of_floor"] <= 1 and not entry["below_floor"]

    summary = Summary.from_dict(Summary(workload="fake", preset="cpu", best_hash="h1",
                                        best_latency_ms=result.latency_ms, roofline=entry).to_dict())
    assert summary.roofline["revisions"] == entry["revisions"]
    with caplog.at_level(SUMMARY, logger="evo.run"):
        _print_summary(summary, tmp_path)
    printed = caplog.text + "\n" + roofline_text(summary)
    assert "of the roofline floor" in printed and f"revised from {low_floor_ms:.3f} ms" in printed
    assert all(p <= 100 for p in percentages(printed)), printed


def test_the_machine_cache_keeps_the_next_runs_floor_sound(fake, cache, monkeypatch):
    monkeypatch.setattr(evaluator_module, "probe_rates", Probe(low=0))
    first = Evaluator(fake, "cpu", FAST, seed=1, name="ev")
    assert first.calibration().rates == GOOD and first.calibration().source == calibration.MEASURED
    monkeypatch.setattr(evaluator_module, "probe_rates", Probe(low=1))  # the next run starts under load
    ev = Evaluator(fake, "cpu", FAST, seed=1, name="ev")
    floor = measure_floor(parts_for(ev))
    assert floor.source == calibration.CACHED and floor.roofline.rates == GOOD
    assert floor.floor_ms == ev.workload.roofline(ev.preset, GOOD).floor_ms == ev.roofline_floor_ms()


def test_an_engine_still_below_a_remeasured_floor_is_named_suspect_not_a_percentage():
    roofline = Roofline(flops=0.0, bytes=1e6, rates=GOOD)
    floor = RunFloor(roofline).settled(roofline.floor_ms / 2, lambda: roofline)  # re-measured: no lower
    assert not floor.revisions
    entry = floor.entry(roofline.floor_ms / 2)
    assert entry["below_floor"] and math.isnan(entry["fraction_of_floor"])
    text = floor_text(entry)
    assert "suspect" in text and not percentages(text)
    # a summary written before this rule, with the 274.6% of issue 29, is read and shown the same way
    old = Summary.from_dict({"roofline": {"floor_ms": 257.032, "fraction_of_floor": 2.746, "flops": 1.0}})
    assert "suspect" in roofline_text(old) and not percentages(roofline_text(old))
    assert floor_text({"floor_ms": 0.109, "fraction_of_floor": 0.02263}) == "2.3% of the roofline floor (0.109 ms)"


def test_a_failed_remeasurement_keeps_the_floor():
    roofline = Roofline(flops=0.0, bytes=1e6, rates=GOOD)

    def gone() -> Roofline:
        raise RuntimeError("no evaluator")

    assert RunFloor(roofline).settled(roofline.floor_ms / 2, gone).revisions == ()
    assert RunFloor(roofline).settled(roofline.floor_ms * 2, gone).floor_ms == roofline.floor_ms


def test_a_corrupt_cache_file_is_ignored_and_replaced(cache):
    key = "cpu-test-1t-float32-0"
    cache.mkdir(parents=True)
    (cache / f"{key}.json").write_text("{not json")
    assert calibration.cached(key) is None
    assert calibration.remember(key, LOW).source == calibration.MEASURED and calibration.cached(key) == LOW
    assert calibration.remember(key, MachineRates(2e6, 1e5, {"float32": 2e6})).source == calibration.CACHED
    assert calibration.cached(key) == MachineRates(2e6, 1e6, {"float32": 2e6})  # each rate its best
