"""`@champion` moves only on a paired win (evo.evidence.mlflow.registry.promote, issue 29): versions registered
from run summaries of the paired fake workload (engines of known latency, tests/paired_workload.py) in a real
MLflow store, each raced for real against the champion's registered record in one evaluator of this process,
through the driver's race (evo.driver.retime.champion_race) over a one-evaluator stand-in for the pool."""
from __future__ import annotations

import dataclasses

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from evaluators.judge.evaluator import Evaluator
from evaluators.settings import EvaluatorSettings
from evo.core.genome import Genome
from evo.core.retiming import FAILED, FASTER, IntensifySettings, failed_timing
from evo.driver.retime import champion_race
from evo.evidence.engine_record import EngineRecord
from evo.evidence.mlflow.registry import (BUDGET_CHAMPION, CHAMPION, KEPT_TAG, NOT_RACED, RACE_TAG, promote,
                                         register_best, register_engine)
from evo.evidence.summary import Summary
from tests import paired_workload

SETTINGS = IntensifySettings(calls=16, warmup=1)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    yield f"sqlite:///{tmp_path_factory.mktemp('champion') / 'mlflow.db'}"
    mlflow.set_tracking_uri(None)  # register_engine sets the process-wide URI


@pytest.fixture(scope="module")
def experiment(store) -> str:
    return MlflowClient(store).create_experiment("champion")


class _OneEvaluatorPool:
    """`EvaluatorPool.retime` in this process: every job in one real evaluator, as one of the pool's would."""

    def __init__(self) -> None:
        self.evaluator = Evaluator(paired_workload.NAME, "cpu", EvaluatorSettings(warmup=1, repeats=5), seed=3)
        self.jobs = []

    def retime(self, jobs):
        self.jobs += jobs
        return [self.evaluator.retime(list(job.engines), calls=job.calls, warmup=job.warmup, min_effect=job.min_effect,
                                      sources=job.sources, reason=job.reason, generation=job.generation)
                for job in jobs]


def _summary(genome_json: str, latency_ms: float) -> Summary:
    """A run's summary whose best engine is `genome_json`, measured once at `latency_ms` (a single median)."""
    genome = Genome.from_json(genome_json)
    return Summary(workload=paired_workload.NAME, preset="cpu", best_hash=genome.hash, best_genome=genome.to_dict(),
                   best_latency_ms=latency_ms, best_latency_spread_ms=0.1, device="cpu")


def _register(store, experiment, summary, tmp_path, race):
    client = MlflowClient(store)
    run_id = client.create_run(experiment).info.run_id
    return register_best(summary, tmp_path, run_id, "champion-engine", store, experiment, race=race)


def test_the_alias_moves_only_when_a_paired_race_confirms_a_faster_engine(store, experiment, tmp_path):
    """The same genome twice and a slower engine after a faster one: the alias moves in neither case, whatever
    their single timings say; a confirmed faster engine moves it, with the race's interval on its tags."""
    pool = _OneEvaluatorPool()
    race = champion_race(pool, SETTINGS)
    client = MlflowClient(store)
    slow, fast = paired_workload.genome_json(base_ms=40.0), paired_workload.genome_json(base_ms=2.0)
    slower_than_fast = paired_workload.genome_json(0.1, base_ms=2.0)  # 10% slower than `fast`

    first = _register(store, experiment, _summary(slow, 18.75), tmp_path, race)
    assert first.champion and first.previous is None and "first champion" in first.describe() and not pool.jobs

    again = _register(store, experiment, _summary(slow, 6.98), tmp_path, race)  # the observed bug: a lower median
    assert not again.champion and again.previous == first.version and not pool.jobs  # no race needed
    assert again.describe().startswith(f"alias @{CHAMPION} stays on version {first.version}: same genome")
    tags = client.get_model_version("champion-engine", again.version).tags
    assert tags[f"{RACE_TAG}_verdict"] == NOT_RACED and tags[f"{RACE_TAG}_against"] == first.version

    faster = _register(store, experiment, _summary(fast, 30.0), tmp_path, race)  # a higher single median: raced anyway
    assert faster.champion and faster.race.verdict == FASTER, faster.describe()
    assert [job.reason for job in pool.jobs] == [CHAMPION]
    assert pool.jobs[0].engines == (Genome.from_json(fast).to_json(), Genome.from_json(slow).to_json())
    assert faster.describe().startswith(f"alias @{CHAMPION} moved to version {faster.version}: paired 0.")
    assert f"the latency of version {first.version} [95% " in faster.describe()
    tags = client.get_model_version("champion-engine", faster.version).tags
    low, ratio, high = (float(tags[f"{RACE_TAG}_{key}"]) for key in ("low", "ratio", "high"))
    assert low <= ratio <= high < 1 - SETTINGS.min_effect
    assert tags[f"{RACE_TAG}_verdict"] == FASTER and tags[f"{RACE_TAG}_against"] == first.version
    assert tags[f"{RACE_TAG}_pairs"] == str(SETTINGS.calls)

    slower = _register(store, experiment, _summary(slower_than_fast, 0.5), tmp_path, race)
    assert not slower.champion and slower.race.verdict not in (FASTER, FAILED), slower.describe()
    assert slower.describe().startswith(f"alias @{CHAMPION} stays on version {faster.version}: ")
    assert "[95% " in slower.describe()
    assert str(client.get_model_version_by_alias("champion-engine", CHAMPION).version) == faster.version


