"""`Workload.honest_logits`: the float64 reference's own computation run at a lower precision, which calibrates
the accuracy contract's budget. At float64 it is the reference, bit for bit; at bfloat16 it stays close to it
(bounds measured on these prompts, with margin) without being it; a workload without it says so.

Measured (16 prompts of the trace's lengths, 12 forced tokens each): llama_serve cpu_small at bfloat16 agrees on
99% of argmaxes, its largest logit error 0.04; kimi_linear cpu_small_bf16 on 92%, the per-row largest
|log_softmax error| over the float64 top 10 has median 0.04, p90 0.09 and a tail to 1.9 where bfloat16
activations flip an MoE router's choice (0.11 at most with float64's choices pinned).
"""
from __future__ import annotations

import numpy as np
import pytest

from evo.workloads import get_workload
from tests.generation_driver import trace_prompts

LLAMA, KIMI = get_workload("llama_serve"), get_workload("kimi_linear")
CASES = {"llama_serve": (LLAMA, "cpu_small"), "kimi_linear": (KIMI, "cpu_small_bf16")}


def _cases(workload, preset, count: int = 6, forced: int = 12) -> list[tuple[list[int], list[int]]]:
    """The cpu_small trace's prompts (the engine tests' draw), each with `forced` tokens drawn uniformly."""
    V = preset.shape["V"]
    rng = np.random.default_rng(7)
    return [(prompt, rng.integers(0, V, forced).tolist()) for prompt in trace_prompts(V, 3)[:count]]


def _top10_log_softmax_error(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """Per row, the largest |log_softmax(got) - log_softmax(ref)| among ref's ten largest logits."""
    def log_softmax(x):
        m = x.max(1, keepdims=True)
        return x - m - np.log(np.exp(x - m).sum(1, keepdims=True))

    top10 = np.argsort(-ref, 1)[:, :10]
    return np.abs(np.take_along_axis(log_softmax(got) - log_softmax(ref), top10, 1)).max(1)


@pytest.fixture(scope="module", params=sorted(CASES))
def readings(request):
    """workload name -> (float64 reference, honest float64, honest bfloat16) logits, rows of every case stacked."""
    workload, name = CASES[request.param]
    preset = workload.presets()[name]
    runs = [(workload.reference_logits(preset, p, t), workload.honest_logits(preset, p, t, "float64"),
             workload.honest_logits(preset, p, t, "bfloat16")) for p, t in _cases(workload, preset)]
    return request.param, [np.concatenate(rows) for rows in zip(*runs)]


def test_at_float64_it_is_the_reference_bit_for_bit(readings):
    _, (ref, honest64, _) = readings
    assert honest64.dtype == np.float64 and np.array_equal(honest64, ref)


# name -> (least argmax agreement, bound on the median and on the largest per-row top-10 log_softmax error)
BF16_BOUNDS = {"llama_serve": (0.9, 0.05, 0.15), "kimi_linear": (0.8, 0.15, 5.0)}


def test_at_bfloat16_it_is_close_to_the_reference_but_not_it(readings):
    name, (ref, _, honest16) = readings
    least_agreement, median_bound, max_bound = BF16_BOUNDS[name]
    assert honest16.dtype == np.float64 and honest16.shape == ref.shape
    assert not np.array_equal(honest16, ref)  # rounded: the weights and activations are bfloat16
    assert (honest16.argmax(1) == ref.argmax(1)).mean() >= least_agreement
    error = _top10_log_softmax_error(ref, honest16)
    assert np.median(error) < median_bound and error.max() < max_bound
    assert error.max() > 1e-3  # bfloat16's rounding shows (float32's would be ~1e-6)


def test_at_float32_it_keeps_float32_rounding():
    preset = LLAMA.presets()["cpu_small"]
    prompt, tokens = _cases(LLAMA, preset, count=1)[0]
    ref = LLAMA.reference_logits(preset, prompt, tokens)
    assert 0 < np.abs(LLAMA.honest_logits(preset, prompt, tokens, "float32") - ref).max() < 1e-4


def test_an_unknown_precision_is_refused_naming_the_allowed_ones():
    preset = LLAMA.presets()["cpu_small"]
    with pytest.raises(ValueError, match="float64, float32, bfloat16, float16"):
        LLAMA.honest_logits(preset, [1, 2], [3], "int8")


def test_a_workload_without_an_honest_execution_says_so():
    kda = get_workload("kda")
    with pytest.raises(NotImplementedError, match="'kda'.*budget"):
        kda.honest_logits(kda.presets()["cpu_small"], [1], [2], "bfloat16")
