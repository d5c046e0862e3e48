"""``pdserve launch`` in the modes it lacked before the one cluster spec (issue 46): aggregated (``--prefill 0``)
and Mooncake KV transport, on the session's local Ray cluster (``conftest.ray_cluster``, loopback only).

Each test launches one small deployment in its own namespace and stops it, leaving the cluster empty.
"""
import time

import pytest

ray = pytest.importorskip("ray")

from cluster.ray_launcher import RayLaunchConfig, actor_names, launch, stop  # noqa: E402
from cluster.ray_placement import list_groups  # noqa: E402
from kvtransfer.config import TransportConfig  # noqa: E402
from router.client import GenerationClient  # noqa: E402
from router.config import RouterConfig  # noqa: E402

NS = "pdserve-modes"
PROMPT = [5, 6, 7, 8, 9, 10, 11]
pytestmark = pytest.mark.timeout(240)
GREEDY: dict[str, list[int]] = {}
"""Tokens per mode, to compare across the tests."""


def cfg(ray_cluster, model_dir, tmp_path_factory, **kw) -> RayLaunchConfig:
    base = dict(address=ray_cluster.address, namespace=NS, model=model_dir, router=RouterConfig(port=0, http_port=0),
                speculative="off", num_pages=64, threads_per_worker=1, startup_timeout_s=180, placement_timeout_s=20,
                max_restarts=0, log_dir=str(tmp_path_factory.getbasetemp() / "raylogs-modes"))
    return RayLaunchConfig(**{**base, **kw})


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode().split("\0")


def read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


@pytest.fixture
def deploy(ray_cluster, ray_model_dir, tmp_path_factory):
    """``deploy(**cfg)`` -> the launched deployment's status; stopped after the test, nothing left."""
    def start(**kw):
        t0 = time.monotonic()
        st = launch(cfg(ray_cluster, ray_model_dir, tmp_path_factory, **kw))
        print(f"launch took {time.monotonic() - t0:.1f}s")
        return st
    yield start
    stop(ray_cluster.address, NS, grace_s=2.0)
    assert actor_names(NS) == [] and list_groups(NS) == {}


def generate(st) -> object:
    with GenerationClient(st.router_address, timeout_s=60) as c:
        return c.generate(token_ids=PROMPT, max_tokens=6, ignore_eos=True)


def test_aggregated_launch_serves_with_decode_workers_alone(deploy):
    """``--prefill 0``: no prefill worker, the router started aggregated, the decode worker prefills itself."""
    st = deploy(prefill=0, decode=1, prefill_chunk=4)
    assert [w["name"] for w in st.workers] == ["decode-0"]
    assert "--aggregated" in cmdline(st.router["pid"])
    dec = cmdline(st.workers[0]["pid"])
    assert dec[dec.index("--prefill-chunk") + 1] == "4"  # the prompt prefilled over two steps
    out = generate(st)
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    assert out.metrics.decode_worker == "decode-0" and out.metrics.kv_transfer_bytes == 0
    GREEDY["aggregated"] = list(out.token_ids)


def test_mooncake_launch_ships_kv_through_the_transfer_engine(deploy):
    """``--kv-transport mooncake``: both workers run with it, the decode worker offers Mooncake writes, the
    prefill worker uses them (no fall-back to TCP), and the answer is the aggregated one (greedy)."""
    from kvtransfer import mooncake  # the check imports torch
    if mooncake.available() is not None:
        pytest.skip(str(mooncake.available()))
    st = deploy(prefill=1, decode=1, transport=TransportConfig(kv_transport="mooncake", mooncake_protocol="tcp"))
    for w in st.workers:
        argv = cmdline(w["pid"])
        assert argv[argv.index("--kv-transport") + 1] == "mooncake", w["name"]
    out = generate(st)
    assert out.finish_reason == "length" and len(out.token_ids) == 6 and out.metrics.kv_transfer_bytes > 0
    logs = {w["role"]: read(w["log_path"]) for w in st.workers}
    assert "mooncake tcp writes offered" in logs["decode"], logs["decode"][-2000:]
    assert "unavailable" not in logs["prefill"] and "using TCP" not in logs["prefill"], logs["prefill"][-2000:]
    assert "Transfer Engine" in logs["prefill"]  # (Mooncake's own log) started by the sender for this receiver
    if "aggregated" in GREEDY:
        assert list(out.token_ids) == GREEDY["aggregated"]
