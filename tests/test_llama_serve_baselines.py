"""The serving baselines (one request at a time, transformers' static and continuous batching), each replayed
by the judge as a client (evaluators.judge.replay) on the cpu_small preset and scored on its own tokens against
the float64 reference; and each batching as it claims: static batches admitted together, one request at a
time never overlapping, continuous batching streaming per token."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from evaluators.judge.replay import Replay, replay, score
from evo.core.trace import TraceSpec, draw
from evo.workloads.base import DeviceInfo
from evo.workloads.generation import GenerationRequest
from evo.workloads.llama.baselines import transformers_available
from evo.workloads.llama.reference import generate
from evo.workloads.llama_serve.baselines import baselines
from evo.workloads.llama_serve.presets import PRESETS

PRESET = PRESETS["cpu_small"]
CPU = DeviceInfo("cpu", "cpu", 1)
needs_transformers = pytest.mark.skipif(not transformers_available(), reason="transformers is not installed")


@pytest.fixture
def one_thread(one_torch_thread):
    """The test on one torch thread (tests/conftest.py)."""


def _replayed(engine, seed: int = 5) -> Replay:
    """A closed loop of 8 requests, 4 in flight, prompts 1-24 of fresh token ids (0 and V-1 among them), scored."""
    rng = np.random.default_rng(seed)
    trace = draw(TraceSpec("closed", count=8, concurrency=4, prompt_len=(1, 24), output_len=(1, 12)), rng)
    V = PRESET.model.vocab
    prompts = [rng.integers(0, V, t.prompt_len).tolist() for t in trace]
    prompts[0][0], prompts[1][-1] = 0, V - 1
    result = replay(engine, trace, prompts, concurrency=4, deadline_s=120)

    def reference(prompt, tokens):  # row i: the float64 logits that predict tokens[i]
        continuation = torch.tensor([list(tokens[:-1])], dtype=torch.long)
        return generate(PRESET.model, torch.tensor([list(prompt)]), continuation)[0].numpy()

    assert score(result, reference, tolerance=1e-4, vocab=V) == []
    assert not result.violations
    assert [len(t) for t in result.tokens] == [r.max_tokens for r in result.requests]
    return result


def test_the_baselines_offered_are_ours_and_transformers_when_importable(monkeypatch):
    import evo.workloads.llama_serve.baselines as module

    expected = {"one_at_a_time"} | ({"hf_static", "hf_continuous"} if transformers_available() else set())
    assert set(baselines(PRESET)) == expected
    monkeypatch.setattr(module, "transformers_available", lambda: False)
    assert set(baselines(PRESET)) == {"one_at_a_time"}


def test_one_at_a_time_serves_each_request_alone_in_arrival_order(one_thread):
    engine = baselines(PRESET)["one_at_a_time"](CPU)
    assert engine.num_threads == 1
    result = _replayed(engine)
    spans = sorted((t.token_s[0], t.token_s[-1]) for t in result.timelines)
    assert all(first > last for (_, last), (first, _) in zip(spans, spans[1:]))
    with pytest.raises(ValueError, match="positions this engine holds"):
        engine.add(GenerationRequest(99, (1,) * PRESET.max_positions, 1))


@needs_transformers
def test_hf_static_admits_a_batch_together_and_the_next_only_when_it_ends(one_thread):
    engine = baselines(PRESET)["hf_static"](CPU)
    assert engine.num_threads == 1
    result = _replayed(engine)
    batches: dict[float, list] = {}  # one prefill step stamps every first token of its batch alike
    for t in result.timelines:
        batches.setdefault(t.token_s[0], []).append(t)
    ordered = [batches[s] for s in sorted(batches)]
    assert len(ordered) >= 2 and len(ordered[0]) == 4
    waited = 0
    for before, after in zip(ordered, ordered[1:]):
        ended = max(t.token_s[-1] for t in before)
        assert min(t.token_s[0] for t in after) > ended
        waited += sum(t.sent_s < ended for t in after)
    assert waited, "no request arrived while a batch ran: the trace does not test admission"


@needs_transformers
def test_hf_continuous_admits_requests_while_others_run_and_streams_them(one_thread):
    engine = baselines(PRESET)["hf_continuous"](CPU)
    assert engine.num_threads == 1
    try:
        result = _replayed(engine)
    finally:
        engine.close()
    assert not engine.manager.is_running()
    joined = [(late, early) for late in result.timelines for early in result.timelines
              if early.token_s[0] < late.sent_s and late.token_s[0] < early.token_s[-1]]
    assert joined, "no request got its first token while one admitted before it still ran"
    spread = [len(set(t.token_s)) for t, r in zip(result.timelines, result.requests) if r.max_tokens >= 3]
    assert max(spread) >= 2, "every request's tokens came in one step: not streamed"


@needs_transformers
def test_hf_continuous_ends_a_request_at_its_stop_id(one_thread):
    """The stop ids are the request's eos in the manager: its last token, marked finished, nothing after."""
    engine = baselines(PRESET)["hf_continuous"](CPU)
    try:
        free = GenerationRequest(0, (3, 1, 4, 1, 5), 6)
        engine.add(free)
        tokens = [e.token for _ in range(6) for e in engine.step()]
        stop = tokens[2]
        engine.add(GenerationRequest(1, free.prompt, 6, stop_ids=(stop,)))
        events = []
        while not events or not events[-1].finished:
            events += engine.step()
        made = [e.token for e in events]
        assert made == tokens[:tokens.index(stop) + 1] and [e.finished for e in events][-1]
        assert engine.step() == []
    finally:
        engine.close()
