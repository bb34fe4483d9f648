"""Serving never runs an engine at a batch size the evaluator did not verify."""
from __future__ import annotations

import pytest
import torch

from evo.serving.app import LoadedEngine, _run_grouped, check_batch
from evo.workloads.kda import WORKLOAD as KDA
from tests import fake_workload as fw


def _loaded(engine, max_batch: int) -> LoadedEngine:
    return LoadedEngine(None, engine, (), "cpu", "", 0.0, 0.0, max_batch=max_batch)


def test_merged_batches_stay_within_the_verified_batch():
    calls: list[int] = []

    def engine(q):
        calls.append(q.shape[0])
        return {"o": q * 2}

    requests = [{"q": torch.full((b, 4, 2), float(i))} for i, b in enumerate([1, 2, 1, 3, 1, 1])]
    results, engine_calls = _run_grouped(_loaded(engine, 3), requests)
    assert max(calls) <= 3 and sum(calls) == 9 and len(engine_calls) == len(calls)
    for request, result in zip(requests, results):
        assert torch.equal(result["o"], request["q"] * 2)


def test_the_verified_batch_comes_from_the_workloads_free_axes():
    assert KDA.verified_batch(KDA.presets()["cpu"]) == 8
    assert fw.WORKLOAD.verified_batch(fw.WORKLOAD.presets()["cpu"]) == 2
    assert max(KDA.free_axes(KDA.presets()["cpu"])["B"]) == 8


def test_a_max_batch_size_beyond_the_verified_batch_is_refused():
    loaded = _loaded(lambda q: {"o": q}, 8)
    assert check_batch({"max_batch_size": 8}, loaded) == {"max_batch_size": 8}
    with pytest.raises(ValueError, match="verified at \\(B=8\\)"):
        check_batch({"max_batch_size": 9}, loaded)
    assert check_batch({"max_batch_size": None}, loaded) == {"max_batch_size": 8}  # unset: the verified B


def test_an_engine_found_wrong_with_no_engine_to_fall_back_on_fails_readiness():
    """Live re-scoring takes a wrong engine out of service: with no previous engine, /healthz and Serve's
    health check fail (the replica stops being routed to); with one, that one serves again."""
    import dataclasses

    from evo.serving.app import EngineServer

    server = object.__new__(EngineServer.func_or_class)  # its state and methods, without Serve's wrapper
    bad, good = (dataclasses.replace(_loaded(lambda q: {"o": q}, 8), record=_record(n)) for n in ("bad", "good"))
    server.loaded, server.previous, server.out_of_service, server.last_swap = bad, None, None, None
    server._take_out_of_service(bad, "answered wrongly")
    with pytest.raises(RuntimeError, match="taken out of service by live re-scoring: answered wrongly"):
        server.check_health()
    server.loaded, server.previous, server.out_of_service = bad, good, None
    server._take_out_of_service(bad, "answered wrongly")
    server.check_health()
    assert server.loaded is good and server.previous is None and server.last_swap["reason"] == "answered wrongly"


def _record(name: str):
    from evo.core.genome import Genome
    from evo.evidence.engine_record import EngineRecord

    return EngineRecord("kda", "cpu_small", Genome({"name": name}), f"test:{name}")
