"""``pdserve launch`` on a real multi-node Ray cluster (``conftest.ray_cluster``: 3 raylets on this machine,
1 CPU each, told apart by a custom resource) serving a tiny random GLM-5 model.

One Ray cluster for the session, one deployment for the module (startup dominates on a loaded machine); the
tests run in file order: refusals first (nothing may be left behind), then launch + serve + placement, a killed
worker actor, scaling, and stop last.
"""
import os
import signal
import subprocess
import time

import grpc
import pytest

ray = pytest.importorskip("ray")

from cli import main as cli  # noqa: E402
from cluster.ray_launcher import LaunchError, RayLaunchConfig, actor_names, launch, status, stop  # noqa: E402
from cluster.ray_placement import PlacementError, group_nodes, list_groups  # noqa: E402
from cluster.ray_scale import scale  # noqa: E402
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402
from ray_helpers import LOOPBACK, NS, pid_alive  # noqa: E402
from shared_helpers import wait_until  # noqa: E402
from router.client import GenerationClient  # noqa: E402
from router.config import RouterConfig  # noqa: E402

pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def node_names(ray_cluster):
    """node id -> "node0" / "node1" / "node2" (from the custom resource each node was given)."""
    out = {}
    for n in ray.nodes():
        tags = [k for k in n["Resources"] if k.startswith("pdtest_node")]
        if n["Alive"] and tags:
            out[n["NodeID"]] = tags[0].removeprefix("pdtest_")
    return out


@pytest.fixture(scope="module")
def model_dir(ray_model_dir):
    return ray_model_dir


API_KEY = "ray-key-0123456789"


def cfg(ray_cluster, model_dir, tmp_path_factory, **kw) -> RayLaunchConfig:
    base = dict(address=ray_cluster.address, namespace=NS, model=model_dir, prefill=2, decode=1,
                router=RouterConfig(port=0, http_port=0, routing="round_robin"), speculative="off", num_pages=64,
                threads_per_worker=1, startup_timeout_s=240, placement_timeout_s=20, max_restarts=3,
                log_dir=str(tmp_path_factory.getbasetemp() / "raylogs"))
    return RayLaunchConfig(**{**base, **kw})


def assert_nothing_left():
    assert actor_names(NS) == [] and list_groups(NS) == {}


@pytest.fixture(scope="module")
def deployment(ray_cluster, model_dir, tmp_path_factory):
    t0 = time.monotonic()
    st = launch(cfg(ray_cluster, model_dir, tmp_path_factory, api_key=API_KEY))
    print(f"launch took {time.monotonic() - t0:.1f}s")
    yield st
    stop(ray_cluster.address, NS, grace_s=2.0)  # (test_stop did, unless it did not run): the session's cluster empty


# -- refusals: fast, clear, nothing left behind ------------------------------------------------------
def test_impossible_resources_fail_fast_with_what_is_missing(ray_cluster, model_dir, tmp_path_factory):
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match=r"missing GPU 3 \(need 3, free 0, cluster total 0\)"):
        launch(cfg(ray_cluster, model_dir, tmp_path_factory, resources_per_worker='{"CPU": 1, "GPU": 1}'))
    with pytest.raises(PlacementError, match=r"missing CPU 1 \(need 4, free 3, cluster total 3\)"):
        launch(cfg(ray_cluster, model_dir, tmp_path_factory, prefill=3))
    with pytest.raises(PlacementError, match=r"no node has \{CPU: 2\} free for prefill-0 .*must share one node"):
        launch(cfg(ray_cluster, model_dir, tmp_path_factory, prefill=1, prefill_tp=2))
    assert time.monotonic() - t0 < 30
    assert_nothing_left()


