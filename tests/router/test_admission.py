"""The router's admission queue (``router.admission``): order, bound, deadline, cancel, aging and lost wakes as a
unit; then through a real router over fake workers on loopback (``router_fakes``): bursts far beyond the decode
pool complete with no failure, in disaggregated and aggregated mode, with nothing left queued or held."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
import grpc
import pytest

from router.admission import AdmissionQueue, Rejection, Slot, Waiter
from router.validate import RequestError
from router_fakes import FakeCluster, expected_tokens, rpc_error, run_bounded, write_tokenizer


@dataclass
class FakeRun:
    client_req_id: str
    priority: int = 0
    t0: float = field(default_factory=time.monotonic)
    timeout_s: float = 30.0
    cutoff: RequestError | None = None

    def remaining(self) -> float:
        if self.cutoff is not None:
            raise self.cutoff
        left = self.t0 + self.timeout_s - time.monotonic()
        if left <= 0:
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded before the request finished")
        return left


@dataclass
class FakeMetrics:
    waiting: list[int] = field(default_factory=list)
    rejections: list[str] = field(default_factory=list)

    def queue_changed(self, num_waiting: int) -> None:
        self.waiting.append(num_waiting)

    def rejected(self, reason: str) -> None:
        self.rejections.append(str(reason))


def make_queue(max_queued: int = 8, aging_s: float = 0.0) -> tuple[AdmissionQueue, FakeMetrics]:
    m = FakeMetrics()
    return AdmissionQueue(max_queued, aging_s, m), m


def enter(q: AdmissionQueue, name: str, priority: int = 0, **kw) -> Waiter:
    return q.enter(FakeRun(name, priority, **kw), "full", q.num_wakes)


def tried(q: AdmissionQueue) -> str | None:
    """The request whose turn it is."""
    return next((w.run.client_req_id for w in q._waiters if w.state is Slot.TRYING), None)


def test_turns_go_by_priority_then_arrival_and_a_refused_head_keeps_its_place():
    async def go():
        q, m = make_queue()
        ws = {n: enter(q, n, p) for n, p in (("a", 0), ("b", 1), ("c", 0), ("d", 1))}
        assert tried(q) is None  # entering alone gives no turn: room must free first (a wake)
        q.wake()
        assert tried(q) == "b"
        await asyncio.wait_for(q.turn(ws["b"]), 1)
        q.no_room(ws["b"])  # every worker still full: it waits again, first in line
        assert tried(q) is None
        q.wake()
        assert tried(q) == "b"
        order = []
        for _ in range(4):
            name = tried(q)
            order.append(name)
            q.admit(ws[name])  # the next one tries at once: room may be left
        assert order == ["b", "d", "a", "c"] and len(q) == 0 and m.waiting[-1] == 0
        assert q.num_admitted == 4
    run_bounded(go(), 5)


def test_a_full_queue_refuses_with_retry_after_and_no_queue_refuses_at_once():
    q, m = make_queue(max_queued=2)
    enter(q, "a")
    enter(q, "b")
    with pytest.raises(RequestError) as e:
        enter(q, "c")
    assert e.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-queued 2" in e.value.message
    assert e.value.retry_after_s >= 1 and m.rejections == [Rejection.QUEUE_FULL] and len(q) == 2
    q0, m0 = make_queue(max_queued=0)
    with pytest.raises(RequestError) as e:
        enter(q0, "a")
    assert e.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.retry_after_s == 1
    assert m0.rejections == [Rejection.NO_QUEUE] and len(q0) == 0


def test_deadline_while_queued_is_deadline_exceeded_and_leaves_nothing():
    async def go():
        q, m = make_queue()
        w = enter(q, "a", timeout_s=0.2)
        t0 = time.monotonic()
        with pytest.raises(RequestError) as e:
            await q.turn(w)
        assert e.value.code is grpc.StatusCode.DEADLINE_EXCEEDED and "admission queue" in e.value.message
        assert 0.15 < time.monotonic() - t0 < 2.0 and m.rejections == [Rejection.DEADLINE]
        assert q.leave(w) > 0.15 and len(q) == 0 and m.waiting[-1] == 0
        assert m.rejections == [Rejection.DEADLINE]  # counted once, by whichever saw the deadline first
    run_bounded(go(), 5)


def test_cancelled_at_its_deadline_counts_as_a_deadline_refusal_once():
    """gRPC cancels the handler at the client's deadline, the same instant as the queue's own timer: when the
    cancel runs first (a loaded host's event loop order) the refusal is still a deadline one, counted once;
    a client that leaves before its deadline, or a drain's cut-off, is no refusal."""
    async def go():
        q, m = make_queue()
        late, early, cut = enter(q, "late", timeout_s=0.05), enter(q, "early"), enter(q, "cut")
        task = asyncio.ensure_future(q.turn(late))
        await asyncio.sleep(0.08)  # past its deadline; the turn's timer may or may not have run yet
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        q.leave(late)
        cut.run.cutoff = RequestError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        q.leave(early)
        q.leave(cut)
        assert m.rejections == [Rejection.DEADLINE] and len(q) == 0
        late2 = enter(q, "late2", timeout_s=0.01)
        await asyncio.sleep(0.03)
        q.leave(late2)  # its timer never ran: the leave counts it
        assert m.rejections == [Rejection.DEADLINE] * 2
        admitted = enter(q, "admitted", timeout_s=0.01)
        await asyncio.sleep(0.03)
        q.admit(admitted)  # room came at its deadline: admitted, no refusal
        q.leave(admitted)
        assert m.rejections == [Rejection.DEADLINE] * 2 and q.num_admitted == 1 and len(q) == 0
    run_bounded(go(), 5)


def test_cancel_or_cut_off_while_queued_releases_the_place_and_the_turn():
    async def go():
        q, _ = make_queue()
        a, b, c = enter(q, "a"), enter(q, "b"), enter(q, "c")

        async def wait_turn(w: Waiter) -> None:
            try:
                await q.turn(w)
            finally:
                if w.state is not Slot.TRYING:
                    q.leave(w)
        tb = asyncio.ensure_future(wait_turn(b))
        tc = asyncio.ensure_future(wait_turn(c))
        q.wake()
        assert tried(q) == "a"
        q.leave(a)  # the one trying left (its client went away): the next one gets the turn
        await asyncio.wait_for(tb, 1)
        assert tried(q) == "b"
        c.run.cutoff = RequestError(grpc.StatusCode.UNAVAILABLE, "shutting down")
        q.kick(c)  # what GenerateRun.cut_off does
        with pytest.raises(RequestError, match="shutting down"):
            await asyncio.wait_for(tc, 1)
        q.admit(b)
        assert len(q) == 0 and tried(q) is None
    run_bounded(go(), 5)


def test_a_wake_during_a_try_is_not_lost():
    q, _ = make_queue()
    a = enter(q, "a")
    q.wake()
    assert tried(q) == "a"
    q.wake()  # room freed while "a" asked the workers (they answered before it)
    q.no_room(a)
    assert tried(q) == "a"  # it tries again at once instead of waiting for another event
    q.no_room(a)
    assert tried(q) is None


def test_aging_lifts_a_low_priority_request_above_new_higher_priority_ones():
    q, _ = make_queue(aging_s=0.1)
    old = enter(q, "old", 0, t0=time.monotonic() - 0.25)  # waited 2.5 aging periods: ranks as priority 2.5
    enter(q, "new1", 1)
    enter(q, "new2", 2)
    assert q.position(old) == 1
    q.wake()
    assert tried(q) == "old"
    plain, _ = make_queue(aging_s=0.0)
    old = enter(plain, "old", 0, t0=time.monotonic() - 100)
    enter(plain, "new", 1)
    assert plain.position(old) == 2


# -- through a real router --------------------------------------------------------------------------------
def waiting(fc: FakeCluster) -> float:
    return fc.router.core.metrics.registry.get_sample_value("pdserve:num_requests_waiting")


def rejected(fc: FakeCluster, reason: str) -> float:
    return fc.router.core.metrics.registry.get_sample_value("pdserve:requests_rejected_total",
                                                            {"reason": reason}) or 0.0


async def nothing_left(fc: FakeCluster) -> None:
    await fc.wait_for(lambda: all(d.pages_free == d.pages_total and not d.streams for d in fc.decodes),
                      what="every decode page back")
    assert len(fc.router.core.queue) == 0 and waiting(fc) == 0 and fc.router.core.inflight == 0


@pytest.mark.parametrize("aggregated", [False, True])
def test_a_burst_far_beyond_the_decode_pool_completes_with_no_failure(aggregated):
    """16 pages hold ~2 requests (12-token prompts + 8 tokens = 5 pages each at the end): 40 at once all finish,
    in order of arrival. Status polls are 30 s apart: every admission is pushed by a request ending."""
    async def go():
        async with FakeCluster(0 if aggregated else 1, 1, decode_pages=16, health_interval_s=30.0,
                               aggregated=aggregated) as fc:
            fc.decodes[0].b.delay_s = 0.005
            prompts = [[2 + i % 7] * 12 for i in range(40)]
            outs = await asyncio.gather(*(fc.client.generate(token_ids=p, max_tokens=8, ignore_eos=True)
                                          for p in prompts))
            assert [o.token_ids for o in outs] == [expected_tokens(p, 8, ignore_eos=True) for p in prompts]
            queued = [o.metrics.router_queue_s for o in outs if o.metrics.router_queue_s > 0]
            assert len(queued) >= 20 and fc.router.core.queue.num_admitted >= 20
            await nothing_left(fc)
            m = fc.router.core.metrics.registry
            assert m.get_sample_value("pdserve:router_queue_time_seconds_count") == 40
            assert m.get_sample_value("pdserve:requests_total", {"status": "OK", "api": "grpc"}) == 40
    run_bounded(go(), 30)


def test_a_big_request_behind_a_stream_of_small_ones_is_admitted_in_bounded_time():
    """The big one needs 30 of 40 pages; eight clients keep sending small ones (3 pages each, growing to 5). It
    is not starved: the small ones that arrive after it queue behind it while the running ones finish."""
    async def go():
        async with FakeCluster(1, 1, decode_pages=40) as fc:
            fc.decodes[0].b.delay_s = 0.01
            stop = asyncio.Event()

            async def small_stream(k: int) -> int:
                n = 0
                while not stop.is_set():
                    await fc.client.generate(token_ids=[3 + k] * 10, max_tokens=8, ignore_eos=True)
                    n += 1
                return n
            streams = [asyncio.ensure_future(small_stream(k)) for k in range(8)]
            await asyncio.sleep(0.3)
            # It must wait however fast this host runs the small ones: 11 pages held by a squatter leave at most
            # 29 for it, until the squatter leaves 0.2 s after it arrives; from then the small ones compete.
            fc.decodes[0].reserved["squatter"] = 11
            t0 = time.monotonic()
            big_f = asyncio.ensure_future(fc.client.generate(token_ids=[7] * 120, max_tokens=4, ignore_eos=True))
            await asyncio.sleep(0.2)
            del fc.decodes[0].reserved["squatter"]
            big = await big_f
            took = time.monotonic() - t0
            stop.set()
            served = await asyncio.gather(*streams)
            assert big.token_ids == expected_tokens([7] * 120, 4, ignore_eos=True)
            assert took < 3.0 and big.metrics.router_queue_s > 0, (took, big.metrics.router_queue_s)
            assert min(served) >= 2
            await nothing_left(fc)
    run_bounded(go(), 30)


def test_refusals_past_the_bound_the_deadline_and_the_pool_and_cancel_releases():
    async def go():
        async with FakeCluster(1, 1, decode_pages=16, max_queued=1) as fc:
            d = fc.decodes[0]
            d.reserved = {"squatter": 16}  # no room until it leaves
            e = await rpc_error(fc.client.generate(token_ids=[5] * 8, max_tokens=4, timeout_s=0.3))
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # the client's own deadline says so first
            await fc.wait_for(lambda: rejected(fc, "deadline") == 1, what="the router's deadline refusal")
            first = asyncio.ensure_future(fc.client.generate(token_ids=[5] * 8, max_tokens=4))
            await fc.wait_for(lambda: len(fc.router.core.queue) == 1, what="one queued")
            e = await rpc_error(fc.client.generate(token_ids=[6] * 8, max_tokens=4))
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-queued 1" in e.details()
            assert int(dict(e.trailing_metadata())["retry-after"]) >= 1 and rejected(fc, "queue_full") == 1
            e = await rpc_error(fc.client.generate(token_ids=[5] * 70, max_tokens=4))  # 18 pages > 16
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "can never be served" in e.details()
            assert "d0's 16 pages" in e.details() and rejected(fc, "never_fits") == 1
            first.cancel()  # the client goes away while queued
            await fc.wait_for(lambda: len(fc.router.core.queue) == 0 and fc.router.core.inflight == 0,
                              what="the cancelled request gone from the queue")
            assert waiting(fc) == 0
            queued = asyncio.ensure_future(fc.client.generate(token_ids=[5] * 8, max_tokens=4))
            await fc.wait_for(lambda: len(fc.router.core.queue) == 1, what="queued again")
            d.reserved.clear()  # room: the next status poll (it shows freed pages) admits it
            assert (await queued).token_ids == expected_tokens([5] * 8, 4)
            await nothing_left(fc)
    run_bounded(go(), 30)


def test_http_past_the_bound_is_429_with_retry_after(tmp_path):
    async def go():
        async with FakeCluster(1, 1, decode_pages=16, max_queued=1, http_port=-1,
                               model=write_tokenizer(str(tmp_path))) as fc:
            fc.decodes[0].reserved = {"squatter": 16}
            queued = asyncio.ensure_future(fc.client.generate(token_ids=[5] * 8, max_tokens=4))
            await fc.wait_for(lambda: len(fc.router.core.queue) == 1, what="one queued")
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://{fc.router.http.address}/v1/completions",
                                  json={"model": tmp_path.name, "prompt": [6] * 8, "max_tokens": 4}) as resp:
                    body = await resp.json()
                    assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1, body
                    assert body["error"]["type"] == "rate_limit_error" and "--max-queued 1" in body["error"]["message"]
            fc.decodes[0].reserved.clear()
            assert (await queued).finish_reason == "length"
            await nothing_left(fc)
    run_bounded(go(), 30)
