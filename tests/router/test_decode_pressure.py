"""The router under decode KV pressure, over real gRPC against fake decode workers: the reason a decode
worker ends a request reaches the client, a decode worker without room is passed over for the next one,
and a burst spreads over the decode workers (a reservation counts as load from the moment it is asked)."""
import asyncio
import functools
import collections

import grpc

from router_fakes import FakeCluster, expected_tokens, run_bounded


run = functools.partial(run_bounded, timeout_s=60.0)


async def all_back(fc: FakeCluster) -> None:
    await fc.wait_for(lambda: all(d.pages_free == d.pages_total for d in fc.decodes), what="decode pages free")
    await fc.wait_for(lambda: not any(w.inflight for w in fc.registry.workers.values())
                      and fc.router.core.inflight == 0, what="counters at 0")


def test_the_decode_workers_error_message_reaches_the_client():
    async def go():
        async with FakeCluster(1, 1) as fc:
            why = "decode KV pool exhausted: this request alone needs 300 pages, more than the pool's 256"
            fc.decodes[0].b.decode_error = why
            chunks = [c async for c in fc.client.stream(token_ids=[5, 6, 7], max_tokens=8)]
            assert chunks[-1].finish_reason == "error" and chunks[-1].message == why
            assert all(not c.message for c in chunks[:-1])
            await all_back(fc)
    run(go())


def test_a_decode_worker_that_refuses_the_stream_for_room_is_passed_over():
    async def go():
        async with FakeCluster(1, 2, health_interval_s=30.0) as fc:  # statuses stay as they were
            full, other = fc.decodes
            full.b.decode_code = grpc.StatusCode.RESOURCE_EXHAUSTED
            prompt = list(range(2, 20))
            c = await fc.client.generate(token_ids=prompt, max_tokens=6)
            # (the fake model's tokens after a failover's re-prefill differ from a straight run's)
            assert c.finish_reason == "length" and c.token_ids[0] == expected_tokens(prompt, 6)[0]
            assert len(c.token_ids) == 6 and c.metrics.failovers == 1
            assert c.metrics.decode_worker == "d1" and full.calls and other.calls
            await all_back(fc)
    run(go())


def test_a_burst_spreads_over_the_decode_workers():
    """4 requests at once, 2 idle decode workers: 2 each (the old router sent all 4 to the first: its load
    counted open decode streams only, and none was open while the burst was being reserved)."""
    async def go():
        async with FakeCluster(1, 2, health_interval_s=30.0, decode_pages=256) as fc:
            for d in fc.decodes:
                d.b.delay_s = 0.02
            outs = await asyncio.gather(*(fc.client.generate(token_ids=list(range(2 + i, 30)), max_tokens=8)
                                          for i in range(4)))
            assert all(c.finish_reason == "length" for c in outs)
            assert collections.Counter(c.metrics.decode_worker for c in outs) == {"d0": 2, "d1": 2}
            await all_back(fc)
    run(go())