def test_a_group_that_is_never_placed_is_removed_and_reported(ray_cluster):
    from cluster.ray_placement import create_groups, demands_for
    node = ray.get_runtime_context().get_node_id()
    d = demands_for(["prefill-0"], {"CPU": 1, "pdtest_missing": 1}, 1)  # the planner was bypassed
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match=r"not placed within 1s \(removed\): prefill-0 \{CPU: 1, pdtest_missing"):
        create_groups(d, {"prefill-0": node}, NS, timeout_s=1.0)
    assert time.monotonic() - t0 < 10
    wait_until(lambda: list_groups(NS) == {}, 10, "the group to be removed")


def test_cli_reports_a_placement_error(ray_cluster, model_dir, capsys):
    rc = cli.main(["launch", "--address", ray_cluster.address, "--namespace", NS, "--model", model_dir,
                   "--resources-per-worker", '{"CPU": 1, "tpu_v9": 2}', "--prefill", "1", "--decode", "1"])
    assert rc == 1
    assert "pdserve: error: cannot place 2 worker(s)" in capsys.readouterr().err
    assert_nothing_left()


# -- launch, serve, placement ------------------------------------------------------------------------
def test_launch_serves_end_to_end(deployment):
    assert deployment.router_address and not deployment.errors
    assert sorted(w["name"] for w in deployment.workers) == ["decode-0", "prefill-0", "prefill-1"]
    with GenerationClient(deployment.router_address, API_KEY, timeout_s=60) as c:
        outs = [c.generate(token_ids=[5, 6, 7, 8, 9], max_tokens=6, ignore_eos=True) for _ in range(2)]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in outs)
    assert outs[0].token_ids == outs[1].token_ids  # greedy, through two different prefill workers
    assert {o.metrics.prefill_worker for o in outs} == {"prefill-0", "prefill-1"}
    assert {o.metrics.decode_worker for o in outs} == {"decode-0"} and outs[0].metrics.kv_transfer_bytes > 0
    with GenerationClient(deployment.router_address, timeout_s=60) as c:  # no key
        with pytest.raises(grpc.RpcError) as e:
            c.generate(token_ids=[5, 6], max_tokens=2)
    assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
    with open(f"/proc/{deployment.router['pid']}/cmdline", "rb") as f:  # issue 25: not in argv (ps)
        assert API_KEY.encode() not in f.read()


def test_placement_spreads_workers_and_pins_the_router(deployment, node_names):
    groups = list_groups(NS)
    assert set(groups) == {"prefill-0", "prefill-1", "decode-0"}
    for w in deployment.workers:
        g = groups[w["name"]]
        assert g["strategy"] == "STRICT_PACK" and group_nodes(g) == [w["node_id"]]
    assert sorted(node_names[w["node_id"]] for w in deployment.workers) == ["node0", "node1", "node2"]
    assert deployment.router["node_id"] == ray.get_runtime_context().get_node_id()  # the launching node


