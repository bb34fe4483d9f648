"""An agent is one class: registered by name (or named by dotted path), the search asks it for children,
tells it the results, and keeps the invariants. One rule says when a child paid, for the agents' own
statistics and their yields alike. No Ray except the last two tests (the agents' actor, and the real driver,
on the in-process Ray)."""
import io
import threading
import time
from collections import Counter
from collections.abc import Mapping

import numpy as np
import pytest

from evaluators.judge.synthetic import SyntheticEvaluator
from evo.core.genome import GenomeError
from evo.core.loop import LocalExecutor, run_search
from evo.core.proposer import Feedback, ProposalRequest, improves_on_parent, proposer_class, register_proposer
from evo.core.records import OK, EvalResult, Evaluated, Proposal
from evo.core.search import Search, SearchSettings
from evo.driver.config import ConfigError, config_from_dict, load_config
from operators.registry import proposer_names
from operators.team import LocalTeam
from tests.toy_space import toy_space

DOTTED = f"{__name__}:ToyAgent"


@register_proposer
class ToyAgent:
    """A whole agent in one class, without the project's base class: each child changes one gene of a
    parent to another legal value. It keeps what it was asked, proposed and told, for the tests."""

    name = "toy"
    parents_needed = 1

    def __init__(self, gene_space, seed):
        self.gene_space, self.rng = gene_space, np.random.default_rng(seed)
        self.made: list[Proposal] = []
        self.requests: list[ProposalRequest] = []
        self.told: list[Feedback] = []

    def ask(self, request):
        self.requests.append(request)
        genes = [g for g in self.gene_space.genes if len(g.values) > 1]
        out, seen = [], set(request.known)
        for i in range(20 * request.count):
            if len(out) >= request.count or not request.parents:
                break
            parent = request.parents[i % len(request.parents)].genome
            gene = genes[int(self.rng.integers(len(genes)))]
            value = gene.values[int(self.rng.integers(len(gene.values)))]
            try:
                child = self.gene_space.validate(parent.with_genes(**{gene.name: value}))
            except GenomeError:
                continue
            if child.hash in seen:
                continue
            seen.add(child.hash)
            out.append(Proposal(child, (parent.hash,), self.name, f"{gene.name} -> {value}", request.generation,
                                move_kind=gene.name))
        self.made += out
        return out

    def tell(self, feedback):
        self.told.append(feedback)

    def state(self):
        return {"made": len(self.made)}

    def load_state(self, state):
        pass

    def close(self):
        pass

    def wait_idle(self, timeout_s):
        return True


@register_proposer
class PairAgent(ToyAgent):
    """The toy, declaring that it needs two parents (as recombination does)."""

    name = "toy-pair"
    parents_needed = 2


def search_with(agents, seed=0, **overrides):
    settings = SearchSettings(**{"seed": seed, "generations": 8, "offspring": 6, "max_evaluations": 40,
                                 "agents": tuple(agents), **overrides})
    space = toy_space()
    return Search(space, settings, LocalTeam(list(settings.agents), space, settings.seed))


@pytest.mark.parametrize("name", ["toy", DOTTED])
def test_a_toy_agent_registered_as_one_class_is_used_by_name_and_keeps_the_invariants(name):
    search, evaluator = search_with([name, "fusion"]), SyntheticEvaluator()
    reports = run_search(search, LocalExecutor(evaluator))
    toy = search.team.agents[name]
    assert isinstance(toy, ToyAgent) and toy.name == name
    recorded = [e for r in reports for e in r.evaluated]
    assert len(evaluator.calls) == len(recorded) == search.evaluations <= 40  # the budget is kept
    assert len({e.proposal.hash for e in recorded}) == len(recorded)  # no genome twice
    mine = [e for e in recorded if e.proposal.agent == name]
    assert len(mine) > 5, Counter(e.proposal.agent for e in recorded)
    made = {p.hash: p for p in toy.made}
    # every result under its name is a proposal it made, recorded once, with the move it made
    assert all(e.proposal.hash in made and e.proposal.move == made[e.proposal.hash].move for e in mine)
    # what it was asked: its own name, parents from the population, a read-only archive of what was known
    for request in toy.requests:
        assert request.agent == name and 1 <= len(request.parents) <= search.settings.parents_per_agent
        assert isinstance(request.archive, Mapping) and not hasattr(request.archive, "__setitem__")
    assert all(p.hash not in r.known for r in toy.requests for p in toy.made if p.generation == r.generation)
    # what it was told: every result of every generation once, the full EvalResult, its own among them
    told = [e for f in toy.told for e in f.results]
    assert Counter(e.proposal.hash for e in told) == Counter(e.proposal.hash for e in recorded)
    assert all(isinstance(e.result, EvalResult) for e in told)
    assert [e.proposal.hash for f in toy.told for e in f.own(name)] == [e.proposal.hash for e in mine]
    assert search.yields[name][0] == len(mine)


