"""The Ray evaluator pool: every proposal gets exactly one result, even when evaluators hang or die."""
import dataclasses

import pytest

from evaluators.pool.actors import EvaluatorPool, PlacementError, PoolSettings
from evaluators.settings import EvaluatorSettings
from evo.core.genome import Genome
from evo.core.records import OK, RUNTIME_ERROR, TIMEOUT, Proposal
from tests import fake_workload

PRESET = fake_workload.WORKLOAD.presets()["cpu"]


def proposal(impl, index):
    return Proposal(Genome.from_json(fake_workload.genome_json(impl)), (), "seed", impl, 0, index=index)


@pytest.fixture(scope="module")
def pool(ray_local):
    settings = EvaluatorSettings(warmup=1, repeats=3, eval_timeout_s=8.0)
    pool = EvaluatorPool("tests.fake_workload", PRESET, settings, run_seed=0, pool=PoolSettings(count=2, threads=1))
    yield pool
    pool.close()


def test_two_evaluators_on_disjoint_cores(pool):
    infos = pool.describe()
    assert len(infos) == 2
    assert infos[0]["cores"] != infos[1]["cores"]
    assert not set(infos[0]["cores"]) & set(infos[1]["cores"])


def test_hanging_and_dying_engines_are_recorded_and_the_evaluators_survive(pool):
    before = {info["pid"] for info in pool.describe()}
    proposals = [proposal("cumsum", 0), proposal("hang", 1), proposal("exit", 2), proposal("loop", 3)]
    results = {p.move: r for p, r in pool.run(proposals)}
    assert sorted(results) == ["cumsum", "exit", "hang", "loop"]
    assert results["hang"].status == TIMEOUT and "eval_timeout_s" in results["hang"].message
    assert results["exit"].status == RUNTIME_ERROR and "died (exit code 3)" in results["exit"].message
    assert results["cumsum"].status == OK and results["loop"].status == OK
    # Only the engines' own processes died: the same evaluator actors still work.
    assert {info["pid"] for info in pool.describe()} == before
    again = dict((p.move, r) for p, r in pool.run([proposal("cumsum", 0), proposal("loop", 1)]))
    assert {r.status for r in again.values()} == {OK}


def test_baselines_run_through_the_pool(pool):
    results = pool.run_baselines(["torch_cumsum", "broken"])
    assert results["torch_cumsum"].status == OK and results["broken"].status == "incorrect"


def test_paired_re_timings_run_through_the_pool_one_answer_per_job(pool):
    """Each job in one evaluator actor (`Evaluator.retime`), answers in job order; a wrong engine fails."""
    from evaluators.pool.actors import RetimeJob

    good, same = fake_workload.genome_json("cumsum"), fake_workload.genome_json("cumsum", threads=1)
    jobs = [RetimeJob((good, same), {}, calls=8, warmup=0, reason="parent", generation=3),
            RetimeJob((fake_workload.genome_json("zeros"), "baseline:torch_cumsum"), {}, calls=8, warmup=0),
            RetimeJob((good, "torch_cumsum", "broken"), {}, calls=8, warmup=0, reason="baseline")]
    (aa,), (wrong,), final = pool.retime(jobs)
    assert aa.verdict != "failed" and aa.pairs == 8 and aa.reason == "parent" and aa.generation == 3, aa.message
    assert aa.evaluator.startswith("evaluator-") and aa.telemetry
    assert wrong.verdict == "failed" and "incorrect" in wrong.message
    assert len(final) == 2 and all(t.verdict == "failed" for t in final)  # the broken baseline fails the run
    assert "baseline:broken" in final[0].message


def test_unplaceable_evaluators_fail_fast(ray_local):
    settings = EvaluatorSettings()
    with pytest.raises(PlacementError, match="need 64 CPUs"):
        EvaluatorPool("tests.fake_workload", PRESET, settings, 0, PoolSettings(count=64, threads=1))
    with pytest.raises(PlacementError, match="needs GPUs"):
        EvaluatorPool("tests.fake_workload", dataclasses.replace(PRESET, device="cuda"), settings, 0)