def _record(genome_json: str, preset: str = "cpu", latency_ms: float | None = 5.0) -> EngineRecord:
    return EngineRecord(paired_workload.NAME, preset, Genome.from_json(genome_json), "test", latency_ms)


def _unraceable(*_):
    raise AssertionError("no race may run here")


def _blank(client, name: str) -> str:
    """A version with no artifacts (as one registered before engine.json would be)."""
    return client.create_model_version(name, "file:///nowhere").version


def test_a_champion_that_cannot_be_raced_keeps_the_alias(store, experiment):
    """A champion without engine.json (registered before it existed) or for another preset cannot be raced:
    it stays, and the text says how to move it by hand. A race that fails or does not run moves nothing."""
    client = MlflowClient(store)
    name = "unraceable"
    client.create_registered_model(name)
    old = _blank(client, name)
    client.set_registered_model_alias(name, CHAMPION, old)
    new = _record(paired_workload.genome_json(base_ms=2.0))
    version = _blank(client, name)
    kept = promote(client, name, version, new, _unraceable, store)
    assert not kept.champion and kept.previous == str(old) and "cannot be raced" in kept.describe()
    assert "set_registered_model_alias" in kept.describe()
    assert client.get_model_version(name, version).tags[f"{RACE_TAG}_verdict"] == NOT_RACED

    run_id = MlflowClient(store).create_run(experiment).info.run_id
    other = register_engine(_record(paired_workload.genome_json(base_ms=40.0), "cpu_bf16"), run_id, name, store)
    client.set_registered_model_alias(name, CHAMPION, other)
    kept = promote(client, name, _blank(client, name), new, _unraceable, store)
    assert not kept.champion and f"/cpu_bf16, this one for {paired_workload.NAME}/cpu: they cannot" in kept.reason

    same_preset = register_engine(_record(paired_workload.genome_json(base_ms=40.0)), run_id, name, store)
    client.set_registered_model_alias(name, CHAMPION, same_preset)

    def died(a, b):
        return failed_timing(a.genome.hash, b.genome.hash, "engine died", 0.02)

    failed = promote(client, name, _blank(client, name), new, died, store)
    assert not failed.champion and "paired race failed (engine died)" in failed.describe()
    off = champion_race(_OneEvaluatorPool(), IntensifySettings(enabled=False))
    skipped = promote(client, name, _blank(client, name), new, off, store)
    assert not skipped.champion and "no paired race was run" in skipped.describe()
    assert str(client.get_model_version_by_alias(name, CHAMPION).version) == same_preset


def test_a_first_version_takes_the_alias_only_when_measured(store):
    """No champion yet: no race; the first version with a measured latency takes the alias."""
    client = MlflowClient(store)
    name = "first"
    client.create_registered_model(name)
    unmeasured = promote(client, name, _blank(client, name), _record(paired_workload.genome_json(), latency_ms=None),
                         _unraceable, store)
    assert not unmeasured.champion and "no measured latency" in unmeasured.describe()
    first = promote(client, name, _blank(client, name), _record(paired_workload.genome_json()), _unraceable, store)
    assert first.describe() == f"alias @{CHAMPION} set to version {first.version} (the first champion)"
    assert str(client.get_model_version_by_alias(name, CHAMPION).version) == first.version


def test_the_driver_races_in_its_pool_and_keeps_the_race_with_the_runs_retimings(store, experiment, tmp_path):
    """`evo.driver.run.register_best` passes the registry a race over the run's pool (`parts.pool`) with
    `search.intensify`; the race joins the run's retimings.jsonl (generation -1: a resume ignores it)."""
    from types import SimpleNamespace

    from evo.driver.run import register_best as driver_register
    from evo.evidence.journal import read_retimings

    client = MlflowClient(store)
    config = SimpleNamespace(mlflow=SimpleNamespace(register_model=True, model_name="driver-engine"),
                             search=SimpleNamespace(intensify=SETTINGS), workload=paired_workload.NAME, preset="cpu")
    pool, said = _OneEvaluatorPool(), []
    uris = []
    for genome in (paired_workload.genome_json(base_ms=40.0), paired_workload.genome_json(base_ms=2.0)):
        sink = SimpleNamespace(run_id=client.create_run(experiment).info.run_id, pending=0, uri=store,
                               experiment_id=experiment)
        parts = SimpleNamespace(config=config, mlflow=sink, run_dir=tmp_path, pool=pool)
        uris.append(driver_register(parts, _summary(genome, 10.0), False, said.append))
    assert [job.reason for job in pool.jobs] == [CHAMPION]
    assert [t.reason for t in read_retimings(tmp_path)] == [CHAMPION]
    assert said[-1].startswith(f"registered {uris[-1]}: alias @{CHAMPION} moved to version 2: paired 0."), said
    assert str(client.get_model_version_by_alias("driver-engine", CHAMPION).version) == "2"


