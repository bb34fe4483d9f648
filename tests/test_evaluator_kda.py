"""Integration: the real KDA workload's default genome through the plain Evaluator on 'cpu_small'."""
from __future__ import annotations

import math

from evaluators.judge.evaluator import Evaluator
from evaluators.settings import EvaluatorSettings
from evo.core.records import OK
from evo.workloads.kda import WORKLOAD as workload


def test_kda_default_genome_is_ok_on_cpu_small():
    ev = Evaluator("kda", "cpu_small", EvaluatorSettings(warmup=1, repeats=3), seed=0, name="kda-test")
    space = workload.gene_space(workload.presets()["cpu_small"], ev.device_info())
    r = ev.evaluate(space.default().to_json())
    assert r.status == OK, f"{r.message}\n{r.error}"
    assert math.isfinite(r.latency_ms) and r.latency_ms > 0
    assert 0 <= r.max_rel_error <= EvaluatorSettings().tolerance(workload.presets()["cpu_small"].dtype)
