"""A small search on a real local Ray with 2 evaluator actors, real torch engines and a real MLflow server."""
import json

import pyarrow.parquet as pq
import pytest
import torch
from mlflow.tracking import MlflowClient

from evo.core.genome import Genome
from evo.core.retiming import FAILED
from evo.workloads import get_workload
from evo.workloads.base import CheckCase, DeviceInfo
from tests.conftest import SMOKE_EXPERIMENT, smoke_config
from tests.run_checks import check_finished_run


@pytest.fixture(scope="module")
def outcome(smoke_on_server):
    """The session's configs/kda_smoke.yaml run (tests/conftest.py), on a real `mlflow server`."""
    result, server, _, log = smoke_on_server
    return result, smoke_config(server.uri), server.uri, log


def test_parquet_evidence_is_complete(outcome):
    result, config, _, _ = outcome
    rows, _ = check_finished_run(result.run_dir, config.search.generations, config.search.max_evaluations)
    assert all(row["max_rel_error"] <= 1e-5 for row in rows if row["status"] == "ok")
    assert len({row["evaluator"] for row in rows}) >= 2, "both evaluator actors should have worked"


def test_summary_reports_best_baselines_and_roofline(outcome):
    result, config, _, log = outcome
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert set(summary["baselines"]) == set(config.baselines)
    assert all(b["status"] == "ok" for b in summary["baselines"].values())
    best_ms = summary["best_latency_ms"]
    assert best_ms > 0
    for name, speedup in summary["speedups"].items():
        assert speedup == pytest.approx(summary["baselines"][name]["latency_ms"] / best_ms)
    assert 0 < summary["roofline"]["fraction_of_floor"] < 1
    assert json.loads((result.run_dir / "best_genome.json").read_text()) == summary["best_genome"]
    assert "best engine" in log and "vs best baseline" in log
    # the final paired re-timing against every baseline: each speedup with its 95% interval
    assert set(summary["speedup_ci"]) == set(config.baselines), log[-3000:]
    for name, (low, high) in summary["speedup_ci"].items():
        assert 0 < low <= summary["speedup_paired"][name] <= high
    assert summary["intensification"]["retimings"] <= summary["intensification"]["budget"]
    final = [json.loads(line) for line in (result.run_dir / "retimings.jsonl").read_text().splitlines()]
    assert {r["b"] for r in final if r["reason"] == "baseline"} == {f"baseline:{n}" for n in config.baselines}
    # and against the run's default genome, unless that is the best
    against_default = [r for r in final if r["reason"] == "default"]
    assert len(against_default) <= 1 and summary["best_hash"] not in [r["b"] for r in against_default]
    if against_default and against_default[0]["verdict"] != FAILED:
        estimate, low, high = summary["vs_default"]["speedup"]
        assert summary["vs_default"]["hash"] == against_default[0]["b"] and 0 < low <= estimate <= high
        assert "vs default" in log
    else:
        assert not summary["vs_default"], log[-3000:]
    assert "faster than" in log and "(paired, 95% [" in log and "re-timings" in log
    # one line per finished candidate, and the whole log in the run directory
    assert sum(line.startswith("cand gen ") for line in log.splitlines()) == summary["evaluations"], log[-3000:]
    assert "best engine" in (result.run_dir / "run.log").read_text()


def test_best_engine_is_correct_on_fresh_inputs(outcome):
    result, config, _, _ = outcome
    workload = get_workload("kda")
    preset = workload.presets()[config.preset]
    genome = Genome.from_dict(result.summary.best_genome)
    engine = workload.build(genome, preset, DeviceInfo("cpu", "cpu", 1))
    for seed, distribution in ((1234, "standard"), (99, "strong_decay")):
        case = CheckCase(distribution, {**preset.shape, "T": preset.shape["T"] - 3}, distribution, True)
        inputs = workload.make_inputs(case, preset.dtype, "cpu", seed)
        ref = workload.reference({k: v.clone() for k, v in inputs.items()})
        out = engine(**inputs)
        for name in ("o", "final_state"):
            err = (out[name].double() - ref[name]).norm() / ref[name].norm()
            assert torch.isfinite(out[name]).all() and err < 1e-5, (name, err)


def test_mlflow_holds_parent_and_generation_runs(outcome):
    result, config, uri, _ = outcome
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(SMOKE_EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.run_id == result.mlflow_run_id and parent.info.status == "FINISHED"
    assert parent.data.params["search.seed"] == str(config.search.seed)
    history = client.get_metric_history(parent.info.run_id, "best_latency_ms")
    assert [m.step for m in history] == list(range(config.search.generations))
    assert all(b.value <= a.value for a, b in zip(history, history[1:]))
    assert parent.data.metrics["single_timing_speedup_vs_best_baseline"] == pytest.approx(result.summary.speedup_vs_best_baseline,
                                                                          rel=1e-5)
    assert all(float(f"{v:.6g}") == v for v in parent.data.metrics.values())  # as the UI shows them: 6 digits
    assert "fraction_of_roofline" in parent.data.metrics
    for name in config.baselines:
        claim = f"a_paired_speedup_vs_{name}"  # the paired claims, named to sort first
        assert parent.data.metrics[f"{claim}.low95"] <= parent.data.metrics[claim] <= parent.data.metrics[f"{claim}.high95"]
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {"summary.json", "best_genome.json"}
    children = client.search_runs([experiment.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(int(c.data.tags["generation"]) for c in children) == list(range(config.search.generations))
    for child in children:
        evidence = client.list_artifacts(child.info.run_id, "evidence")
        assert [a.path for a in evidence] == [f"evidence/gen_{int(child.data.tags['generation']):04d}.parquet"]
        local = client.download_artifacts(child.info.run_id, evidence[0].path)
        assert pq.read_table(local).num_rows > 0


def test_best_engine_is_registered_as_a_model_linked_to_the_search(outcome):
    import mlflow

    from evo.serving.source import resolve

    result, config, uri, _ = outcome
    registered = result.summary.registered_model
    name, version = registered.removeprefix("models:/").split("/")
    client = MlflowClient(tracking_uri=uri)
    model_version = client.get_model_version(name, version)
    assert model_version.run_id == result.mlflow_run_id
    assert set(model_version.tags) >= {f"speedup_ci.{b}" for b in config.baselines}, model_version.tags
    record = resolve(registered, uri)
    assert record.genome.hash == result.summary.best_hash and record.preset == config.preset
    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model(registered)
    workload = get_workload("kda")
    preset = workload.presets()[config.preset]
    inputs = workload.make_inputs(CheckCase("pyfunc", preset.shape, "strong_decay", True), preset.dtype, "cpu", 4321)
    outputs = model.predict({k: v.numpy() for k, v in inputs.items()})
    reference = workload.reference(inputs)
    for name in ("o", "final_state"):
        got = torch.as_tensor(outputs[name]).double()
        assert ((got - reference[name]).norm() / reference[name].norm()).item() < 1e-5
