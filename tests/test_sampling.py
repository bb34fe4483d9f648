"""Seeded sampling (evo.workloads.sampling): an honest engine whose logits differ from the float64 reference's
within the near-tie tolerance always passes the judge's check, at the nucleus's edge too; an engine that ignores
the seed, the temperature or top_p is caught."""
from __future__ import annotations

import numpy as np

from evo.workloads.sampling import check, choose

V, TOLERANCE = 512, 0.15  # the bfloat16 tolerance: the widest the judge allows


def _logits(rng: np.random.Generator) -> np.ndarray:
    return rng.normal(0.0, 2.0, V)


def test_an_honest_engine_within_the_tolerance_always_passes():
    rng = np.random.default_rng(0)
    for trial in range(400):
        reference = _logits(rng)
        engine = reference + rng.uniform(-TOLERANCE / 2, TOLERANCE / 2, V)  # its own rounding
        temperature, top_p = float(rng.choice([0.3, 0.7, 1.0, 1.5])), float(rng.choice([0.5, 0.8, 0.95, 1.0]))
        token = choose(engine, temperature, top_p, seed=trial, index=trial % 7)
        assert check(reference, token, temperature, top_p, trial, trial % 7, TOLERANCE) == "", trial


def test_an_engine_ignoring_the_seed_the_temperature_or_top_p_is_caught():
    rng = np.random.default_rng(1)
    caught = {"seed": 0, "temperature": 0, "top_p": 0}
    for trial in range(200):
        reference = _logits(rng)
        wrong = {"seed": choose(reference, 1.0, 1.0, seed=trial + 10_000, index=0),
                 "temperature": choose(reference, 2.0, 1.0, seed=trial, index=0),
                 "top_p": choose(reference, 1.0, 1.0, seed=trial, index=0)}
        settings = {"seed": (1.0, 1.0), "temperature": (0.3, 1.0), "top_p": (1.0, 0.3)}
        for what, token in wrong.items():
            temperature, top_p = settings[what]
            caught[what] += check(reference, token, temperature, top_p, trial, 0, 1e-4) != ""
    assert all(n > 100 for n in caught.values()), caught  # each wrong draw fails most of the time


def test_temperature_zero_is_greedy():
    reference = np.array([0.0, 3.0, 1.0])
    assert choose(reference, 0.0, 1.0, 5, 0) == 1
    assert check(reference, 2, 0.0, 1.0, 5, 0, 1e-3) != "" and check(reference, 1, 0.0, 1.0, 5, 0, 1e-3) == ""
