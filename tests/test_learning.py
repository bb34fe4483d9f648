"""Agents that learn from evidence, Optuna as a strategy and as an agent, and the strategy benchmark:
invariants with the deterministic synthetic evaluator (no Ray, no timing)."""
import json
import math

import numpy as np
import pytest
from optuna.trial import TrialState

from evaluators.judge.synthetic import SyntheticEvaluator
from evo.bench.compare import compare
from evo.driver.config import config_from_dict
from evo.core.effects import GeneEffects
from evo.core.genome import Genome
from evo.core.loop import LocalExecutor, run_search
from evo.core.optuna_study import GenomeStudy
from evo.core.records import OK
from evo.core.search import Search, SearchSettings
from evo.bench.strategies import run_optuna
from operators.optuna_agent import OptunaAgent
from operators.base import Parent
from operators.scheduling import SchedulingAgent
from operators.team import LocalTeam
from tests.toy_space import toy_space


def make_search(seed=0, agents=("fusion", "scheduling", "memory", "integration"), **overrides):
    settings = SearchSettings(**{"seed": seed, "generations": 50, "offspring": 6, "max_evaluations": 40,
                                 "agents": tuple(agents), **overrides})
    space = toy_space()
    return Search(space, settings, LocalTeam(list(settings.agents), space, settings.seed))


def run(seed=0, **overrides):
    search, evaluator = make_search(seed, **overrides), SyntheticEvaluator()
    reports = run_search(search, LocalExecutor(evaluator))
    return search, evaluator, reports


# -- Optuna -------------------------------------------------------------------------------------
def test_optuna_strategy_respects_the_gene_space_constraints():
    space = toy_space()

    class Checking(SyntheticEvaluator):
        def evaluate(self, genome_json):
            assert space.is_legal(Genome.from_json(genome_json)), "an illegal genome reached the evaluator"
            return super().evaluate(genome_json)

    evaluator = Checking()
    trajectory = run_optuna(space, evaluator, budget=30, seed=1)
    assert len(trajectory.steps) == len(evaluator.calls) == 30 == len(set(evaluator.calls))
    assert trajectory.steps[0].genome_hash == space.default().hash  # every strategy starts level


def test_illegal_trials_are_told_to_the_sampler_as_infeasible_and_never_evaluated():
    space = toy_space()
    study = GenomeStudy(space, seed=5)
    evaluator, illegal, legal = SyntheticEvaluator(), 0, 0
    for _ in range(60):
        trial, genome = study.ask()
        if genome is None:
            illegal += 1
            continue
        assert space.is_legal(genome)
        legal += 1
        study.tell(trial, evaluator.evaluate(genome.to_json()))
    trials = study.study.get_trials(deepcopy=False)
    infeasible = [t for t in trials if t.constraints.get("legal", 0) > 0]
    assert illegal > 0 and len(infeasible) == illegal == study.illegal
    for t in infeasible:  # reported to the sampler (not dropped, not redrawn): pruned with the reason
        assert t.state == TrialState.PRUNED and "illegal combination" in t.user_attrs["illegal"]
        with pytest.raises(Exception):
            space.make(t.params)
    failed = [t for t in trials if t.constraints.get("ok", 0) > 0]
    assert failed and all(t.user_attrs["status"] != OK for t in failed)
    assert len(evaluator.calls) == legal


def test_optuna_agent_proposes_legal_new_genomes_and_restores_to_the_same_proposals():
    search, evaluator, _ = run(agents=("fusion", "scheduling", "optuna"), max_evaluations=36)
    mine = [e for e in search.known.values() if e.proposal.agent == "optuna"]
    assert mine and all(search.gene_space.is_legal(e.proposal.genome) for e in mine)
    assert len(evaluator.calls) == len(set(evaluator.calls)) == 36
    agent = search.team.agents["optuna"]
    assert len(agent.history) == 36  # it saw every result, its own and the other agents'
    twin = OptunaAgent(search.gene_space, seed=agent.seed)
    twin.load_state(json.loads(json.dumps(agent.state(), allow_nan=True)))
    known = frozenset(search.known)
    a = agent.propose([], 4, 99, known)
    b = twin.propose([], 4, 99, known)
    assert [p.hash for p in a] == [p.hash for p in b] and not {p.hash for p in a} & known


