"""An aggregated router (``RouterConfig.aggregated``, ``pdserve serve --prefill 0``): decode workers alone, each
prefilling every prompt itself; fake workers, a real ``RouterServer``, real gRPC."""
import functools

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.config import RouterConfig
from router_fakes import FakeCluster, expected_tokens, rpc_error, run_bounded

run = functools.partial(run_bounded, timeout_s=30.0)


async def health(fc) -> int:
    stub = health_pb2_grpc.HealthStub(fc.client.channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"), timeout=5)).status


def test_every_prompt_is_prefilled_on_a_decode_worker_and_serving_needs_no_prefill_worker():
    async def go():
        async with FakeCluster(0, 2, aggregated=True) as fc:
            assert fc.registry.serving() and await health(fc) == health_pb2.HealthCheckResponse.SERVING
            for n in (3, 200):  # short or long: never a Reserve, never a prefill worker
                prompt = [2 + i % 300 for i in range(n)]
                c = await fc.client.generate(token_ids=prompt, max_tokens=4)
                assert c.token_ids == expected_tokens(prompt, 4) and c.finish_reason == "length"
                assert c.metrics.prefill_worker == c.metrics.decode_worker and c.metrics.decode_worker in ("d0", "d1")
            assert sum(len(d.local_prefills) for d in fc.decodes) == 2 and all(d.calls == [] for d in fc.decodes)
    run(go())


def test_decode_workers_that_cannot_prefill_make_it_unavailable_saying_why():
    async def go():
        async with FakeCluster(0, 1, aggregated=True) as fc:
            d = fc.decodes[0]
            d.b.extra_info = {"local_prefill": "0"}
            await fc.wait_for(lambda: not fc.registry.workers[d.key].candidate().supports_local_prefill,
                              what="status poll")
            e = await rpc_error(fc.client.generate(token_ids=[5, 6, 7], max_tokens=4))
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            assert "no prefill workers (aggregated) and decode workers d0 do not prefill" in e.details(), e.details()
            assert d.local_prefills == [] and d.calls == []
    run(go())


def test_without_aggregated_a_cluster_with_no_prefill_worker_is_not_serving():
    """The normal mode is unchanged: no prefill worker, no service."""
    async def go():
        async with FakeCluster(0, 1) as fc:
            assert not fc.registry.serving() and await health(fc) == health_pb2.HealthCheckResponse.NOT_SERVING
            e = await rpc_error(fc.client.generate(token_ids=[5, 6, 7], max_tokens=4))
            assert e.code() == grpc.StatusCode.UNAVAILABLE and "no healthy prefill and decode workers" in e.details()
    run(go())


def test_aggregated_takes_no_prefill_addresses():
    with pytest.raises(ValueError, match="an aggregated router takes no prefill workers, got h:1"):
        RouterConfig(aggregated=True, prefill=("h:1",), decode=("h:2",))


def test_a_full_decode_worker_passes_the_request_on_and_all_full_is_resource_exhausted():
    """A decode worker that refuses a local prefill for room before any token: the next one takes it (no
    failover spent); every one full and no admission queue (``max_queued=0``; tests/router/test_admission.py
    has the queue): RESOURCE_EXHAUSTED naming each, as full reservations are."""
    async def go():
        async with FakeCluster(0, 2, aggregated=True, max_failovers=0, max_queued=0) as fc:
            d0, d1 = fc.decodes
            d0.b.local_full = "max_running=1 requests are running"
            for _ in range(3):
                c = await fc.client.generate(token_ids=[5, 6, 7], max_tokens=4)
                assert c.token_ids == expected_tokens([5, 6, 7], 4) and c.metrics.decode_worker == "d1"
                assert c.metrics.failovers == 0
            d1.b.local_full = "the KV pool is short"
            e = await rpc_error(fc.client.generate(token_ids=[5, 6, 7], max_tokens=4))
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
            assert "no decode worker has room for this request" in e.details()
            assert "d0: max_running=1" in e.details() and "d1: the KV pool is short" in e.details()
    run(go())
