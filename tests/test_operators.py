"""Agents: legal children in their own domain only, learning biases proposals, state round-trips."""
from collections import Counter

import numpy as np

from evo.core.genome import DOMAINS
from operators.base import Outcome, Parent
from operators.fusion import FusionAgent
from operators.integration import IntegrationAgent
from operators.scheduling import SchedulingAgent
from tests.toy_space import toy_space


def parents(n=3, seed=0):
    space = toy_space()
    rng = np.random.default_rng(seed)
    return [Parent(space.sample(rng), float(i + 1)) for i in range(n)]


def test_fusion_moves_are_legal_and_keep_groups_on_one_backend():
    space = toy_space()
    agent = FusionAgent(space, seed=1)
    proposals = agent.propose(parents(4), 30, generation=1)
    assert len(proposals) >= 10
    for p in proposals:
        assert space.is_legal(p.genome)
        parent = next(q.genome for q in parents(4) if q.genome.hash == p.parents[0])
        assert parent.domain("scheduling") == p.genome.domain("scheduling")
        assert parent.domain("memory") == p.genome.domain("memory")
        genes = p.genome.domain("fusion")
        for group in agent.groups(genes):
            assert len({genes[f"backend_{s}"] for s in group}) == 1
        assert p.move_kind in {"fuse", "split", "backend"} and p.move


def test_learning_biases_move_choice():
    space = toy_space()
    biased, fresh = SchedulingAgent(space, seed=5), SchedulingAgent(space, seed=5)
    biased.learn([Outcome("algorithm", True)] * 30 + [Outcome("chunk_size", False)] * 30)
    parent = parents(1)[0].genome
    kinds = lambda agent: Counter(agent._draw_move(parent).kind for _ in range(200))
    assert kinds(biased)["algorithm"] > 150 > 80 > kinds(fresh)["algorithm"]
    assert kinds(biased)["chunk_size"] < kinds(fresh)["chunk_size"]
    assert biased.win_rates()["algorithm"] == 1.0 and biased.win_rates()["chunk_size"] == 0.0


def test_state_round_trip_gives_same_proposals():
    space = toy_space()
    agent = SchedulingAgent(space, seed=9)
    agent.learn([Outcome("layout", True)])
    agent.propose(parents(), 3, 0)
    saved = agent.state()
    first = [p.hash for p in agent.propose(parents(), 5, 1)]
    restored = SchedulingAgent(space, seed=0)
    restored.load_state(saved)
    assert [p.hash for p in restored.propose(parents(), 5, 1)] == first


def test_integration_takes_whole_domains_from_two_parents():
    space = toy_space()
    ps = parents(3, seed=4)
    proposals = IntegrationAgent(space, seed=2).propose(ps, 4, 1)
    assert proposals
    by_hash = {p.genome.hash: p.genome for p in ps}
    for child in proposals:
        a, b = (by_hash[h] for h in child.parents)
        assert a.hash != b.hash and space.is_legal(child.genome)
        for domain in DOMAINS:
            assert child.genome.domain(domain) in (a.domain(domain), b.domain(domain))
        assert child.genome.hash not in by_hash


def test_agents_skip_genomes_the_search_already_knows():
    space = toy_space()
    for cls in (FusionAgent, SchedulingAgent, IntegrationAgent):
        first = cls(space, seed=3).propose(parents(3), 4, 1)
        known = frozenset(p.hash for p in first)
        second = cls(space, seed=3).propose(parents(3), 4, 1, exclude=known)
        assert first and second and not known & {p.hash for p in second}


def test_fusion_agent_works_on_a_space_without_stage_genes():
    from evo.core.genome import Gene, GeneSpace

    space = GeneSpace("plain", (Gene("impl", "fusion", ("a", "b", "c"), "a", "x"),
                                Gene("size", "scheduling", (1, 2), 1, "y")))
    proposals = FusionAgent(space, seed=0).propose([Parent(space.default(), 1.0)], 2, 1)
    assert {p.genome["impl"] for p in proposals} == {"b", "c"}
    assert all(p.genome["size"] == 1 for p in proposals)