def test_an_agent_that_needs_two_parents_sits_out_a_generation_with_one():
    search = search_with(["toy", "toy-pair"], offspring=4)
    seeds = search.ask()
    for i, proposal in enumerate(seeds):  # one seed ok, the rest failed: the population holds one parent
        search.tell(proposal, EvalResult(proposal.hash, OK, latency_ms=5.0) if i == 0
                    else EvalResult(proposal.hash, "incorrect", message="wrong"))
    search.end_generation()
    assert len(search.population) == 1
    children = search.ask()
    assert children and {p.agent for p in children} <= {"toy", "seed"}
    assert search.team.agents["toy-pair"].requests == [] and search.team.agents["toy"].requests


def test_unknown_names_and_bad_registrations_are_clear_errors():
    with pytest.raises(ValueError, match="unknown agent 'magic'") as err:
        proposer_class("magic")
    assert all(n in str(err.value) for n in ("fusion", "scheduling", "memory", "integration", "optuna", "code", "toy"))
    with pytest.raises(ConfigError, match=r"search.agents: unknown agent 'magic'; available: \[.*'fusion'"):
        load_config(None, ["search.agents=[fusion, magic]"])
    with pytest.raises(ConfigError, match="could not load class 'Nope' from module 'tests.nowhere'"):
        config_from_dict({"search": {"agents": ["tests.nowhere:Nope"]}})
    with pytest.raises(ConfigError, match="not a Proposer class"):
        config_from_dict({"search": {"agents": [f"{__name__}:search_with"]}})
    assert config_from_dict({"search": {"agents": [DOTTED, "fusion"]}}).search.agents == (DOTTED, "fusion")
    assert proposer_class(f"{__name__}.ToyAgent") is proposer_class(DOTTED) is proposer_class("toy") is ToyAgent
    assert {"fusion", "toy", "toy-pair"} <= set(proposer_names())
    with pytest.raises(ValueError, match="'fusion' is taken by operators.fusion.FusionAgent"):
        register_proposer(type("Impostor", (ToyAgent,), {"name": "fusion"}))
    with pytest.raises(TypeError, match=r"lacks \['tell'"):
        register_proposer(type("Mute", (), {"name": "mute", "ask": lambda self, r: [], "state": dict}))


def test_the_agents_statistics_and_yields_agree_also_for_a_parentless_proposer():
    """The Optuna agent proposes parentless children: its move statistics (from the feedback) and its
    yield (which splits the offspring) count the same wins, by the one rule `improves_on_parent`."""
    search = search_with(["fusion", "scheduling", "optuna"], seed=1, max_evaluations=40)
    run_search(search, LocalExecutor(SyntheticEvaluator()))
    state = search.state()
    optuna = [e for e in search.known.values() if e.proposal.agent == "optuna"]
    assert optuna and all(not e.proposal.parents for e in optuna)
    # the rule is not "every ok result": some of its ok children did not beat the best before them
    assert 0 < sum(improves_on_parent(e, search.known) for e in optuna) < sum(e.result.ok for e in optuna)
    for agent, (tries, wins) in state["agent_yields"].items():
        stats = state["agents"][agent]["stats"].values()
        assert (sum(t for t, _ in stats), sum(w for _, w in stats)) == (tries, wins), agent


