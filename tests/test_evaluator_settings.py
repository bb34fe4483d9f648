"""Evaluator settings: defaults, validation, unknown keys."""
from __future__ import annotations

import pickle

import pytest

from evaluators.settings import EvaluatorSettings


def test_defaults():
    s = EvaluatorSettings()
    assert s.tolerances == {"float32": 1e-5, "bfloat16": 6e-3}
    assert (s.elementwise_factor, s.warmup, s.repeats) == (10.0, 3, 15)
    assert (s.build_timeout_s, s.eval_timeout_s, s.min_timing_s) == (120.0, 300.0, None)
    assert pickle.loads(pickle.dumps(s)) == s  # travels to Ray actors
    assert {row["option"] for row in EvaluatorSettings.describe()} == set(s.to_dict())


def test_from_dict_rejects_unknown_keys_naming_allowed_ones():
    with pytest.raises(ValueError) as info:
        EvaluatorSettings.from_dict({"repeat": 5})
    msg = str(info.value)
    assert "'repeat'" in msg
    for name in ("tolerances", "elementwise_factor", "warmup", "repeats",
                 "build_timeout_s", "eval_timeout_s", "min_timing_s"):
        assert name in msg


def test_from_dict_merges_tolerances_and_validates_values():
    s = EvaluatorSettings.from_dict({"repeats": 5, "tolerances": {"float32": 2e-5}})
    assert s.repeats == 5 and s.tolerances == {"float32": 2e-5, "bfloat16": 6e-3}
    with pytest.raises(ValueError, match="repeats"):
        EvaluatorSettings.from_dict({"repeats": 0})
    with pytest.raises(ValueError, match="tolerances"):
        EvaluatorSettings.from_dict({"tolerances": {"float32": -1.0}})
    with pytest.raises(ValueError, match="float16"):
        EvaluatorSettings().tolerance("float16")
