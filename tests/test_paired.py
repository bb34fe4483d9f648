"""Paired re-timing: the statistics (evo.core.retiming), and the evaluator timing two engines interleaved
(evaluators.judge.paired) on engines of known latency with a noise model (tests/paired_workload.py)."""
from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import pytest

from evaluators.judge.evaluator import Evaluator
from evaluators.judge.paired import balanced_orders
from evaluators.settings import EvaluatorSettings
from evo.core.genome import Genome
from evo.core.retiming import (EQUAL, FAILED, FASTER, SLOWER, IntensifySettings, PairedTiming, decide,
                               hodges_lehmann, paired_timing)
from tests import fake_workload, paired_workload


# -- the statistics ------------------------------------------------------------------------------
def test_hodges_lehmann_covers_the_true_shift_and_narrows_with_more_pairs():
    rng = np.random.default_rng(0)
    covered, widths = 0, {}
    for n in (8, 32):
        for _ in range(400):
            d = 0.1 + rng.standard_t(3, n) * 0.05  # heavy-tailed, centred on 0.1
            estimate, low, high = hodges_lehmann(d)
            assert low <= estimate <= high
            covered += low <= 0.1 <= high
            widths.setdefault(n, []).append(high - low)
    assert covered / 800 > 0.92  # a 95% interval
    assert np.median(widths[32]) < 0.6 * np.median(widths[8])


def test_hodges_lehmann_refuses_too_few_pairs():
    with pytest.raises(ValueError, match="at least 6"):
        hodges_lehmann([0.1, 0.2, 0.3])


def test_verdict_needs_the_whole_interval_beyond_the_minimum_effect():
    assert decide(0.90, 0.97, 0.02) == FASTER
    assert decide(0.90, 0.99, 0.02) == EQUAL  # excludes 1, but not by 2%
    assert decide(1.03, 1.10, 0.02) == SLOWER
    assert decide(0.95, 1.05, 0.02) == EQUAL
    assert decide(0.95, 0.99, 0.0) == FASTER


def test_paired_timing_ratio_is_a_over_b_and_round_trips_through_json():
    a = [10.0, 10.2, 9.9, 10.1, 10.0, 10.3, 9.8, 10.1]
    b = [12.0, 12.1, 11.9, 12.3, 12.0, 12.2, 11.8, 12.1]
    timing = paired_timing("aaa", "bbb", a, b, 0.02, reason="ab", wall_s=1.5)
    assert timing.verdict == FASTER and timing.ratio == pytest.approx(10 / 12, rel=0.02)
    assert timing.speedup[0] == pytest.approx(1 / timing.ratio) and timing.speedup[1] <= timing.speedup[2]
    again = PairedTiming.from_dict(json.loads(json.dumps(timing.to_dict())))
    assert again == timing
    assert "faster than bbb" in timing.describe()


