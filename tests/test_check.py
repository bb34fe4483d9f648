"""Correctness policy: fresh seeds, input mutation, shapes, dtypes, non-finite, norm-wise and element-wise bounds."""
from __future__ import annotations

import math

import pytest
import torch

from evaluators.judge.check import CheckReport, SeedStream, check_engine, compare_outputs
from evaluators.settings import EvaluatorSettings
from tests import fake_workload as fw

W = fw.WORKLOAD


def run_check(impl: str, preset: str = "cpu", seeds: SeedStream | None = None) -> CheckReport:
    p = W.presets()[preset]
    engine = fw._engine(impl, 0)
    return check_engine(engine, W, p, W.check_cases(p), seeds or SeedStream(0, "t"), device="cpu",
                        tolerance=EvaluatorSettings().tolerance(p.dtype), elementwise_factor=10.0)


@pytest.mark.parametrize("impl", ["cumsum", "loop"])
def test_correct_engines_pass(impl):
    report = run_check(impl)
    assert report.passed, report.message
    assert 0 <= report.max_rel_error <= 1e-5
    assert report.cases_run == 6  # 4 cases + a repeat of each stage's first case


@pytest.mark.parametrize("impl, words", [
    ("zeros", "all zeros"),
    ("nan", "non-finite"),
    ("inplace", "modified its inputs"),
    ("wrong_shape", "shape"),
    ("wrong_dtype", "dtype"),
    ("missing", "'final_state' missing"),
    ("noisy", "tolerance"),
    ("bf16_compute", "tolerance"),
])
def test_wrong_engines_fail_with_a_named_case(impl, words):
    report = run_check(impl)
    assert not report.passed
    assert words in report.message
    assert "stage 0 case 'small'" in report.message  # stops at the first failing stage
    assert report.cases_run == 1


def test_nan_reports_infinite_error():
    assert run_check("nan").max_rel_error == math.inf


def test_tolerance_follows_the_preset_io_dtype():
    # 1e-4 relative error: wrong for a float32 preset, fine for a bfloat16 one.
    assert not run_check("noisy", "cpu").passed
    report = run_check("noisy", "cpu_bf16")
    assert report.passed, report.message
    assert 1e-5 < report.max_rel_error < 6e-3
    assert EvaluatorSettings().tolerance("float32") == 1e-5
    assert EvaluatorSettings().tolerance("bfloat16") == 6e-3


def test_fresh_seeds_differ_between_two_checks():
    fw.SEEN_SEEDS.clear()
    seeds = SeedStream(123, "evaluator-0")
    run_check("cumsum", seeds=seeds)
    first = list(fw.SEEN_SEEDS)
    run_check("cumsum", seeds=seeds)
    second = fw.SEEN_SEEDS[len(first):]
    assert len(first) == len(second) == 6  # 4 cases + a repeat call per stage
    assert not set(first) & set(second)
    assert len(set(fw.SEEN_SEEDS)) == len(fw.SEEN_SEEDS)


def test_seed_streams_are_reproducible_and_differ_by_name_and_seed():
    def draw(seed, name):
        stream = SeedStream(seed, name)
        return [stream.next() for _ in range(50)]

    assert draw(1, "e0") == draw(1, "e0")
    assert not set(draw(1, "e0")) & set(draw(1, "e1"))
    assert not set(draw(1, "e0")) & set(draw(2, "e0"))
    assert all(0 <= s < 2**63 for s in draw(1, "e0"))


def test_elementwise_bound_catches_what_the_norm_hides():
    ref = torch.ones(10_000, dtype=torch.float64)
    out = ref.clone().float()
    out[17] += 5e-4  # norm-wise 5e-6 < 1e-5, but max error 5e-4 > 10 * 1e-5 * 1
    problem, rel = compare_outputs({"o": out}, {"o": ref}, {"o": "float32"}, 1e-5, 10.0)
    assert "max abs error" in problem and rel < 1e-5
    problem, _ = compare_outputs({"o": out}, {"o": ref}, {"o": "float32"}, 1e-5, 1000.0)
    assert problem == ""


def test_non_dict_output_is_incorrect():
    problem, rel = compare_outputs(torch.ones(3), {"o": torch.ones(3)}, {"o": "float32"}, 1e-5, 10.0)
    assert "dict" in problem and math.isnan(rel)


def test_all_zero_output_passes_when_the_reference_is_zero():
    zero = torch.zeros(4)
    problem, rel = compare_outputs({"o": zero}, {"o": zero.double()}, {"o": "float32"}, 1e-5, 10.0)
    assert problem == "" and rel == 0.0


def test_unmeasured_failures_report_nan_error():
    assert math.isnan(run_check("inplace").max_rel_error)
    assert math.isnan(run_check("wrong_shape").max_rel_error)
    assert run_check("zeros").max_rel_error == 1.0


def test_an_output_cancelled_below_its_terms_is_measured_against_them():
    """A sum of terms far larger than its result: a float32 error at the terms' rounding is correct
    there (the condition-aware bound), a larger one is not, and terms smaller than the output change nothing."""
    ref = torch.full((8,), 1e-4, dtype=torch.float64)  # cancelled: the terms are ~1 each
    terms = torch.ones(8, dtype=torch.float64)
    rounded = (ref + 3e-7).float()  # 3e-3 of the output, 3e-7 of its terms
    problem, _ = compare_outputs({"o": rounded}, {"o": ref}, {"o": "float32"}, 1e-5, 10.0)
    assert "norm-wise relative error" in problem and "terms" not in problem
    problem, rel = compare_outputs({"o": rounded}, {"o": ref}, {"o": "float32"}, 1e-5, 10.0, {"o": terms})
    assert problem == "" and 2e-7 < rel < 4e-7
    wrong = (ref + 1e-4).float()
    problem, _ = compare_outputs({"o": wrong}, {"o": ref}, {"o": "float32"}, 1e-5, 10.0, {"o": terms})
    assert "against the size of its terms" in problem
    many, many_terms = torch.full((10_000,), 1e-4, dtype=torch.float64), torch.ones(10_000, dtype=torch.float64)
    spike = many.float()
    spike[17] += 5e-4  # norm-wise 5e-6 of the terms' norm passes; 5e-4 > 10 x 1e-5 x the largest term does not
    problem, _ = compare_outputs({"o": spike}, {"o": many}, {"o": "float32"}, 1e-5, 10.0, {"o": many_terms})
    assert "max abs error" in problem and "of its terms" in problem
    small = torch.full((8,), 1e-6, dtype=torch.float64)  # terms below the output: the output's own size
    problem, _ = compare_outputs({"o": rounded}, {"o": ref}, {"o": "float32"}, 1e-5, 10.0, {"o": small})
    assert "norm-wise relative error" in problem and "terms" not in problem
    with pytest.raises(ValueError, match="terms must be finite and shaped"):
        compare_outputs({"o": rounded}, {"o": ref}, {"o": "float32"}, 1e-5, 10.0, {"o": torch.ones(3)})
