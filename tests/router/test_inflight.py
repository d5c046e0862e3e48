"""The router's in-flight counters (per worker and the router's own admission count) over real gRPC
against fake workers: whatever point of the call path a deadline or a cancellation lands on, every
counter is back to 0 and every decode page is free afterwards (a leaked count skews routing for good and
eventually refuses every request)."""
import asyncio
import functools

import grpc
import pytest

from router.request import GenerateRun
from router.validate import RequestError
from router_fakes import FakeCluster, run_bounded


run = functools.partial(run_bounded, timeout_s=120.0)


def counters(fc: FakeCluster) -> dict[str, int]:
    out = {w.key: w.inflight for w in fc.registry.workers.values()}
    out["router"] = fc.router.core.inflight
    return out


async def all_back(fc: FakeCluster, what: str) -> None:
    # 30 s, not the default 5: sixty calls' releases on a machine whose two cores other jobs hold can take
    # seconds (seen once in a loaded suite run); a leak never comes back, however long the wait
    await fc.wait_for(lambda: not any(counters(fc).values()), timeout_s=30,
                      what=f"every counter at 0 ({what}): {counters(fc)}")
    await fc.wait_for(lambda: all(d.pages_free == d.pages_total for d in fc.decodes), timeout_s=30,
                      what=f"every decode page free ({what}): {[d.pages_free for d in fc.decodes]}")


class DeadlineAt:
    """Makes the ``n``-th deadline check of the next request find its deadline expired."""

    def __init__(self) -> None:
        self.n, self.seen = 0, 0
        self._real = GenerateRun.remaining

    def patch(self, monkeypatch) -> None:
        def remaining(run: GenerateRun) -> float:
            self.seen += 1
            if self.seen == self.n:
                raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline exceeded (test: check {self.n})")
            return self._real(run)
        monkeypatch.setattr(GenerateRun, "remaining", remaining)


@pytest.mark.parametrize("local_prefill_below", [0, 1000], ids=["disaggregated", "local-prefill"])
def test_a_deadline_at_every_check_of_the_call_path_leaves_every_counter_at_zero(monkeypatch, local_prefill_below):
    at = DeadlineAt()
    at.patch(monkeypatch)

    async def go():
        async with FakeCluster(2, 2, local_prefill_below=local_prefill_below) as fc:
            prompt = list(range(2, 30))
            await fc.client.generate(token_ids=prompt, max_tokens=6)  # count the checks of a whole request
            checks, at.seen = at.seen, 0
            assert checks >= 4
            for n in range(1, checks + 1):
                at.n, at.seen = n, 0
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await fc.client.generate(token_ids=prompt, max_tokens=6)
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, (n, e.value.details())
                await all_back(fc, f"deadline at check {n} of {checks}")
            at.n = 0
            c = await fc.client.generate(token_ids=prompt, max_tokens=6)  # and the cluster still serves
            assert c.finish_reason == "length"
            await all_back(fc, "after the sweep")
    run(go())


@pytest.mark.parametrize("local_prefill_below", [0, 1000], ids=["disaggregated", "local-prefill"])
def test_client_deadlines_and_cancels_across_the_whole_call_leave_every_counter_at_zero(local_prefill_below):
    async def go():
        async with FakeCluster(2, 2, local_prefill_below=local_prefill_below, decode_pages=1024) as fc:
            for p in fc.prefills:
                p.b.delay_s = 0.03
            for d in fc.decodes:
                d.b.delay_s = 0.01
            prompt = list(range(2, 30))

            async def deadline(timeout_s: float) -> None:
                try:
                    await fc.client.generate(token_ids=prompt, max_tokens=12, timeout_s=timeout_s)
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.details()

            async def cancel_after(chunks: int) -> None:
                call = fc.client.call(token_ids=prompt, max_tokens=12)
                n = 0
                async for _ in call:
                    n += 1
                    if n == chunks:
                        call.cancel()
                        return

            # deadlines from before the reservation to the last decode chunk, many at once
            await asyncio.gather(*(deadline(0.002 * i + 0.001) for i in range(60)))
            await all_back(fc, "client deadlines")
            await asyncio.gather(*(cancel_after(k) for k in range(1, 8) for _ in range(3)))
            await all_back(fc, "client cancels")
    run(go())
