"""Evaluators on a simulated 3-node cluster (`ray.cluster_utils.Cluster`, logical GPUs): one per GPU
with distinct (node, GPU) pairs, nodes leaving mid-search lose no candidate, nodes joining add
evaluators, and a whole search keeps the invariants of a single-node run.

The evaluators are placed one per logical GPU (`evaluators.placement: gpu`) and compute the fake
workload on the CPU, since there is no real GPU here.
"""
import io
import threading
import time

import pytest
import ray
from mlflow.tracking import MlflowClient
from ray.cluster_utils import Cluster

from evaluators.pool.actors import EvaluatorPool, PlacementError, PoolSettings
from evaluators.settings import EvaluatorSettings
from evo.driver.config import config_from_dict
from evo.core.records import OK, Proposal
from evo.driver.run import run
from evo.workloads.base import DeviceInfo
from tests import fake_workload
from tests.conftest import start_local_ray
from tests.run_checks import check_finished_run, journal
from tests.waiting import wait_for

PRESET = fake_workload.WORKLOAD.presets()["cpu"]
SETTINGS = EvaluatorSettings(warmup=1, repeats=3, eval_timeout_s=60.0)


@pytest.fixture(scope="module")
def cluster():
    """Head with 1 GPU, a node with 2 GPUs, a node with 1 GPU (the one tests remove)."""
    was_local = ray.is_initialized()
    if was_local:
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=2, num_gpus=2)
    cluster.spare_nodes = [cluster.add_node(num_cpus=1, num_gpus=1)]  # the nodes tests may take away
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    if was_local:
        start_local_ray()


def add_spare_node(cluster):
    node = cluster.add_node(num_cpus=1, num_gpus=1)
    cluster.spare_nodes.append(node)
    cluster.wait_for_nodes()
    return node


def proposals(impls, threads=(0, 1, 2), pads=(False, True)):
    space = fake_workload.WORKLOAD.gene_space(PRESET, DeviceInfo("cpu", "cpu"))
    genomes = [space.make({"impl": impl, "threads": t, "pad": p}) for impl in impls for t in threads for p in pads]
    return [Proposal(g, (), "seed", g.hash, 0, index=i) for i, g in enumerate(genomes)]


def test_one_evaluator_per_gpu_each_on_its_own_node_and_gpu(cluster):
    pool = EvaluatorPool("tests.fake_workload", PRESET, SETTINGS, run_seed=0, pool=PoolSettings(placement="gpu"))
    try:
        infos = pool.describe()
        assert len(infos) == 4 == int(ray.cluster_resources()["GPU"])
        assert len({info["node_id"] for info in infos}) == 3
        pairs = {(info["node_id"], tuple(info["gpu_ids"])) for info in infos}
        assert len(pairs) == 4 and all(len(gpus) == 1 for _, gpus in pairs)
        for info in infos:
            assert info["cuda_visible_devices"] == info["gpu_ids"][0]
        two_gpu_node = [info for info in infos if sum(i["node_id"] == info["node_id"] for i in infos) == 2]
        assert sorted(info["gpu_ids"][0] for info in two_gpu_node) == ["0", "1"]
        assert pool.accelerator == "unknown" and pool.device_type.startswith("cpu:")
    finally:
        pool.close()


def test_cpu_evaluators_fill_every_node_each_with_its_own_cores(cluster):
    pool = EvaluatorPool("tests.fake_workload", PRESET, SETTINGS, run_seed=0,
                         pool=PoolSettings(placement="cpu", threads=1))
    try:
        infos = pool.describe()
        cpus = {n["NodeID"]: int(n["Resources"]["CPU"]) for n in ray.nodes() if n["Alive"]}
        by_node = {}
        for info in infos:
            by_node.setdefault(info["node_id"], []).append(tuple(info["cores"]))
        assert {node: len(cores) for node, cores in by_node.items()} == cpus  # 1 thread each: one per CPU
        for cores in by_node.values():  # within a node no two share a core
            assert len(set(cores)) == len(cores) and all(len(c) == 1 for c in cores)
        assert all(info["gpu_ids"] == [] for info in infos)
    finally:
        pool.close()


