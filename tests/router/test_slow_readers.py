"""Clients that stop reading (HTTP/2 streams with a zero flow-control window, spoken on a raw socket by
``bench.loadgen.slowreader``) against a real ``RouterServer`` over fake workers: they cannot hold the
router's in-flight slots past ``stream_write_timeout_s``, they are not decode work meanwhile (the decode
workers finish and free everything at once), and a normal client is served while they still hang."""
import asyncio

from bench.loadgen.slowreader import SlowReaders
from router.client import make_request
from router_fakes import FakeCluster, expected_tokens

WRITE_TIMEOUT_S = 3.0
SLOTS = 6


def run(coro, timeout_s: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def test_slow_readers_lose_their_slots_after_the_write_timeout_and_are_not_decode_work():
    async def go():
        async with FakeCluster(1, 2, max_inflight=SLOTS, stream_write_timeout_s=WRITE_TIMEOUT_S,
                               decode_pages=1024) as fc:
            core = fc.router.core
            prompt = list(range(2, 40))
            slow = SlowReaders(fc.router.address, SLOTS, make_request(token_ids=prompt, max_tokens=24)).start()
            try:
                await fc.wait_for(lambda: core.inflight == SLOTS, what="every router slot taken by a slow reader")
                e = await fc.client.call(token_ids=prompt, max_tokens=4).code()
                assert e.name == "RESOURCE_EXHAUSTED"  # the attack works: the router is full
                # the decode workers finished those requests and hold nothing for them: not decode work
                await fc.wait_for(lambda: all(d.pages_free == d.pages_total and d.streams == 0 for d in fc.decodes)
                                  and not any(w.inflight for w in fc.registry.workers.values()),
                                  what="decode workers free while the writes are blocked")
                assert core.inflight == SLOTS  # (still within the write timeout)
                t0 = asyncio.get_running_loop().time()
                await fc.wait_for(lambda: core.inflight == 0, timeout_s=WRITE_TIMEOUT_S + 10,
                                  what="router slots back after the write timeout")
                assert asyncio.get_running_loop().time() - t0 <= WRITE_TIMEOUT_S + 2
                # a normal client is served while the slow readers' connection still hangs open
                c = await fc.client.generate(token_ids=prompt, max_tokens=8)
                assert c.finish_reason == "length" and c.token_ids == expected_tokens(prompt, 8)
            finally:
                slow.close()
            await fc.wait_for(lambda: core.inflight == 0 and not any(w.inflight for w in fc.registry.workers.values())
                              and all(d.pages_free == d.pages_total for d in fc.decodes), what="everything back")
    run(go())