def test_internal_plane_binds_the_node_ip_and_needs_the_secret(deployment):
    w = next(w for w in deployment.workers if w["role"] == "prefill")
    assert w["address"].rpartition(":")[0] == w["node_ip"] == LOOPBACK
    with grpc.insecure_channel(w["address"]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            worker_pb2_grpc.PrefillWorkerStub(ch).GetStatus(worker_pb2.StatusRequest(), timeout=10)
    assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED


def test_status_cli(deployment, ray_cluster, capsys):
    assert cli.main(["status", "--address", ray_cluster.address, "--namespace", NS]) == 0
    out = capsys.readouterr().out
    assert deployment.router_address in out and all(w["address"] in out for w in deployment.workers)


# -- supervision -------------------------------------------------------------------------------------
def test_killed_worker_actor_is_restarted_and_serves_again(deployment, ray_cluster):
    old = next(w for w in deployment.workers if w["name"] == "prefill-0")
    ray.kill(ray.get_actor("prefill-0", namespace=NS), no_restart=False)
    with GenerationClient(deployment.router_address, API_KEY, timeout_s=60) as c:
        # meanwhile prefill-1 serves (the router takes the dead worker out of rotation)
        assert c.generate(token_ids=[1, 2, 3], max_tokens=3, ignore_eos=True).finish_reason == "length"
        wait_until(lambda: not pid_alive(old["pid"]), 30, "the killed actor's server to exit")

        def restarted():
            w = {w["name"]: w for w in status(ray_cluster.address, NS).workers}.get("prefill-0")
            return w if w and w["restarted"] and w["address"] != old["address"] else None
        new = wait_until(restarted, 180, "prefill-0 restarted", interval_s=1.0)
        assert new["node_id"] == old["node_id"]  # restarted in its placement group

        def served_by_new():
            seen = c.cluster_status()
            ok = any(s.address == new["address"] and s.healthy for s in seen.workers) and \
                not any(s.address == old["address"] for s in seen.workers)
            return ok
        wait_until(served_by_new, 60, "router to follow the new address")
        names = {c.generate(token_ids=[4, 5], max_tokens=2).metrics.prefill_worker for _ in range(2)}
    assert names == {"prefill-0", "prefill-1"}


# -- scale -------------------------------------------------------------------------------------------
def test_scale_down_then_up(deployment, ray_cluster, node_names):
    st = scale(ray_cluster.address, NS, prefill=1)
    assert sorted(w["name"] for w in st.workers) == ["decode-0", "prefill-0"]
    assert set(list_groups(NS)) == {"prefill-0", "decode-0"}
    freed = next(n for n in node_names if n not in {w["node_id"] for w in st.workers})
    st = scale(ray_cluster.address, NS, decode=2)
    d1 = next(w for w in st.workers if w["name"] == "decode-1")
    assert d1["node_id"] == freed  # the only node with a free CPU
    with GenerationClient(st.router_address, API_KEY, timeout_s=60) as c:
        wait_until(lambda: sum(w.healthy for w in c.cluster_status().workers if w.role == "decode") == 2, 60,
                   "decode-1 in rotation")
        # a long request holds one decode worker busy: the next one goes to the other (fewest running)
        long = c.stream(token_ids=[3, 4], max_tokens=160, ignore_eos=True)
        first = next(long)
        short = c.generate(token_ids=[5], max_tokens=2)
        last = first
        for last in long:  # noqa: B007 - the last chunk is read after the loop
            pass
    assert {last.metrics.decode_worker, short.metrics.decode_worker} == {"decode-0", "decode-1"}
    with pytest.raises(PlacementError, match="missing CPU 1"):
        scale(ray_cluster.address, NS, prefill=2)
    assert len(list_groups(NS)) == 3


# -- stop --------------------------------------------------------------------------------------------
def test_stop_leaves_no_actors_groups_or_servers(deployment, ray_cluster, capsys):
    workers = status(ray_cluster.address, NS).workers  # what test_scale_down_then_up left, or the launch's own
    pids = [w["pid"] for w in workers] + [deployment.router["pid"]]
    names = ", ".join(sorted(w["name"] for w in workers))
    assert cli.main(["stop", "--address", ray_cluster.address, "--namespace", NS]) == 0
    assert f"stopped {names}, router" in capsys.readouterr().out
    assert_nothing_left()
    wait_until(lambda: not any(pid_alive(p) for p in pids), 20, "server processes to exit")
    assert cli.main(["status", "--address", ray_cluster.address, "--namespace", NS]) == 3
    with pytest.raises(LaunchError, match="no pdserve deployment"):
        scale(ray_cluster.address, NS, prefill=1)


def test_model_hash_mismatch_is_refused(ray_cluster, model_dir, tmp_path_factory):
    with pytest.raises(LaunchError, match="model hash mismatch") as e:
        launch(cfg(ray_cluster, model_dir, tmp_path_factory, prefill=1, decode=1, model_hash="0" * 16))
    msg = str(e.value)
    assert "prefill-0 (pid" in msg and "decode-0 (pid" in msg and "cluster expects 0000000000000000" in msg
    assert "Traceback" not in msg and "^^^" not in msg  # the server's words, not Ray's traceback
    assert_nothing_left()
    assert os.path.isdir(model_dir)


# -- TLS (after the main deployment stopped) -------------------------------------------------------------
def test_launch_over_tls(ray_cluster, model_dir, tmp_path_factory):
    """--tls-cert / --tls-key on Ray: the router's port and the workers' ports serve TLS; the router actor's
    own health checks and a TLS client get through, a plaintext client does not."""
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "cert.pem"), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True, timeout=60)
    cert = str(d / "cert.pem")
    st = launch(cfg(ray_cluster, model_dir, tmp_path_factory, prefill=1, decode=1, tls_cert=cert,
                    tls_key=str(d / "key.pem")))
    try:
        with GenerationClient(st.router_address, timeout_s=60, tls_ca=cert) as c:
            out = c.generate(token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
        assert out.finish_reason == "length" and len(out.token_ids) == 4
        with GenerationClient(st.router_address, timeout_s=10) as c, pytest.raises(grpc.RpcError) as e:
            c.generate(token_ids=[5, 6], max_tokens=2)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        stop(ray_cluster.address, NS, grace_s=2.0)
    assert_nothing_left()


# -- tensor parallelism (after the main deployment stopped) -------------------------------------------------
def test_tp2_worker_fills_its_bundles_and_restarts_as_a_unit(ray_cluster, model_dir, tmp_path_factory):
    """``--decode-tp 2``: the decode worker's placement group holds 2 bundles on one node, the worker actor in
    bundle 0 and a rank slot in bundle 1; the worker is 2 rank processes (rank 0 the actor's child, rank 1 its
    child) and serves; a SIGKILLed follower makes the whole group restart (new rank 0, new follower), which
    serves again; stop leaves nothing."""
    st = launch(cfg(ray_cluster, model_dir, tmp_path_factory, prefill=1, decode=1, decode_tp=2,
                    resources_per_worker='{"CPU": 0.5}'))
    prompt = list(range(3, 40))
    try:
        [slot] = st.ranks
        dec = next(w for w in st.workers if w["name"] == "decode-0")
        assert (slot["worker"], slot["rank"], slot["node_id"]) == ("decode-0", 1, dec["node_id"])
        with GenerationClient(st.router_address, timeout_s=60) as c:
            want = c.generate(token_ids=prompt, max_tokens=8, ignore_eos=True).token_ids
            w = next(w for w in c.cluster_status().workers if w.worker_id == "decode-0")
            rank0, follower = int(w.info["pid"]), int(w.info["rank_pids"])
            assert w.info["tp"] == "2" and pid_alive(follower)
            os.kill(follower, signal.SIGKILL)
            wait_until(lambda: not pid_alive(rank0), 60, "rank 0 of the broken group to exit")

            def restarted():
                w = {w["name"]: w for w in status(ray_cluster.address, NS).workers}.get("decode-0")
                return w if w and w["restarted"] and w["pid"] != dec["pid"] else None
            new = wait_until(restarted, 180, "decode-0 restarted", interval_s=1.0)
            assert new["node_id"] == dec["node_id"]

            def serving():
                ws = [w for w in c.cluster_status().workers if w.worker_id == "decode-0" and w.healthy]
                return ws and int(ws[0].info["pid"]) != rank0 and ws[0]
            back = wait_until(serving, 60, "the router to take the new group back")
            assert int(back.info["rank_pids"]) != follower and pid_alive(int(back.info["rank_pids"]))
            assert c.generate(token_ids=prompt, max_tokens=8, ignore_eos=True).token_ids == want
    finally:
        stop(ray_cluster.address, NS, grace_s=2.0)
    assert_nothing_left()
    assert not pid_alive(follower)