def test_a_node_leaving_loses_no_candidate_and_a_node_joining_adds_evaluators(cluster):
    events = []
    pool = EvaluatorPool("tests.fake_workload", PRESET, SETTINGS, run_seed=0, pool=PoolSettings(placement="gpu"),
                         on_event=events.append, watch_interval_s=0.5)
    try:
        batch = proposals(["slow"])
        leaving = cluster.spare_nodes.pop()
        # One second in, every evaluator is inside a 2 s build: take one node away.
        threading.Timer(1.0, cluster.remove_node, [leaving]).start()
        results = list(pool.run(batch))
        assert sorted(p.hash for p, _ in results) == sorted(p.hash for p in batch), "lost or doubled candidates"
        assert [r.status for _, r in results] == [OK] * len(batch)
        assert pool.requeued >= 1
        assert any("left the cluster" in e for e in events)
        assert len(pool.describe()) == 3 and leaving.node_id not in {i["node_id"] for i in pool.describe()}, events

        joined = add_spare_node(cluster)
        more = {p.hash: r for p, r in pool.run(proposals(["cumsum", "loop"]) + proposals(["slow"], threads=(1, 2)))}
        assert len(more) == 16 and all(r.status == OK for r in more.values()), \
            {h: (r.status, r.message[:300]) for h, r in more.items() if r.status != OK}
        on_new_node = [i["name"] for i in pool.describe() if i["node_id"] == joined.node_id]
        assert len(pool.describe()) == 4 and len(on_new_node) == 1, (joined.node_id, pool.describe(), events)
        # it may be admitted while that batch finishes without it: more work until it takes some (2 s builds
        # keep every evaluator busy, so a free new one is given the next candidate)
        worked = any(r.evaluator == on_new_node[0] for r in more.values())
        deadline = time.monotonic() + 180
        while not worked and time.monotonic() < deadline:
            extra = [r for _, r in pool.run(proposals(["slow"]))]
            assert all(r.status == OK for r in extra), [r.status for r in extra]
            worked = any(r.evaluator == on_new_node[0] for r in extra)
        assert worked, "the new evaluator never worked"
    finally:
        pool.close()


def test_a_search_on_the_cluster_keeps_the_single_node_invariants_while_nodes_come_and_go(cluster, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = config_from_dict({
        "workload": "tests.fake_workload", "preset": "cpu", "name": "cluster", "baselines": ["torch_cumsum"],
        "genes": {"impl": ["slow", "cumsum", "loop", "zeros"]},  # 24 genomes: the budget takes all 6 slow ones
        "search": {"seed": 5, "generations": 4, "offspring": 6, "max_evaluations": 24,
                   "population": {"size": 4, "elite": 1, "tournament": 2}},
        "evaluators": {"placement": "gpu"},
        "evaluator": {"warmup": 1, "repeats": 3, "eval_timeout_s": 60},
        "mlflow": {"tracking_uri": uri, "experiment": "cluster"},
    })
    run_dir = tmp_path / "run"
    log, outcome = io.StringIO(), []
    search = threading.Thread(target=lambda: outcome.append(run(config, run_dir, out=log)), daemon=True)
    search.start()  # nodes are added and removed from the main thread (Ray's node objects need it)
    wait_for(lambda: journal(run_dir), 120, "the search's first result",
             (OSError, ValueError))  # not written yet; a journal line half written
    cluster.remove_node(cluster.spare_nodes.pop())
    wait_for(lambda: "left the cluster" in log.getvalue() or outcome, 60, "the pool to see the node leave")
    add_spare_node(cluster)
    search.join(timeout=300)
    assert outcome, log.getvalue()[-3000:]
    rows, summary = check_finished_run(run_dir, config.search.generations, config.search.max_evaluations)
    assert len(rows) == config.search.max_evaluations
    assert "left the cluster" in log.getvalue() and "starting on node" in log.getvalue()
    assert len({row["evaluator"] for row in rows}) >= 3  # the head's and the 2-GPU node's at least
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(outcome[0].mlflow_run_id).info.status == "FINISHED"



def test_a_run_of_one_accelerator_type_uses_only_its_nodes_and_says_so_when_they_all_leave(cluster):
    t4 = cluster.add_node(num_cpus=1, num_gpus=1, resources={"accelerator_type:T4": 1})
    cluster.wait_for_nodes()
    pool = EvaluatorPool("tests.fake_workload", PRESET, SETTINGS, run_seed=0,
                         pool=PoolSettings(placement="gpu", accelerator_type="T4"), node_wait_s=3)
    try:
        assert [info["node_id"] for info in pool.describe()] == [t4.node_id] and pool.accelerator == "T4"
        threading.Timer(1.0, cluster.remove_node, [t4]).start()
        with pytest.raises(PlacementError, match="no evaluator could take work for 3 s"):
            list(pool.run(proposals(["slow"])))
    finally:
        pool.close()
