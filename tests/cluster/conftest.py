import os
import sys

import pytest

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "router"))  # router_fakes

from cluster.ray_launcher import stop  # noqa: E402 - (grouped with the next)
from ray_helpers import LOOPBACK, NS, pid_alive, ray_pids, start_cluster  # noqa: E402 - after the path set-up
from shared_helpers import wait_until  # noqa: E402 - after the path set-up


@pytest.fixture(scope="session")
def ray_cluster():
    """One multi-node Ray cluster for every Ray test of the session (``ray.cluster_utils.Cluster``: 3 raylets on
    this machine, 1 CPU each, told apart by a custom resource ``pdtest_nodeN``); each test leaves it empty.

    Every raylet, the GCS, this driver and the actors' servers on 127.0.0.1, never the host's address:
    ``node_ip_address`` alone is not enough, Ray still resolves 127.0.0.1 to the host's "reachable" IP
    unless its loopback mode is on: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` for the processes Ray starts,
    and the constant it sets for this already-imported driver."""
    ray = pytest.importorskip("ray")
    from ray._private import ray_constants
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    c = start_cluster(dict(num_cpus=1, resources={"pdtest_node0": 1}, include_dashboard=False,
                           node_ip_address=LOOPBACK),
                      [dict(num_cpus=1, resources={f"pdtest_node{i}": 1}, node_ip_address=LOOPBACK) for i in (1, 2)])
    pids = ray_pids(c)
    try:
        ray.init(address=c.address, namespace=NS, log_to_driver=False, _node_ip_address=LOOPBACK)
        assert c.address.startswith(f"{LOOPBACK}:"), c.address
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {LOOPBACK}
        yield c
    finally:
        try:
            if ray.is_initialized():
                stop(c.address, NS, grace_s=2.0)
        finally:
            ray.shutdown()
            c.shutdown()
            mp.undo()
    wait_until(lambda: not any(pid_alive(p) for p in pids), 30, "the Ray cluster's processes to exit")


@pytest.fixture(scope="session")
def ray_model_dir(tmp_path_factory):
    """The tiny random GLM-5 model the Ray tests serve."""
    from engine.checkpoint import TINY_GLM5, init_random_model
    return init_random_model(TINY_GLM5, str(tmp_path_factory.mktemp("ray_model") / "tiny"))
