"""The plain Evaluator on a small fake workload: every status reachable, stamps on every result."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from evaluators.judge.evaluator import Evaluator
from evaluators.settings import EvaluatorSettings
from evo.core.records import BUILD_ERROR, INCORRECT, OK, RUNTIME_ERROR, TIMEOUT, EvalResult
from tests import fake_workload as fw

FAST = EvaluatorSettings(warmup=1, repeats=5)


@pytest.fixture
def ev(fake):
    return Evaluator(fake, "cpu", FAST, seed=7, name="ev-test")


def assert_stamped(r: EvalResult, ev: Evaluator) -> None:
    assert r.evaluator == "ev-test"
    assert r.device.startswith("cpu:")
    assert r.threads >= 1
    assert set(r.versions) >= {"torch", "python", "numpy", "platform"}
    assert math.isfinite(r.eval_s) and r.eval_s >= 0


def test_correct_engine_is_ok_with_latency_and_spread(ev):
    r = ev.evaluate(fw.genome_json("cumsum"))
    assert r.status == OK, r.message
    assert r.ok and r.latency_ms > 0 and math.isfinite(r.latency_spread_ms) and r.latency_spread_ms >= 0
    assert 0 <= r.max_rel_error <= 1e-5
    assert 0 <= r.build_s <= r.eval_s
    assert r.genome_hash == json.loads(json.dumps(r.to_dict()))["genome_hash"]
    assert_stamped(r, ev)


def test_the_judge_never_walks_the_whole_heap_after_an_evaluation(ev, monkeypatch):
    """Engines run in their own processes: after an evaluation or a re-timing the judge collects young garbage
    only; a full collection costs ~0.7 s a call in a process that imported transformers (a test session)."""
    import gc

    asked, real = [], gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: asked.append(generation) or real(0))
    ev.evaluate(fw.genome_json("cumsum"))
    ev.compare(fw.genome_json("cumsum"), fw.genome_json("loop"), calls=8, warmup=0)
    assert asked and max(asked) < 2, asked


@pytest.mark.parametrize("impl, status, words", [
    ("zeros", INCORRECT, "all zeros"),
    ("nan", INCORRECT, "non-finite"),
    ("inplace", INCORRECT, "modified its inputs"),
    ("wrong_shape", INCORRECT, "shape"),
    ("noisy", INCORRECT, "tolerance 1.0e-05"),
    ("raise_build", BUILD_ERROR, "deliberate failure at build time"),
    ("raise_run", RUNTIME_ERROR, "deliberate failure at run time"),
    # 'small' or 'small_wide_b1', or a drawn case with T < 16, whichever comes first
    ("raise_small", RUNTIME_ERROR, ("on check case 'small", "drawn case")),
    ("oom", RUNTIME_ERROR, "out of memory"),
    ("shared_outputs", INCORRECT, "share memory"),
    ("strided", INCORRECT, "not contiguous"),
    ("alias_input", INCORRECT, "aliases the engine's inputs"),
])
def test_faults_become_statuses(ev, impl, status, words):
    r = ev.evaluate(fw.genome_json(impl))
    assert r.status == status, r.message
    assert any(w in r.message for w in ((words,) if isinstance(words, str) else words)), r.message
    assert not r.ok and math.isnan(r.latency_ms)
    if status != INCORRECT:
        assert "Error" in r.error and "Traceback" in r.error
    assert_stamped(r, ev)


def test_a_dying_or_hanging_engine_takes_only_its_own_process_down(fake):
    ev = Evaluator(fake, "cpu", EvaluatorSettings(warmup=1, repeats=3, eval_timeout_s=5.0), seed=2, name="ev-test")
    died = ev.evaluate(fw.genome_json("exit"))
    assert died.status == RUNTIME_ERROR and "engine process died (exit code 3)" in died.message
    hung = ev.evaluate(fw.genome_json("hang"))
    assert hung.status == TIMEOUT and "eval_timeout_s" in hung.message and hung.eval_s < 60
    assert ev.evaluate(fw.genome_json("cumsum")).status == OK  # the same evaluator goes on


def test_incorrect_records_its_error(ev):
    r = ev.evaluate(fw.genome_json("noisy"))
    assert 1e-5 < r.max_rel_error < 1e-3
    assert math.isfinite(r.build_s)


def test_tolerance_depends_on_preset_dtype(fake):
    ev16 = Evaluator(fake, "cpu_bf16", FAST, seed=7, name="ev-test")
    assert ev16.evaluate(fw.genome_json("noisy")).status == OK


def test_illegal_genome_is_a_build_error_naming_the_gene(ev):
    bad = json.loads(fw.genome_json())
    bad["fusion"]["impl"] = "bogus"
    r = ev.evaluate(json.dumps(bad))
    assert r.status == BUILD_ERROR
    assert "'impl'" in r.message and "bogus" in r.message
    r = ev.evaluate("{not json")
    assert r.status == BUILD_ERROR and r.genome_hash.startswith("invalid:")


def test_slow_build_is_a_timeout(fake):
    ev = Evaluator(fake, "cpu", EvaluatorSettings(build_timeout_s=0.1, repeats=3), seed=1, name="ev-test")
    r = ev.evaluate(fw.genome_json("slow_build"))
    assert r.status == TIMEOUT and "build_timeout_s" in r.message and r.build_s >= 0.1


def test_engine_threads_apply_in_the_engine_process_only(ev):
    before = torch.get_num_threads()
    r = ev.evaluate(fw.genome_json("threads_probe", threads=1))
    assert r.status == OK and r.threads == 1, r.message  # the probe raises unless it runs on its threads
    assert torch.get_num_threads() == before


def test_inputs_are_fresh_across_evaluations(ev):
    fw.SEEN_SEEDS.clear()
    ev.evaluate(fw.genome_json("cumsum"))
    ev.evaluate(fw.genome_json("cumsum"))
    # per evaluation: the first call, 4 check cases, warm-up and timed calls, each on fresh inputs (plus
    # the judge's own draws: its calibration, and the output shapes it learns once)
    assert len(fw.SEEN_SEEDS) >= 2 * (1 + 4 + FAST.warmup + FAST.repeats)
    assert len(set(fw.SEEN_SEEDS)) == len(fw.SEEN_SEEDS)


def test_baselines_go_through_check_and_timing(ev):
    r = ev.evaluate_baseline("torch_cumsum")
    assert r.status == OK and r.genome_hash == "baseline:torch_cumsum" and r.latency_ms > 0
    assert ev.evaluate_baseline("broken").status == INCORRECT
    with pytest.raises(ValueError, match="torch_cumsum"):
        ev.evaluate_baseline("nope")


def test_describe_and_device_info(ev):
    d = ev.describe()
    assert d["name"] == "ev-test" and d["device"].startswith("cpu:") and d["threads"] == torch.get_num_threads()
    assert set(d["versions"]) >= {"torch", "python", "numpy", "platform"} and d["cores"] is None
    info = ev.device_info()
    assert info.kind == "cpu" and info.threads == torch.get_num_threads()
    # what its engines' zygote imports: this workload's module, not torch._dynamo (~2 s) that no engine of it uses
    assert fw.__name__ in ev.preload and "torch._dynamo" not in ev.preload


def test_measure_rates(ev):
    rates = ev.measure_rates()
    assert rates.flops_per_s > 0 and rates.bytes_per_s > 0
    assert math.isfinite(rates.flops_per_s) and math.isfinite(rates.bytes_per_s)


def test_cores_pin_the_process(fake):
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        ev = Evaluator(fake, "cpu", FAST, seed=1, name="ev-test", cores=(0,))
        assert os.sched_getaffinity(0) == {0} and torch.get_num_threads() == 1
        assert ev.device_info().threads == 1 and ev.describe()["cores"] == [0]
        assert ev.evaluate(fw.genome_json()).threads == 1
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="cannot pin"):
        Evaluator(fake, "cpu", FAST, seed=1, cores=(10_000,))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_preset_without_cuda_is_a_config_error(fake):
    with pytest.raises(RuntimeError, match="preset 'cuda' needs a cuda device"):
        Evaluator(fake, "cuda", FAST, seed=1)


def test_unknown_preset_lists_available(fake):
    with pytest.raises(ValueError, match="cpu_bf16"):
        Evaluator(fake, "h100", FAST, seed=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_preset_evaluates_on_the_gpu(fake):
    ev = Evaluator(fake, "cuda", FAST, seed=1, name="ev-test")
    assert ev.device == "cuda:0" and ev.device_info().kind == "cuda"
    r = ev.evaluate(fw.genome_json("cumsum"))
    assert r.status == OK and r.device.startswith("cuda:") and "cuda" in r.versions, r.message
    assert ev.evaluate(fw.genome_json("nan")).status == INCORRECT
    rates = ev.measure_rates()
    assert rates.flops_per_s > 1e12 and rates.bytes_per_s > 1e11


def test_preset_dtype_without_tolerance_fails_at_construction(fake):
    with pytest.raises(ValueError, match="no tolerance for dtype 'float32'"):
        Evaluator(fake, "cpu", EvaluatorSettings(tolerances={"bfloat16": 6e-3}), seed=1)


def test_the_judges_own_cost_of_a_call_can_be_subtracted(fake):
    settings = EvaluatorSettings(warmup=1, repeats=5, subtract_call_overhead=True)
    r = Evaluator(fake, "cpu", settings, seed=3, name="ev-test").evaluate(fw.genome_json("loop"))
    assert r.status in (OK, "suspect"), r.message  # a ~0.1 ms engine less the echo cost: near the noise
    assert r.latency_ms >= 0 and r.max_rel_error <= 1e-5
