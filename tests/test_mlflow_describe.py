"""What MLflow shows of a search, without Ray: the run's description, the model version's tags, signature
and alias rule, the UI's URLs, the outbox's description op, and the progress of long phases."""
from __future__ import annotations

import dataclasses
import io
import json
import os
import re

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from evo.driver.progress import RunLog, log
from evo.evidence.mlflow.describe import EXPERIMENT_ID, NOTE_TAG, RUN_ID, run_description, version_tags
from evo.evidence.mlflow.links import EXPERIMENT_KIND, KIND_TAG, run_url, ui_hint
from evo.evidence.mlflow.outbox import Outbox
from evo.evidence.mlflow.registry import CHAMPION, LATENCY_TAG, engine_signature, input_example
from evo.evidence.summary import Summary
from evo.workloads import get_workload
from tests.waiting import wait_for

SUMMARY = Summary(workload="kda", preset="cpu_small", best_hash="43fa7490741d11d7", best_genome={"fusion": {}},
                  best_latency_ms=4.816999999, best_latency_spread_ms=0.12149, best_max_rel_error=3.33e-7,
                  device="cpu:AMD EPYC", best_baseline="chunk_pairwise_c64", best_baseline_latency_ms=21.94,
                  speedup_vs_best_baseline=4.554701, speedups={"chunk_pairwise_c64": 4.554701, "eager_recurrent": 10.338},
                  baselines={"chunk_pairwise_c64": {"status": "ok", "latency_ms": 21.94},
                             "eager_recurrent": {"status": "ok", "latency_ms": 49.80}},
                  roofline={"floor_ms": 0.109, "fraction_of_floor": 0.02263}, evaluations=12, generations=3,
                  status_counts={"ok": 11, "incorrect": 1}, wall_s=57.2,
                  speedup_ci={"chunk_pairwise_c64": [2.2841, 2.8733]}, speedup_paired={"chunk_pairwise_c64": 2.6302},
                  registered_model="models:/kda-cpu_small-engine/3")


def test_the_run_description_states_best_engine_speedups_roofline_and_links():
    text = run_description(SUMMARY, "/runs/kda-smoke-1")
    # the claim is the first line (the UI folds a description after ~150 px); the single timing says it is one
    first, second = text.splitlines()[:2]
    assert first == "**`43fa7490741d11d7` is 2.63x faster than chunk_pairwise_c64 (paired, 95% [2.28, 2.87]).**"
    assert "Single timing (one evaluation's median, not a claim): 4.817 ms (IQR 0.121 ms)" in second
    rows = [line for line in text.splitlines() if line.startswith("| ") and "ms |" in line]
    assert rows == ["| chunk_pairwise_c64 | 21.940 ms | paired 2.63x, 95% [2.28, 2.87]; single timing 4.55x |",
                    "| eager_recurrent | 49.800 ms | single timing 10.34x (not re-timed paired) |"]  # paired first
    assert "2.3% of the roofline floor (0.109 ms)" in text
    assert "By single timing: 4.55x faster than the best baseline" in text
    lineage = re.search(r"\[the lineage page\]\(([^)]+)\)", text).group(1)
    assert lineage == f"#/experiments/{EXPERIMENT_ID}/runs/{RUN_ID}/artifacts/lineage/lineage.html?workflowType=machine_learning"
    assert "(#/models/kda-cpu_small-engine/versions/3?workflowType=machine_learning)" in text
    assert not re.search(r"\d\.\d{5,}", text), "unrounded numbers in the description"
    failed = run_description(Summary(), "/runs/x", "FAILED")
    assert "search failed" in failed and "No correct engine" in failed


def test_version_tags_are_rounded_and_name_every_baseline():
    tags = version_tags(SUMMARY, "abc123", "/runs/kda-smoke-1")
    assert tags["genome_hash"] == "43fa7490741d11d7" and tags[LATENCY_TAG] == "4.8170"
    assert tags["latency"] == "4.817 ms (IQR 0.121 ms)" and tags["device"] == "cpu:AMD EPYC"
    assert tags["claim"] == "43fa7490741d11d7 is 2.63x faster than chunk_pairwise_c64 (paired, 95% [2.28, 2.87])"
    assert tags["speedup.chunk_pairwise_c64"] == "paired 2.63x, 95% [2.28, 2.87]; single timing 4.55x"
    assert tags["speedup.eager_recurrent"] == "single timing 10.34x (not re-timed paired)"
    assert tags["speedup_ci.chunk_pairwise_c64"] == "[2.284, 2.873]" and tags["speedup_paired.chunk_pairwise_c64"] == "2.630"
    assert (tags["preset"], tags["run_id"], tags["run_dir"]) == ("cpu_small", "abc123", "/runs/kda-smoke-1")


