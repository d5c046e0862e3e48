"""The placement planner (pure: no Ray): spread / pack, TP bundles on one node, clear errors."""
import pytest

from cluster.ray_launcher import RayLaunchConfig
from cluster.ray_placement import PlacementError, actor_resources, demands_for, plan_placement
from router.config import RouterConfig


def nodes(*cpus, gpus=None):
    return {f"node{i}": {"CPU": float(c), **({"GPU": float(gpus[i])} if gpus else {})} for i, c in enumerate(cpus)}


def test_spread_puts_prefill_and_decode_on_distinct_nodes():
    demands = demands_for(["prefill-0", "prefill-1"], {"CPU": 1}, 1) + demands_for(["decode-0"], {"CPU": 1}, 1)
    plan = plan_placement(demands, nodes(4, 4, 4), "spread")
    assert sorted(plan.values()) == ["node0", "node1", "node2"]


def test_spread_counts_workers_already_running():
    plan = plan_placement(demands_for(["decode-1"], {"CPU": 1}, 1), nodes(4, 4, 4), "spread",
                          existing={"node0": 1, "node1": 0, "node2": 1})
    assert plan == {"decode-1": "node1"}


def test_pack_fills_one_node_before_the_next():
    demands = demands_for([f"prefill-{i}" for i in range(3)], {"CPU": 2}, 1)
    plan = plan_placement(demands, nodes(4, 8, 2), "pack")
    assert list(plan.values()) == ["node1", "node1", "node1"]
    plan = plan_placement(demands_for([f"p-{i}" for i in range(5)], {"CPU": 2}, 1), nodes(4, 8, 2), "pack")
    assert list(plan.values()) == ["node1"] * 4 + ["node0"]


def test_tp_bundles_need_one_node_with_room_for_all_ranks():
    d = demands_for(["decode-0"], {"CPU": 1, "GPU": 1}, 4)
    assert d[0].bundles == [{"CPU": 1.0, "GPU": 1.0}] * 4
    assert plan_placement(d, nodes(8, 8, gpus=[2, 4]), "spread") == {"decode-0": "node1"}
    with pytest.raises(PlacementError, match=r"enough in total .* no node has \{CPU: 4, GPU: 4\} free for decode-0"):
        plan_placement(d, nodes(8, 8, gpus=[2, 2]), "spread")


def test_missing_resources_are_named():
    d = demands_for(["prefill-0", "decode-0"], {"CPU": 1, "GPU": 1}, 1)
    with pytest.raises(PlacementError, match=r"missing GPU 1 \(need 2, free 1, cluster total 1\)"):
        plan_placement(d, nodes(4, 4, gpus=[1, 0]), "spread")
    with pytest.raises(PlacementError, match=r"missing CPU 1 \(need 3, free 2"):
        plan_placement(demands_for(["a", "b", "c"], {"CPU": 1}, 1), nodes(1, 1), "pack")


def test_actor_resources_and_config_validation():
    assert actor_resources({"CPU": 2.0, "GPU": 1.0, "node_a": 0.5}) == {"num_cpus": 2.0, "num_gpus": 1.0,
                                                                        "resources": {"node_a": 0.5}}
    assert RayLaunchConfig(resources_per_worker='{"CPU": 4, "GPU": 1}').bundle == {"CPU": 4.0, "GPU": 1.0}
    for bad in ('{"CPU": -1}', "[1]", "{}", "CPU=1"):
        with pytest.raises(ValueError, match="resources_per_worker"):
            RayLaunchConfig(resources_per_worker=bad)
    with pytest.raises(ValueError, match="placement"):
        RayLaunchConfig(placement="strict")
    with pytest.raises(ValueError, match="at least one decode worker"):
        RayLaunchConfig(decode=0)
    assert RayLaunchConfig(prefill=0).aggregated  # the decode workers prefill their own prompts
    with pytest.raises(ValueError, match="without a secret"):
        RayLaunchConfig(router=RouterConfig(host="0.0.0.0"))
    assert RayLaunchConfig(router=RouterConfig(host="0.0.0.0"), api_key="k").router.host == "0.0.0.0"
