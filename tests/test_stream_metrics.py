"""The request trace (evo.core.trace) and the serving metrics of a replay (evo.core.stream_metrics): the
figures `vllm bench serve` prints, computed by hand on small timelines; traces by their invariants."""
from __future__ import annotations

import math

import numpy as np
import pytest

from evo.core.stream_metrics import RequestTimeline, Slo, serving_metrics
from evo.core.trace import TraceSpec, draw


def test_the_metrics_of_a_replay_are_vllm_bench_serves():
    a = RequestTimeline(sent_s=0.0, token_s=(0.100, 0.120, 0.140, 0.200), prompt_len=10)  # TTFT 100, TPOT 100/3
    b = RequestTimeline(sent_s=0.5, token_s=(0.550,), prompt_len=6)  # one token: no TPOT, no ITL
    lost = RequestTimeline(sent_s=0.6, token_s=(), prompt_len=7)  # produced nothing: not completed
    m = serving_metrics([a, b, lost], duration_s=2.0)
    assert (m.completed, m.total_input_tokens, m.total_output_tokens) == (2, 16, 5)
    assert (m.request_throughput, m.output_throughput, m.total_token_throughput) == (1.0, 2.5, 10.5)
    assert m.ttft_ms["mean"] == pytest.approx(75.0) and m.ttft_ms["median"] == pytest.approx(75.0)
    assert m.tpot_ms["mean"] == pytest.approx(100 / 3)  # (200 - 100) / (4 - 1), request a only
    assert m.itl_ms["median"] == pytest.approx(20.0) and m.itl_ms["p99"] == pytest.approx(59.2)
    assert m.e2el_ms["p90"] == pytest.approx(50 + 0.9 * 150) and m.request_goodput is None
    assert serving_metrics([a, b], 2.0, Slo(ttft_ms=80)).request_goodput == 0.5  # b only
    assert serving_metrics([a, b], 2.0, Slo(tpot_ms=30)).request_goodput == 0.5  # b has no TPOT to miss
    assert serving_metrics([a, b], 2.0, Slo(ttft_ms=200, tpot_ms=40, e2e_ms=250)).request_goodput == 1.0
    assert math.isnan(serving_metrics([lost], 1.0).ttft_ms["p99"])
    with pytest.raises(ValueError, match="back in time"):
        RequestTimeline(sent_s=1.0, token_s=(0.5,), prompt_len=1)
    with pytest.raises(ValueError, match="duration_s"):
        serving_metrics([a], 0.0)


def test_a_trace_is_drawn_from_its_seed_within_its_ranges():
    spec = TraceSpec(arrival="poisson", count=200, rate=8.0, prompt_len=(16, 256), output_len=(1, 128))
    first, again = draw(spec, np.random.default_rng(5)), draw(spec, np.random.default_rng(5))
    assert first == again and first != draw(spec, np.random.default_rng(6))
    assert all(16 <= r.prompt_len <= 256 and 1 <= r.max_tokens <= 128 for r in first)
    arrivals = [r.arrival_s for r in first]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert len(first) / arrivals[-1] == pytest.approx(8.0, rel=0.25)  # the declared rate
    assert {r.arrival_s for r in draw(TraceSpec(arrival="burst", count=4), np.random.default_rng(0))} == {0.0}
    assert {r.arrival_s for r in draw(TraceSpec(count=4), np.random.default_rng(0))} == {None}  # closed loop


@pytest.mark.parametrize("fields, message", [
    ({"arrival": "storm"}, "arrival must be one of burst, poisson, closed"),
    ({"arrival": "poisson"}, "rate must be a number of requests per second > 0"),
    ({"concurrency": 0}, "concurrency must be an integer >= 1 (the clients of a closed loop)"),
    ({"prompt_len": (9, 3)}, "prompt_len must be [low, high]"),
    ({"count": 0}, "count must be an integer >= 1"),
])
def test_a_bad_trace_says_what_is_wrong_and_what_is_allowed(fields, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        TraceSpec(**fields)