def test_levers_sweep_the_named_genes_one_value_at_a_time_lossy_first_from_the_best():
    from evaluators.machine import device as devices
    from evo.workloads import get_workload
    from operators.levers import LeverSweepAgent
    from operators.registry import proposer_class

    assert proposer_class("levers") is LeverSweepAgent  # a config's search.agents names it
    workload = get_workload("llama_serve")
    budget = workload.gene_space(workload.presets()["cpu"], devices.device_info("cpu", 1))
    default = budget.default()
    worse = budget.make({**default.values(), "max_running": 1})
    agent = LeverSweepAgent(budget, seed=0)
    proposals = agent.propose([Parent(worse, 9.0), Parent(default, 1.0)], 4, generation=1)
    assert [p.parents for p in proposals] == [(default.hash,)] * 4  # from the best parent
    for p in proposals:  # one lever changed, or with the levers its value needs, which the move says
        changed = {k for k, v in p.genome.values().items() if v != default.values()[k]}
        extra = changed - {p.move_kind}
        assert p.move_kind in changed and changed <= set(budget.levers) and budget.is_legal(p.genome)
        assert ("(with " in p.move) == bool(extra), p.move
        assert all(f"{k}: {default.values()[k]} -> {p.genome.values()[k]}" in p.move for k in extra), p.move
    kernel = budget.gene("linear_kernel")
    assert [p.genome.values()["linear_kernel"] for p in proposals] == list(kernel.lossy)
    assert proposals[-1].genome.values()["decode_step"] == "native"  # q8_weights needs the C step: set with it
    everything = LeverSweepAgent(budget, seed=0).propose([Parent(default, 1.0)], 100, generation=1)
    amx = [p for p in everything if p.genome.values()["native_products"] == "amx"]
    if "amx" in budget.gene("native_products").values:  # a CPU with AMX: reached in one move, with both it needs
        assert len(amx) == 1 and amx[0].move_kind == "native_products"
        assert {k: amx[0].genome.values()[k] for k in ("decode_step", "linear_kernel")} == {
            "decode_step": "native", "linear_kernel": "bf16_weights"}
    else:
        assert not amx
    assert all(budget.is_legal(p.genome) for p in everything)
    native = budget.make({"decode_step": "native"})
    swept = LeverSweepAgent(budget, seed=0).propose([Parent(native, 1.0)], 2, generation=1)
    assert [p.genome.values()["linear_kernel"] for p in swept] == ["bf16_weights", "q8_weights"]  # the C step's
    # what the search knows is skipped: the sweep goes on with the next values
    more = agent.propose([Parent(default, 1.0)], 3, 2, exclude=frozenset(p.hash for p in proposals))
    assert not {p.hash for p in more} & {p.hash for p in proposals} and len(more) == 3
    # an exact run's space holds no lossy value, so neither does the sweep
    exact = budget.exact_only()
    swept = LeverSweepAgent(exact, seed=0).propose([Parent(exact.default(), 1.0)], 50, 1)
    assert swept and all(not exact.lossy_values(p.genome.values()) for p in swept)
    assert not budget.lossy_values(default.values())


def test_a_gene_space_naming_an_undeclared_lever_is_refused():
    import dataclasses

    import pytest

    space = toy_space()
    with pytest.raises(ValueError, match="levers \\['no_such_gene'\\]"):
        dataclasses.replace(space, levers=("no_such_gene",))


def test_levers_move_on_past_values_the_evidence_measured_slower():
    from evaluators.machine import device as devices
    from evo.core.effects import GeneEffects
    from evo.workloads import get_workload
    from operators.levers import LeverSweepAgent

    workload = get_workload("llama_serve")
    space = workload.gene_space(workload.presets()["cpu"], devices.device_info("cpu", 1))
    best = space.make({**space.default().values(), "linear_kernel": "bf16_weights"})
    effects = GeneEffects()
    rng = np.random.default_rng(0)
    for kernel, ms in (("bf16_weights", 10.0), ("fp16_weights", 16.0), ("torch", 16.0)):
        for _ in range(3):
            effects.add(space.make({**best.values(), "linear_kernel": kernel,
                                    "max_running": int(rng.choice([8, 16]))}), "ok", ms * rng.uniform(0.95, 1.05))
    effects.add(space.make({**best.values(), "linear_kernel": "packed", "max_running": 8}), "incorrect", float("nan"),
                "the accuracy budget")
    effects.add(space.make({**best.values(), "linear_kernel": "int8_dynamic", "max_running": 8}), "incorrect",
                float("nan"), "the accuracy budget")
    first = LeverSweepAgent(space, seed=0).propose([Parent(best, 10.0)], 2, 1, effects=effects)
    # linear_kernel's others were slower or failed, but for q8_weights (with the C step it needs), never tried
    assert [p.move_kind for p in first] == ["linear_kernel", "decode_step"]
    assert first[0].genome["linear_kernel"] == "q8_weights" and first[0].genome["decode_step"] == "native"
    assert first[1].genome["decode_step"] == "native"  # traced cannot hold bf16_weights; native_max_rows: ignored
    plain = LeverSweepAgent(space, seed=0).propose([Parent(best, 10.0)], 2, 1)
    assert [p.move_kind for p in plain] == ["linear_kernel"] * 2  # without evidence: the lever order


def test_a_result_reaches_the_agents_without_importing_torch():
    """Every result a generation tells the agents (Ray actors, which import no torch) carries the evaluator's
    version stamp; a `torch.__version__` object in it would import torch in each agent's process on unpickling
    (seconds of start-up per agent, per run)."""
    import pickle
    import subprocess
    import sys

    from evaluators.machine.device import versions
    from evo.core.records import EvalResult

    stamp = versions("cpu")
    assert all(type(v) is str for v in stamp.values()), stamp
    data = pickle.dumps(EvalResult("h" * 64, "ok", latency_ms=1.0, versions=stamp))
    probe = "import pickle, sys; pickle.loads(sys.stdin.buffer.read()); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], input=data, capture_output=True, check=True).stdout
    assert out.strip() == b"False"