def test_balanced_orders_put_each_engine_first_equally_often():
    rng = np.random.default_rng(1)
    for engines, rounds in ((2, 16), (3, 9)):
        orders = balanced_orders(engines, rounds, rng)
        assert len(orders) == rounds and all(sorted(o) == list(range(engines)) for o in orders)
        firsts = [o[0] for o in orders]
        assert all(firsts.count(e) == rounds // engines for e in range(engines))


def test_intensify_settings_name_what_is_wrong():
    with pytest.raises(ValueError, match=r"min_effect must be a fraction.*calls must be an integer >= 8"):
        IntensifySettings(min_effect=2, calls=3)
    assert IntensifySettings(budget_share=0.25).budget(40) == 10
    assert IntensifySettings(enabled=False).budget(40) == 0


# -- the evaluator ---------------------------------------------------------------------------------
def _evaluator(workload: str = paired_workload.NAME) -> Evaluator:
    core = sorted(os.sched_getaffinity(0))[:1]  # like a pool's evaluator: the judge and its engines on one core
    return Evaluator(workload, "cpu", EvaluatorSettings(warmup=1, repeats=5), seed=3, cores=tuple(core))


@pytest.fixture(autouse=True, scope="module")
def _restore_affinity():
    """An evaluator given cores pins this process to them: give the later tests their cores back."""
    cores = os.sched_getaffinity(0)
    yield
    os.sched_setaffinity(0, cores)


@pytest.fixture(scope="module")
def judge() -> Evaluator:
    return _evaluator()


def test_a_a_is_equal_within_noise_in_19_of_20(judge):
    """The engine against a genome that differs only in a gene nothing reads, 20 times: the noise model
    (log-normal jitter and 2x spikes) and the machine's load never make a 2% win out of nothing."""
    a, b = paired_workload.genome_json(), paired_workload.genome_json(pad=True)
    timings = [judge.compare(a, b, calls=16, warmup=1) for _ in range(20)]
    verdicts = [t.verdict for t in timings]
    assert FAILED not in verdicts, [t.message for t in timings if t.verdict == FAILED]
    assert verdicts.count(EQUAL) >= 19, [t.describe() for t in timings]
    assert all(t.pairs == 16 and len(t.samples_b_ms) == 16 for t in timings)
    assert all("load_1m" in t.telemetry and t.telemetry["throttled"] is False for t in timings)


def test_an_engine_10_percent_slower_is_found_slower(judge):
    """40 ms engines, one 10% slower: found slower (a second run is allowed when the machine's load hid it
    in the first; neither may call it faster)."""
    slow, fast = paired_workload.genome_json(0.1, base_ms=40.0), paired_workload.genome_json(0.0, base_ms=40.0)
    timings = [judge.compare(slow, fast, calls=40, warmup=1)]
    if timings[0].verdict != SLOWER:
        timings.append(judge.compare(slow, fast, calls=40, warmup=1))
    assert SLOWER in [t.verdict for t in timings], [t.describe() for t in timings]
    assert FASTER not in [t.verdict for t in timings]
    assert 1.0 < timings[-1].ratio < 1.25


def test_several_engines_in_one_run_and_by_name(judge):
    """The default genome against both baselines at once; engines named 'default' and by baseline name."""
    timings = judge.retime(["default", "noisy", "baseline:slow"], calls=8, warmup=0, reason="baseline")
    assert [t.b for t in timings] == ["baseline:noisy", "baseline:slow"]
    assert all(t.a == timings[0].a and t.verdict != FAILED and t.reason == "baseline" for t in timings)
    assert len({t.wall_s for t in timings}) == 1  # one interleaved run


def test_unknown_engine_is_a_failed_record_listing_what_is_accepted(judge):
    timing = judge.compare("nope", "default")
    assert timing.verdict == FAILED and "baseline of" in timing.message and "['noisy', 'slow']" in timing.message


def test_every_paired_call_is_checked():
    """An engine that passes its first call would still fail here on a wrong answer; one that is always
    wrong fails before any timing, naming the engine."""
    judge = _evaluator(fake_workload.NAME)
    wrong = fake_workload.genome_json("zeros")
    timing = judge.compare(wrong, fake_workload.genome_json(), calls=8, warmup=0)
    assert timing.verdict == FAILED and timing.message.startswith(f"{timing.a}: ")
    assert "incorrect" in timing.message and math.isnan(timing.ratio)


def test_evo_ab_prints_the_ratio_its_interval_and_a_verdict(tmp_path, capsys):
    """`python -m evo ab CONFIG A B`, A by a hash prefix from a run's evidence, B by a baseline's name."""
    import yaml

    from evo.cli import main

    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    genome = paired_workload.genome_json(pad=True)
    digest = Genome.from_json(genome).hash
    (run / "evidence.jsonl").write_text(json.dumps({"genome_hash": digest, "genome": genome}) + "\n")
    config = tmp_path / "ab.yaml"
    config.write_text(yaml.safe_dump({"workload": paired_workload.NAME, "preset": "cpu", "out_dir": str(tmp_path / "runs"),
                                      "evaluators": {"count": 1, "threads": 1}, "mlflow": {"enabled": False}}))
    assert main(["ab", str(config), digest[:8], "noisy", "--calls", "8", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert f"{digest} is " in out and "baseline:noisy" in out and "[95% " in out
    assert re.search(r"^verdict: (faster|slower|equal within noise)$", out, re.M), out
    assert main(["ab", str(config), "default", "nope", "--calls", "8"]) == 2
    assert "verdict: failed" in capsys.readouterr().out


def test_cpu_telemetry_reads_the_load_and_the_frequency_where_readable():
    from evaluators.machine import telemetry

    stamp = telemetry.sample("cpu")
    assert stamp["load_1m"] >= 0 and stamp["cpus"] == len(os.sched_getaffinity(0))
    assert "cpu_mhz" not in stamp or stamp["cpu_mhz"] > 0
    merged = telemetry.around({"load_1m": 1.0, "throttled": False}, {"load_1m": 2.0, "throttled": True})
    assert merged == {"load_1m": 2.0, "load_1m_before": 1.0, "throttled": True}
    assert telemetry.as_versions({"load_1m": 2.0}) == {"telemetry.load_1m": "2.0"}
    # an evaluation's environment stamp carries it
    result = _evaluator(fake_workload.NAME).evaluate(fake_workload.genome_json())
    assert float(result.versions["telemetry.load_1m"]) >= 0 and result.versions["telemetry.throttled"] == "False"
