"""Search invariants with a deterministic evaluator: no Ray, no timing."""
import math

import numpy as np
import pytest

from evaluators.judge.synthetic import SyntheticEvaluator
from evo.core.genome import DOMAINS
from evo.core.loop import LocalExecutor, run_search
from evo.core.population import Population, PopulationSettings
from evo.core.records import OK, EvalResult, Evaluated, Proposal
from evo.core.search import Search, SearchSettings
from operators.team import LocalTeam
from tests.toy_space import toy_space


def make_search(seed=0, **overrides):
    settings = SearchSettings(**{"seed": seed, "generations": 6, "offspring": 6, "max_evaluations": 30, **overrides})
    space = toy_space()
    return Search(space, settings, LocalTeam(list(settings.agents), space, settings.seed))


class Recorder:
    def __init__(self):
        self.results, self.bests = [], []

    def on_result(self, evaluated):
        self.results.append(evaluated)

    def on_generation(self, report, search):
        self.bests.append(report.best_latency_ms)


def run(seed=0, **overrides):
    search, evaluator, recorder = make_search(seed, **overrides), SyntheticEvaluator(), Recorder()
    reports = run_search(search, LocalExecutor(evaluator), [recorder])
    return search, evaluator, recorder, reports


@pytest.mark.parametrize("budget", [1, 7, 30])
def test_budget_is_kept(budget):
    search, evaluator, _, _ = run(max_evaluations=budget, generations=50)
    assert len(evaluator.calls) == budget == search.evaluations


def test_generation_budget_is_kept():
    _, _, _, reports = run(generations=3, max_evaluations=1000)
    assert [r.generation for r in reports] == [0, 1, 2]


def test_best_never_gets_worse_and_is_ok():
    search, _, recorder, _ = run(generations=8, max_evaluations=60)
    assert all(b2 <= b1 for b1, b2 in zip(recorder.bests, recorder.bests[1:]))
    best = search.best()
    assert best.result.status == OK
    assert best.fitness == min(e.fitness for e in recorder.results)


def test_every_proposal_ends_in_exactly_one_result_and_none_twice():
    search, evaluator, recorder, reports = run(generations=8, max_evaluations=60)
    asked = [e.proposal.hash for r in reports for e in r.evaluated]
    assert len(asked) == len(set(asked)) == len(recorder.results) == len(evaluator.calls)
    assert set(asked) == set(search.known) and not search.pending


def test_same_seed_same_proposals_and_other_seed_differs():
    _, a, _, _ = run(seed=3)
    _, b, _, _ = run(seed=3)
    _, c, _, _ = run(seed=4)
    assert a.calls == b.calls
    assert a.calls != c.calls


def test_failures_never_become_parents_or_best():
    search, _, recorder, _ = run(generations=8, max_evaluations=60)
    failed = {e.proposal.hash for e in recorder.results if e.result.status != OK}
    assert failed, "the synthetic evaluator should produce some failures"
    parents = {h for e in recorder.results for h in e.proposal.parents}
    assert not parents & failed
    assert all(m.result.status == OK for m in search.population.members)


def test_children_change_only_their_agents_domain():
    _, _, recorder, _ = run(generations=8, max_evaluations=60)
    by_hash = {e.proposal.hash: e.proposal.genome for e in recorder.results}
    domain_of = {d: d for d in DOMAINS}  # the domain agents are named after their domain
    checked = 0
    for e in recorder.results:
        agent = e.proposal.agent
        if agent in domain_of:
            parent = by_hash[e.proposal.parents[0]]
            for domain in DOMAINS:
                same = parent.domain(domain) == e.proposal.genome.domain(domain)
                assert same == (domain != domain_of[agent]), (agent, e.proposal.move)
            assert e.proposal.move and e.proposal.move_kind
            checked += 1
        elif agent == "integration":
            assert len(e.proposal.parents) == 2
    assert checked > 5


def test_agents_learn_statistics_that_are_saved():
    search, _, _, _ = run(generations=6, max_evaluations=40)
    state = search.state()
    tries = sum(t for agent in state["agents"].values() for t, _ in agent["stats"].values())
    offspring = sum(1 for e in search.known.values() if e.proposal.agent != "seed")
    assert tries == offspring > 0


def test_tell_rejects_unknown_or_repeated():
    search = make_search()
    proposals = search.ask()
    result = EvalResult(proposals[0].hash, OK, latency_ms=1.0)
    search.tell(proposals[0], result)
    with pytest.raises(KeyError):
        search.tell(proposals[0], result)


def test_population_elitism_and_tournament():
    pop = Population(PopulationSettings(size=3, elite=1, tournament=2))
    space = toy_space()
    rng = np.random.default_rng(0)
    genomes = [space.sample(rng) for _ in range(6)]
    for i, g in enumerate(genomes):
        res = EvalResult(g.hash, OK, latency_ms=float(10 - i))
        pop.offer(Evaluated(Proposal(g, (), "seed", "s", 0), res))
    assert [m.fitness for m in pop.members] == [5.0, 6.0, 7.0]
    failed = Evaluated(Proposal(space.default(), (), "seed", "s", 0), EvalResult(space.default().hash, "incorrect"))
    assert not pop.offer(failed) and math.isinf(failed.fitness)
    parents = pop.select_parents(np.random.default_rng(1), 4)
    assert parents[0].fitness == 5.0 and all(p in pop.members for p in parents)


def test_random_seeds_zero_starts_the_agents_from_the_default_genome_alone():
    search, _, recorder, reports = run(generations=3, max_evaluations=40, random_seeds=0)
    first = [e for e in recorder.results if e.proposal.generation == 0]
    assert [e.proposal.move for e in first] == ["default genome"]
    children = [e for e in recorder.results if e.proposal.generation == 1 and e.proposal.agent != "seed"]
    assert children and all(e.proposal.parents == (first[0].proposal.hash,) for e in children)  # from it alone
    assert len(reports) == 3
    _, _, recorder, _ = run(generations=1, max_evaluations=40, random_seeds=2)
    assert sorted(e.proposal.move for e in recorder.results) == ["default genome", "random genome", "random genome"]
    with pytest.raises(ValueError, match="random_seeds"):
        make_search(0, random_seeds=-1)


def test_seed_genes_restrict_random_seeds_but_not_agents():
    eager_only = {f"backend_{s}": ["eager"] for s in ("prep", "solve", "out")}
    search, _, recorder, _ = run(generations=8, max_evaluations=60, seed_genes=eager_only)
    seeds = [e for e in recorder.results if e.proposal.agent == "seed"]
    assert len(seeds) >= 6
    assert all(v == "eager" for e in seeds for k, v in e.proposal.genome.domain("fusion").items() if k.startswith("backend"))
    explored = {v for e in recorder.results for k, v in e.proposal.genome.domain("fusion").items() if k.startswith("backend")}
    assert "compile" in explored, "the fusion agent should still try other backends"
