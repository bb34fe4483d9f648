"""Every value of every free axis a workload declares is verified by some case of its cascade."""
from __future__ import annotations

import pytest

from evo.workloads.kda import WORKLOAD as KDA
from tests import fake_workload as fw


@pytest.mark.parametrize("workload, preset", [(KDA, "cpu"), (KDA, "cpu_small"), (KDA, "h200"), (fw.WORKLOAD, "cpu")])
def test_the_cascade_covers_every_free_axis_value(workload, preset):
    p = workload.presets()[preset]
    cases = [case for stage in workload.check_cases(p) for case in stage]
    for axis, values in workload.free_axes(p).items():
        assert set(values) <= {case.shape[axis] for case in cases}, axis
    assert any(case.shape.get("B", 1) >= 2 for case in cases)  # distinct data per batch element is checked
