"""The fake workload with engines of a known latency and a noise model, for the paired re-timing tests.

Each engine computes the fake workload's running sum, then sleeps `base_ms` x (1 + `slowdown`) x a
noise factor drawn per call in the engine's own process: log-normal (sigma `SIGMA`) and, with
probability `SPIKE_P`, a spike of `SPIKE` x (a preemption on a shared machine). The `pad` gene is
read by nothing: two genomes that differ only there build the same engine (an A/A pair).
"""
from __future__ import annotations

import math
import random
import time

from evo.core.genome import Gene, GeneSpace, Genome
from evo.workloads.base import NO_SOURCES, DeviceInfo, Engine, Preset
from tests.fake_workload import FakeWorkload, _engine

NAME = "tests.paired_workload"
SIGMA = 0.05
SPIKE_P, SPIKE = 0.05, 2.0


def _noisy(slowdown: float, base_ms: float = 2.0) -> Engine:
    inner = _engine("cumsum", 0)
    noise = random.Random()  # seeded from the OS: noise is noise

    def engine(x, initial_state=None):
        out = inner(x, initial_state)
        factor = math.exp(noise.gauss(0.0, SIGMA)) * (SPIKE if noise.random() < SPIKE_P else 1.0)
        time.sleep(base_ms * (1.0 + slowdown) * factor / 1e3)
        return out

    return engine


class PairedWorkload(FakeWorkload):
    name = "paired-fake"

    def gene_space(self, preset: Preset, device: DeviceInfo) -> GeneSpace:
        return GeneSpace("paired-fake", (
            Gene("slowdown", "fusion", (0.0, 0.1), 0.0, "extra latency, as a fraction of the base"),
            Gene("base_ms", "scheduling", (2.0, 40.0), 2.0, "the engine's latency before noise and slowdown, ms"),
            Gene("pad", "memory", (False, True), False, "unused: an A/A pair differs only here"),
        ))

    def build(self, genome: Genome, preset: Preset, device: DeviceInfo, sources=NO_SOURCES) -> Engine:
        return _noisy(float(genome["slowdown"]), float(genome["base_ms"]))

    def baselines(self, preset: Preset) -> dict:
        return {"noisy": lambda device: _noisy(0.0), "slow": lambda device: _noisy(0.1)}


WORKLOAD = PairedWorkload()


def genome_json(slowdown: float = 0.0, pad: bool = False, base_ms: float = 2.0) -> str:
    space = WORKLOAD.gene_space(WORKLOAD.presets()["cpu"], DeviceInfo("cpu", "cpu"))
    return space.make({"slowdown": slowdown, "pad": pad, "base_ms": base_ms}).to_json()