def test_the_claim_says_equal_or_single_timing_only_when_that_is_all_there_is():
    import dataclasses

    from evo.evidence.claims import claim_sentence
    from evo.evidence.mlflow.describe import version_description

    equal = dataclasses.replace(SUMMARY, speedup_paired={"chunk_pairwise_c64": 1.01},
                                speedup_ci={"chunk_pairwise_c64": [0.97, 1.05]})
    assert claim_sentence(equal) == ("`43fa7490741d11d7` is equal within noise to chunk_pairwise_c64: "
                                     "1.01x (paired, 95% [0.97, 1.05])")
    single = dataclasses.replace(SUMMARY, speedup_paired={}, speedup_ci={})
    assert "not re-timed paired: single timing only" in run_description(single, "/r").splitlines()[0]
    described = version_description(SUMMARY, "kda-smoke-1", "1", "r1")
    assert described.startswith("**`43fa7490741d11d7` is 2.63x faster than chunk_pairwise_c64 (paired")


def test_a_candidate_left_unexamined_is_named_by_the_description_and_the_terminal():
    import dataclasses

    from evo.evidence.claims import claim_lines

    why = "the final race's wall time ran out (search.intensify.race_wall_s = 0 s)"
    left = dataclasses.replace(SUMMARY, unexamined=[{"hash": "9d0c1e5a77aa01b2", "latency_ms": 1.25, "reason": why}])
    head = run_description(left, "/r").splitlines()[:3]  # before MLflow's fold
    assert any("`9d0c1e5a77aa01b2` (1.250 ms): " + why in line for line in head), head
    from evo.evidence.claims import short_claim

    assert short_claim(left) == "2.63x vs chunk_pairwise_c64 [2.28, 2.87] paired"
    lines = claim_lines(left)
    assert lines[0] == "43fa7490741d11d7 is 2.63x faster than chunk_pairwise_c64 (paired, 95% [2.28, 2.87])"
    assert f"  unexamined: 9d0c1e5a77aa01b2 looked faster (1.250 ms, one single timing) and was never re-timed: {why}" in lines
    assert lines[-1].startswith("  single timing 4.817 ms") and "not a claim" in lines[-1]


def test_the_signature_is_the_workloads_request_schema_and_the_example_fits_it():
    workload = get_workload("kda")
    preset = workload.presets()["cpu_small"]
    H, K, V = (preset.shape[a] for a in "HKV")
    signature = engine_signature(workload, preset)
    inputs = {spec.name: spec.shape for spec in signature.inputs.inputs}
    assert inputs == {"q": (-1, -1, H, K), "k": (-1, -1, H, K), "v": (-1, -1, H, V), "g": (-1, -1, H, K),
                      "beta": (-1, -1, H), "initial_state": (-1, H, K, V)}
    assert {spec.name: spec.shape for spec in signature.outputs.inputs} == {"o": (-1, -1, H, V),
                                                                            "final_state": (-1, H, K, V)}
    example = input_example(workload, preset)
    assert set(example) == set(inputs) and all(isinstance(a, np.ndarray) for a in example.values())
    assert example["q"].shape[2:] == (H, K) and example["q"].size <= 8 * H * K * 8  # small: B and T at their lowest


def test_ui_urls_open_the_runs_view():
    assert run_url("http://127.0.0.1:5123/", "7", "r1") == \
        "http://127.0.0.1:5123/#/experiments/7/runs/r1?workflowType=machine_learning"
    assert run_url("sqlite:////tmp/m.db", "7", "r1").startswith("http://127.0.0.1:5000/#/experiments/7/runs/r1")
    assert ui_hint("sqlite:////tmp/m.db") == "mlflow ui --backend-store-uri sqlite:////tmp/m.db --host 127.0.0.1 --port 5000"
    assert ui_hint("http://127.0.0.1:5123") is None


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def test_the_outbox_tags_the_experiment_and_fills_the_description_with_the_runs_ids(store, tmp_path):
    outbox = Outbox(tmp_path, store, "describe")
    outbox.add({"op": "run", "ref": "s/parent", "run_name": "p", "tags": {}, "start_time": 1})
    outbox.add({"op": "note", "run": "s/parent", "text": f"see #/experiments/{EXPERIMENT_ID}/runs/{RUN_ID}"})
    assert outbox.drain(10)
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("describe")
    run_id = outbox.run_id("s/parent")
    assert experiment.tags[KIND_TAG] == EXPERIMENT_KIND
    assert client.get_run(run_id).data.tags[NOTE_TAG] == f"see #/experiments/{experiment.experiment_id}/runs/{run_id}"