# -- learning from evidence ---------------------------------------------------------------------
def test_gene_effects_count_every_result_and_steer_away_from_failing_or_slow_values():
    space = toy_space()
    effects, base = GeneEffects(), space.default()
    for i in range(20):  # algorithm=c always fails, algorithm=b is fast, store=False is slow
        effects.add(base.with_genes(algorithm="c", chunk_size=(16, 32, 64, 128)[i % 4]), "incorrect", math.nan,
                    f"output 'o' has {i} non-finite values")
        effects.add(base.with_genes(algorithm="b", layout=("head_major", "time_major")[i % 2]), OK, 5.0)
        effects.add(base.with_genes(store=False), OK, 20.0)
        effects.add(base, OK, 10.0)
    row = {(r["gene"], r["value"]): r for r in effects.table()}
    assert row[("algorithm", "c")]["failed"] == 20 and effects.results == 80
    assert row[("algorithm", "c")]["messages"] == {"output 'o' has N non-finite values": 20}
    assert row[("algorithm", "b")]["latency_vs_mean_pct"] < 0 < row[("store", "false")]["latency_vs_mean_pct"]
    rng = np.random.default_rng(0)
    score = lambda child: np.mean([effects.sample_score(rng, base, child) for _ in range(200)])  # noqa: E731
    assert score(base.with_genes(algorithm="c")) > 0.1  # toward failure: worse
    assert score(base.with_genes(store=False)) > 0.1  # toward slow: worse
    assert score(base.with_genes(algorithm="b")) < -0.1  # toward fast: better
    # an agent given these effects proposes the failing value far less often than one without
    agent_plain, agent_steered = SchedulingAgent(space, 7), SchedulingAgent(space, 7)
    parents = [Parent(base, 10.0)]
    plain = [p.genome["algorithm"] for _ in range(30) for p in agent_plain.propose(parents, 3, 0)]
    steered = [p.genome["algorithm"] for _ in range(30) for p in agent_steered.propose(parents, 3, 0, effects=effects)]
    assert steered.count("c") < plain.count("c") / 2
    assert steered.count("b") > plain.count("b")


def test_learning_search_keeps_the_invariants_and_records_what_it_learned():
    search, evaluator, reports = run(seed=2, max_evaluations=40)
    bests = [r.best_latency_ms for r in reports]
    assert all(b2 <= b1 for b1, b2 in zip(bests, bests[1:]))
    asked = [e.proposal.hash for r in reports for e in r.evaluated]
    assert len(asked) == len(set(asked)) == len(evaluator.calls) == 40
    state = json.loads(json.dumps(search.state()))
    assert state["gene_effects"]["results"] == 40  # every result, failures included
    assert any(ev["failures"] for vs in state["gene_effects"]["values"].values() for ev in vs.values())
    children = sum(1 for e in search.known.values() if e.proposal.agent != "seed")
    assert sum(t for t, _ in state["agent_yields"].values()) == children > 0
    assert run(seed=2, max_evaluations=40)[1].calls == evaluator.calls  # same seed, same proposals


@pytest.mark.parametrize("wanted", [2, 4, 9, 17])
def test_offspring_split_by_yield_covers_the_generation(wanted):
    search = make_search()
    search.yields = {"fusion": [10, 8], "scheduling": [10, 0], "memory": [0, 0], "integration": [3, 1]}
    shares = search._shares(list(search.yields), wanted)
    assert sum(shares) == wanted
    if wanted >= 4:
        assert min(shares) >= 1  # every domain keeps a voice


def test_a_restored_search_has_the_same_effects_and_yields_and_asks_the_same():
    original, _, reports = run(seed=4, max_evaluations=30)
    restored = make_search(seed=4, max_evaluations=30)
    restored.rng.bit_generator.state = original.rng.bit_generator.state
    restored.team.load_state(json.loads(json.dumps(original.team.state())))
    restored.restore([e for r in reports for e in r.evaluated][::-1], original.generation)  # any order
    assert restored.effects.to_dict() == original.effects.to_dict()
    assert restored.yields == original.yields


# -- the benchmark ------------------------------------------------------------------------------
def compare_config(tmp_path):
    return config_from_dict({"workload": "kda", "preset": "cpu_small", "name": "t", "out_dir": str(tmp_path),
                             "genes": {f"backend_{s}": ["eager"] for s in ("gate", "l2norm", "intra", "recurrence",
                                                                              "output")},
                             "search": {"offspring": 6, "population": {"size": 6, "elite": 2, "tournament": 2}},
                             "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "t"}})


def test_compare_measures_each_genome_once_for_every_strategy_and_writes_its_report(tmp_path):
    config, evaluator = compare_config(tmp_path), SyntheticEvaluator()
    names = ["agents", "random", "tpe", "agents-warm"]
    results = compare(config, names, seeds=2, budget=12, bench_dir=tmp_path / "bench", evaluator=evaluator,
                      log_mlflow=True, out=open(tmp_path / "log.txt", "w"))
    for t in results["trajectories"]:
        hashes = [s["genome_hash"] for s in t["steps"]]
        assert len(hashes) == len(set(hashes)) <= 12
    union = {s["genome_hash"] for t in results["trajectories"] for s in t["steps"]}
    assert len(evaluator.calls) == len(set(evaluator.calls)) == len(union) == results["measured"]
    assert results["cache_hits"] > 0  # the warm-started runs re-propose known genomes at least
    for name in ("table.md", "best_so_far.png", "results.json"):
        assert (tmp_path / "bench" / name).stat().st_size > 0
    table = (tmp_path / "bench" / "table.md").read_text()
    assert all(f"| {n} | 2 |" in table for n in names) and "warm-started run" in table
    from mlflow.tracking import MlflowClient

    client = MlflowClient(config.mlflow.tracking_uri)
    artifacts = {a.path for a in client.list_artifacts(results["mlflow_run_id"])}
    assert {"table.md", "best_so_far.png", "results.json"} <= artifacts
    again = SyntheticEvaluator()  # a rerun into the same directory measures nothing again
    compare(config, ["agents", "random"], seeds=2, budget=12, bench_dir=tmp_path / "bench", evaluator=again,
            log_mlflow=False, out=open(tmp_path / "log2.txt", "w"))
    assert again.calls == []
