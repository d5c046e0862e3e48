"""Clients that stop reading (HTTP/2 streams with a zero flow-control window, spoken on a raw socket by
``bench.loadgen.slowreader``) against a real ``RouterServer`` over fake workers: they cannot hold the
router's in-flight slots past ``stream_write_timeout_s``, they are not decode work meanwhile (the decode
workers finish and free everything at once), and a normal client is served while they still hang."""
import asyncio
import functools

import grpc
import pytest

from bench.loadgen.slowreader import SlowReaders
from protos.pdserve.v1 import generation_pb2
from router.client import make_request
from router.relay import relay
from router.validate import RequestError
from router_fakes import FakeCluster, expected_tokens, run_bounded

WRITE_TIMEOUT_S = 3.0
SLOTS = 6


run = functools.partial(run_bounded, timeout_s=60.0)


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



class BufferedRun:
    """Unit-test stand-in for ``GenerateRun``: ``stream()`` yields ``n`` one-token responses and a finish."""

    client_req_id = "unit"

    def __init__(self, n: int) -> None:
        self.n, self.aborted = n, []
        self.produced = asyncio.Event()

    async def stream(self):
        for i in range(self.n):
            yield generation_pb2.GenerateResponse(token_ids=[i], text=f"<{i}>",
                                                  logprobs=[generation_pb2.TokenLogprob(token_id=i)])
            if i == 0:
                await asyncio.sleep(0.05)  # the first token goes out alone (the decode stream is slower)
        yield generation_pb2.GenerateResponse(finish_reason="length", message="done")
        self.produced.set()

    def remaining(self) -> float:
        return 60.0

    def abort(self, why: str) -> None:
        self.aborted.append(why)


def test_a_client_that_falls_behind_gets_what_queued_up_in_one_message():
    """While one write is blocked the producer runs ahead; what queued up is then written as one message
    (tokens, text and logprobs in order, the finish last), not one message per decode chunk."""
    async def go():
        run_, written, release = BufferedRun(20), [], asyncio.Event()

        async def write(resp):
            written.append(resp)
            if len(written) == 1:
                await release.wait()
        task = asyncio.create_task(relay(run_, run_.stream(), write, write_timeout_s=30.0))
        await asyncio.wait_for(run_.produced.wait(), 5)  # produced everything while the first write hung
        release.set()
        await task
        assert len(written) == 2 and written[-1].finish_reason == "length" and written[-1].message == "done"
        assert [t for w in written for t in w.token_ids] == list(range(20))
        assert "".join(w.text for w in written) == "".join(f"<{i}>" for i in range(20))
        assert [lp.token_id for w in written for lp in w.logprobs] == list(range(20))
        assert run_.aborted == []

        blocked = BufferedRun(3)  # a write that never completes: cancelled after the write timeout

        async def never(resp):
            await asyncio.Event().wait()
        with pytest.raises(RequestError) as e:
            await relay(blocked, blocked.stream(), never, write_timeout_s=0.2)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "stream_write_timeout_s" in e.value.message
        assert blocked.aborted == ["client stopped reading"]
    run(go())
