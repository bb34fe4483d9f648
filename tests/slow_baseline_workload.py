"""The fake workload with one more baseline, `slow_compile`, whose build takes `SLOW_BUILD_S` seconds:
a stand-in for a `torch.compile` baseline that compiles for minutes on a loaded machine."""
from __future__ import annotations

import time

from evo.workloads.base import Preset
from tests.fake_workload import FakeWorkload, _engine

NAME = "tests.slow_baseline_workload"
SLOW_BUILD_S = 4.0


def _slow_compile(device):
    time.sleep(SLOW_BUILD_S)
    return _engine("cumsum", 0)


class SlowBaselineWorkload(FakeWorkload):
    name = "slow-baseline-fake"

    def baselines(self, preset: Preset) -> dict:
        return {**super().baselines(preset), "slow_compile": _slow_compile}


WORKLOAD = SlowBaselineWorkload()