def test_improves_on_parent_compares_a_parentless_child_with_the_best_before_its_generation():
    space = toy_space()
    genomes = [space.sample(np.random.default_rng(i)) for i in range(4)]
    genomes = list({g.hash: g for g in genomes}.values())[:3]
    a, b, c = (Evaluated(Proposal(g, (), "seed" if i < 2 else "optuna", "m", generation=min(i, 1)),
                         EvalResult(g.hash, OK, latency_ms=ms)) for i, (g, ms) in enumerate(zip(genomes, (4.0, 1.0, 2.0))))
    known = {e.proposal.hash: e for e in (a, b, c)}
    assert improves_on_parent(c, known)  # 2 ms beats generation 0's best (4 ms), not b of its own generation
    assert not improves_on_parent(c, {**known, "x": Evaluated(Proposal(genomes[1], (), "seed", "m", 0),
                                                               EvalResult(genomes[1].hash, OK, latency_ms=1.0))})
    child = Evaluated(Proposal(genomes[2], (a.proposal.hash,), "fusion", "m", 2), EvalResult(genomes[2].hash, OK,
                                                                                              latency_ms=3.0))
    assert improves_on_parent(child, known)  # 3 ms beats its parent a (4 ms); the best (1 ms) does not matter
    failed = Evaluated(child.proposal, EvalResult(genomes[2].hash, "incorrect"))
    assert not improves_on_parent(failed, known)


_RELEASED = threading.Event()  # in the agents' actor process: set by ReleasingAgent's ask


class WaitingAgent(ToyAgent):
    """Its ask waits (up to a minute) for ReleasingAgent's: it says `met` only when the two ran side by side.
    It also counts the asks it is inside, to show that its own never overlap."""

    name = "waiting"

    def __init__(self, gene_space, seed):
        super().__init__(gene_space, seed)
        self.inside = self.most_inside = 0

    def ask(self, request):
        self.inside += 1
        self.most_inside = max(self.most_inside, self.inside)
        met = self.meet()
        time.sleep(0.05)
        self.inside -= 1
        return [Proposal(request.parents[0].genome, (), self.name, f"met={met} most={self.most_inside}",
                         request.generation)]

    def meet(self) -> bool:
        return _RELEASED.wait(60)


class ReleasingAgent(WaitingAgent):
    name = "releasing"

    def meet(self) -> bool:
        _RELEASED.set()
        return True


def test_the_agents_actor_runs_agents_side_by_side_and_each_ones_calls_in_order(ray_local):
    from evo.core.proposer import Archive
    from evo.core.records import Parent
    from operators.ray_team import RayTeam

    space = toy_space()
    waiting, releasing = f"{__name__}:WaitingAgent", f"{__name__}:ReleasingAgent"
    team = RayTeam([waiting, releasing], space, 3)
    try:
        parents = (Parent(space.default(), 1.0),)
        # the waiting agent is asked first, three times: with one thread for the actor its first ask would hold the
        # releasing one back, and with an actor per agent the event would be another process's
        requests = [ProposalRequest(name, 1, parents, 1, Archive()) for name in (waiting, waiting, waiting, releasing)]
        moves = [proposals[0].move for proposals in team.ask(requests)]
        assert moves == ["met=True most=1"] * 4, moves
        assert set(team.state()) == {waiting, releasing}
    finally:
        team.close()


@pytest.mark.slow
def test_the_driver_runs_an_agent_named_by_dotted_path_on_ray_actors(ray_local, tmp_path):
    from evo.driver.run import run
    from tests.run_checks import check_finished_run

    config = config_from_dict({
        "workload": "tests.fake_workload", "preset": "cpu", "name": "toy", "baselines": ["torch_cumsum"],
        "genes": {"impl": ["zeros", "loop", "cumsum", "raise_build"]},
        "search": {"seed": 3, "generations": 3, "offspring": 3, "max_evaluations": 8, "agents": [DOTTED, "fusion"],
                   "population": {"size": 3, "elite": 1, "tournament": 2}},
        "evaluators": {"count": 1, "threads": 1},
        "evaluator": {"warmup": 1, "repeats": 3, "eval_timeout_s": 60},
        "mlflow": {"enabled": False},
    })
    outcome = run(config, tmp_path / "run", out=io.StringIO())
    rows, summary = check_finished_run(outcome.run_dir, config.search.generations, config.search.max_evaluations)
    agents = Counter(row["agent"] for row in rows)
    assert agents[DOTTED] >= 1 and set(agents) <= {"seed", "fusion", DOTTED}, agents
    assert summary["evaluations"] == len(rows) <= 8