def test_the_run_logs_the_best_engines_loss_and_leads_its_name_with_it(store, tmp_path):
    """A generation run's loss on its MLflow run: the mode as a tag, the finite figures as metrics, the name's
    claim and the description's first line with the loss (tests/test_claims_loss.py words it)."""
    from evo.evidence.mlflow.sink import RUN_NAME_TAG, MlflowSink
    from tests.test_claims_loss import SUMMARY as GENERATION

    lossy = dataclasses.replace(GENERATION, accuracy={"best": {**GENERATION.accuracy["best"], "max_gap": None}})
    sink = MlflowSink(store, "loss", "llama_serve-run", {}, {}, run_dir=tmp_path, finish_wait_s=10)
    assert sink.finish(lossy, tmp_path)
    run = MlflowClient(store).get_run(sink.run_id).data
    assert run.tags["accuracy_mode"] == "budget" and run.tags[RUN_NAME_TAG].endswith("paired at 99.4% top-1")
    assert run.metrics["accuracy_agreement"] == 0.994 and run.metrics["accuracy_mean_gap"] == 0.003
    assert "accuracy_max_gap" not in run.metrics  # not measured (JSON's null): no metric
    assert run.tags[NOTE_TAG].splitlines()[0].endswith("mean gap 0.003 logits (budget mode).**")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_counter_lines_elsewhere():
    terminal = _Terminal()
    run_log = RunLog(terminal, heartbeat_s=0.2)
    with run_log.phase("baselines", 2, "timed") as phase:
        log.info("timing baselines: a, b")
        phase.advance(note="a")
        phase.advance(note="b")
        assert phase.bar is not None and phase.bar.n == 2
    run_log.close()
    text = terminal.getvalue()
    assert "\rbaselines:   0%" in text and "0/2" in text and "\rtiming baselines: a, b\n" in text  # the line above the bar
    assert "  ... " not in text  # a bar, no counter lines

    plain = io.StringIO()
    run_log = RunLog(plain, heartbeat_s=0.2)
    with run_log.phase("search", 12, "evaluations") as phase:
        phase.advance(note="generation 0")
        wait_for(lambda: "  ... search: 1/12 evaluations done, generation 0;" in plain.getvalue(), 30,
                 "a counter line after a silence")
    run_log.close()
    assert "\r" not in plain.getvalue()

    quiet = RunLog(_Terminal(), verbosity=-1)  # -q: neither bars nor counter lines, even on a terminal
    assert not quiet.bars and not quiet.counters
    quiet.close()


def test_description_fits_in_a_tag():
    assert len(run_description(SUMMARY, "/r" * 100)) < 8000
    assert json.dumps(version_tags(SUMMARY, "x", "/r"))  # every value a string


def test_a_registered_engine_resolves_from_its_own_store_whatever_store_the_process_set(tmp_path_factory,
                                                                                       monkeypatch):
    """MLflow resolves `models:/` against the process-wide registry: `resolve` must ask the store it is given.
    Registering keeps the input example but never loads the engine (the judge verified it already)."""
    import mlflow

    from evo.evidence.mlflow import pyfunc_engine
    from evo.evidence.mlflow.registry import register_engine
    from evo.serving.source import resolve

    loads = []
    monkeypatch.setattr(pyfunc_engine, "_load_pyfunc", lambda path, real=pyfunc_engine._load_pyfunc:
                        loads.append(path) or real(path))
    own, other = (f"sqlite:///{tmp_path_factory.mktemp(name) / 'mlflow.db'}" for name in ("own", "other"))
    record = resolve("default:kda/cpu_small")
    client = MlflowClient(own)
    run_id = client.create_run(client.create_experiment("resolve")).info.run_id
    version = register_engine(record, run_id, "resolve-engine", own)
    assert loads == [], "registering loaded the engine (MLflow's serving-input validation)"
    logged = os.listdir(mlflow.artifacts.download_artifacts(f"models:/resolve-engine/{version}", tracking_uri=own,
                                                            registry_uri=own, dst_path=str(tmp_path_factory.mktemp("dl"))))
    assert {"MLmodel", "serving_input_example.json"} <= set(logged), logged
    client.set_registered_model_alias("resolve-engine", CHAMPION, version)
    mlflow.set_tracking_uri(other)
    try:
        for source in (f"models:/resolve-engine/{version}", "models:/resolve-engine/latest",
                       f"models:/resolve-engine@{CHAMPION}"):
            assert resolve(source, own).genome.hash == record.genome.hash, source
    finally:
        mlflow.set_tracking_uri(None)
