"""Evaluator placement planned from a snapshot of the cluster's nodes (no Ray needed)."""
import pytest

from evaluators.pool.placement import NodeView, PlacementError, SlotPlan, initial_plan, placement_kind, plan_slots


def node(name, cpus=8, gpus=0, types=(), cores=None, driver=False):
    return NodeView(name, cpus, gpus, tuple(types), cores, driver)


def test_from_ray_reads_resources_and_accelerator_types():
    entry = {"NodeID": "n1", "Alive": True,
             "Resources": {"CPU": 16.0, "GPU": 8.0, "accelerator_type:H200": 1.0, "memory": 1e9}}
    view = NodeView.from_ray(entry, driver_node_id="n1", driver_cores=12)
    assert view == NodeView("n1", 16, 8, ("H200",), 12, True)
    assert NodeView.from_ray(entry, "other", 12).cores is None


def test_one_evaluator_per_gpu_on_every_node_driver_first():
    nodes = [node("b", gpus=2), node("a", gpus=1), node("head", gpus=0, driver=True)]
    plans, accelerator = initial_plan(nodes, "gpu", 1, 0, None, "h200")
    assert plans == [SlotPlan("a", 0), SlotPlan("b", 0), SlotPlan("b", 1)]
    assert accelerator == "unknown"


def test_a_gpu_run_targets_one_accelerator_type():
    nodes = [node("a", gpus=2, types=["A100"]), node("b", gpus=4, types=["H200"]), node("c", gpus=4, types=["H200"])]
    plans, accelerator = initial_plan(nodes, "gpu", 1, 0, None, "h200")
    assert accelerator == "H200" and {p.node_id for p in plans} == {"b", "c"} and len(plans) == 8
    plans, accelerator = initial_plan(nodes, "gpu", 1, 0, "A100", "h200")
    assert accelerator == "A100" and [p.node_id for p in plans] == ["a", "a"]
    with pytest.raises(PlacementError, match=r"no GPU node has accelerator_type:B200.*\['A100', 'H200'\]"):
        initial_plan(nodes, "gpu", 1, 0, "B200", "h200")


def test_cpu_evaluators_own_disjoint_cores_per_node():
    nodes = [node("w", cpus=4), node("head", cpus=8, cores=3, driver=True)]
    plans, _ = initial_plan(nodes, "cpu", 2, 0, None, "cpu")
    assert plans == [SlotPlan("head", 0), SlotPlan("w", 0), SlotPlan("w", 1)]  # head: 3 usable cores -> 1
    assert [p.cores(2) for p in plans] == [(0, 1), (0, 1), (2, 3)]


def test_unplaceable_evaluators_name_the_missing_resource():
    with pytest.raises(PlacementError, match="needs GPUs but the Ray cluster has none"):
        initial_plan([node("a")], "gpu", 1, 0, None, "h200")
    with pytest.raises(PlacementError, match="needs 4 CPU"):
        initial_plan([node("a", cpus=2)], "cpu", 4, 0, None, "cpu")
    with pytest.raises(PlacementError, match="need 6 CPUs; only 4 available"):
        initial_plan([node("a", cpus=4)], "cpu", 1, 6, None, "cpu")
    with pytest.raises(PlacementError, match="need 3 GPUs; only 2 available"):
        initial_plan([node("a", gpus=2)], "gpu", 1, 3, None, "h200")
    with pytest.raises(PlacementError, match="threads must be >= 1"):
        initial_plan([node("a")], "cpu", 0, 0, None, "cpu")


def test_count_caps_the_evaluators():
    plans, _ = initial_plan([node("a", gpus=4), node("b", gpus=4)], "gpu", 1, 3, None, "h200")
    assert len(plans) == 3


def test_new_nodes_fill_free_positions_only():
    nodes = [node("a", gpus=2), node("b", gpus=1)]
    taken = {("a", 0), ("a", 1)}
    assert plan_slots(nodes, "gpu", 1, "unknown", taken, None) == [SlotPlan("b", 0)]
    assert plan_slots(nodes, "gpu", 1, "unknown", taken, 0) == []
    assert plan_slots(nodes, "gpu", 1, "unknown", {("a", 0), ("a", 1), ("b", 0)}, None) == []


def test_placement_kind_follows_the_preset_and_refuses_cuda_on_cpu():
    assert placement_kind("auto", "h200", "cuda") == "gpu"
    assert placement_kind("auto", "cpu", "cpu") == "cpu"
    assert placement_kind("gpu", "cpu", "cpu") == "gpu"
    with pytest.raises(PlacementError, match="runs on cuda"):
        placement_kind("cpu", "h200", "cuda")
    with pytest.raises(PlacementError, match="not one of"):
        placement_kind("tpu", "cpu", "cpu")