def _with_loss(summary: Summary, mode: str) -> Summary:
    """`summary` as a generation run's under the accuracy contract's `mode` (its best engine's `accuracy`)."""
    loss = {"mode": mode, "steps": 40, "requests": 4, "agreement": 0.99 if mode == "budget" else 1.0,
            "agreement_ci": [0.95, 1.0], "mean_gap": 0.004 if mode == "budget" else 0.0}
    return dataclasses.replace(summary, accuracy={"best": loss})


def test_a_lossy_engine_never_takes_the_champion_from_an_exact_one_it_contests_champion_budget(store, experiment,
                                                                                              tmp_path):
    """Exact-mode @champion, then faster budget-mode engines: @champion stays, the lossy ones take and race for
    @champion-budget by the same rule, each version says why and carries its mode; an exact engine still races
    for @champion. Over a budget-mode champion, an exact engine contests @champion as before."""
    pool = _OneEvaluatorPool()
    race = champion_race(pool, SETTINGS)
    client, name = MlflowClient(store), "modes-engine"

    def register(genome_json: str, mode: str):
        run_id = client.create_run(experiment).info.run_id
        summary = _with_loss(_summary(genome_json, 10.0), mode)
        return register_best(summary, tmp_path, run_id, name, store, experiment, race=race)

    exact = register(paired_workload.genome_json(base_ms=40.0), "exact")
    assert exact.champion and exact.alias == CHAMPION
    lossy = register(paired_workload.genome_json(base_ms=40.0, pad=True), "budget")  # lossy: no race for @champion
    assert lossy.alias == BUDGET_CHAMPION and lossy.champion and not pool.jobs  # the first @champion-budget: no race
    said = lossy.describe()
    assert said.startswith(f"alias @{CHAMPION} stays on version {exact.version} (exact mode): this engine is lossy "
                           f"(top-1 agreement 99.0% [95.0, 100.0], mean gap 0.004 logits (budget mode))"), said
    assert said.endswith(f"; alias @{BUDGET_CHAMPION} set to version {lossy.version} (the first @{BUDGET_CHAMPION})")
    tags = client.get_model_version(name, lossy.version).tags
    assert tags["accuracy_mode"] == "budget" and "never takes @champion" in tags[KEPT_TAG]
    assert tags["accuracy"] == "top-1 agreement 99.0% [95.0, 100.0], mean gap 0.004 logits (budget mode)"
    assert client.get_model_version(name, exact.version).tags["accuracy_mode"] == "exact"

    faster = register(paired_workload.genome_json(base_ms=2.0), "budget")  # 20x faster: races the lossy holder
    assert faster.alias == BUDGET_CHAMPION and faster.champion and faster.previous == lossy.version, faster.describe()
    assert pool.jobs[-1].engines[1] == Genome.from_json(paired_workload.genome_json(base_ms=40.0, pad=True)).to_json()
    assert client.get_model_version(name, faster.version).tags[f"{RACE_TAG}_alias"] == BUDGET_CHAMPION
    assert str(client.get_model_version_by_alias(name, CHAMPION).version) == exact.version
    assert str(client.get_model_version_by_alias(name, BUDGET_CHAMPION).version) == faster.version

    better = register(paired_workload.genome_json(base_ms=2.0, pad=True), "exact")  # exact: the paired rule
    assert better.alias == CHAMPION and better.champion and not better.kept, better.describe()

    client.create_registered_model("budget-first")  # a lossy first champion; an exact one contests it as ever
    first = promote(client, "budget-first", _blank(client, "budget-first"),
                    _record_with(paired_workload.genome_json(base_ms=40.0), "budget"), _unraceable, store)
    assert first.champion and first.alias == CHAMPION
    client.set_model_version_tag("budget-first", first.version, "accuracy_mode", "budget")
    contest = promote(client, "budget-first", _blank(client, "budget-first"),
                      _record_with(paired_workload.genome_json(base_ms=2.0), "exact"), _unraceable, store)
    assert contest.alias == CHAMPION and not contest.kept and "cannot be raced" in contest.reason  # no engine.json


def _record_with(genome_json: str, mode: str) -> EngineRecord:
    return dataclasses.replace(_record(genome_json), accuracy={"mode": mode})
