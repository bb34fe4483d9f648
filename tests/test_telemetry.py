"""Device telemetry on CPU: a measurement taken while the device throttled is flagged and timed once more,
in an evaluation and in a paired re-timing. The throttle comes from a sampler of the test's own (the
`evaluators.machine.telemetry.Sampler` interface), not from NVML."""
from __future__ import annotations

import pytest

from evaluators.judge.evaluator import Evaluator
from evaluators.machine import telemetry
from evaluators.settings import EvaluatorSettings
from tests import fake_workload


class Throttling:
    """This machine's CPU readings, with a GPU-style power throttle reported on the first `first` samples."""

    def __init__(self, first: int = 1) -> None:
        self.first, self.count = first, 0

    def sample(self, device: str) -> dict:
        self.count += 1
        held = self.count <= self.first
        return {**telemetry.cpu_sample(), "throttle": "sw_power_cap" if held else "none", "throttled": held}


@pytest.fixture(scope="module")
def judge() -> Evaluator:
    return Evaluator(fake_workload.NAME, "cpu", EvaluatorSettings(warmup=0, repeats=3), seed=5)


def test_an_evaluation_timed_while_throttled_is_timed_again_and_says_so(judge):
    assert isinstance(judge.sampler, telemetry.MachineSampler)  # the default: this machine's readings
    genome = fake_workload.genome_json()
    judge.sampler = once = Throttling(first=1)
    result = judge.evaluate(genome)
    assert result.ok, result.message
    assert result.versions["telemetry.retimed_after_throttle"] == "True"
    assert result.versions["telemetry.throttled"] == "False"  # the timing that counts was not throttled
    assert "timed again: the device throttled" in result.message and once.count >= 4
    judge.sampler = Throttling(first=0)  # a quiet machine: timed once, no flag (the flag does not stick)
    quiet = judge.evaluate(genome)
    assert quiet.ok and "telemetry.retimed_after_throttle" not in quiet.versions and "timed again" not in quiet.message
    judge.sampler = Throttling(first=10**6)  # throttled throughout: timed again once, then flagged
    held = judge.evaluate(genome)
    assert held.ok and held.versions["telemetry.throttled"] == "True"
    assert held.versions["telemetry.retimed_after_throttle"] == "True" and held.versions["telemetry.throttle"] == "sw_power_cap"


def test_a_paired_retiming_during_a_throttle_runs_its_rounds_again(judge):
    judge.sampler = Throttling(first=1)
    timing = judge.compare(fake_workload.genome_json(), fake_workload.genome_json(), calls=8, warmup=0)
    assert timing.verdict != "failed", timing.message
    assert timing.telemetry["retimed_after_throttle"] is True and timing.telemetry["throttled"] is False
    assert timing.pairs == 8  # the second run's rounds only
    assert judge.sampler.count == 4  # before and after each of the two runs of rounds

