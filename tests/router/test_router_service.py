"""The router's request paths over real gRPC against in-process fake workers (see router_fakes).

The same paths run against real worker processes in tests/integration; these cover the failure cases
that are hard to provoke there (reservation refused, a prefill worker failing, health flapping).
"""
import asyncio
import functools
import dataclasses

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.policy import Candidate, order_decode
from router.prefix_index import PromptHashes, prefix_block_hashes
from router_fakes import EOS_TRIGGER, PAGE, VOCAB, FakeCluster, expected_tokens, rpc_error, run_bounded, write_tokenizer


run = functools.partial(run_bounded, timeout_s=30.0)



def test_stream_order_usage_and_metrics():
    async def go():
        async with FakeCluster(1, 1) as fc:
            prompt = [5, 6, 7, 8, 9]
            chunks = [c async for c in fc.client.stream(token_ids=prompt, max_tokens=7, logprobs=1,
                                                        request_id="mine")]
            ids = [t for c in chunks for t in c.token_ids]
            assert ids == expected_tokens(prompt, 7)
            assert len(chunks[0].token_ids) == 1 and not chunks[0].finish_reason  # first token alone (TTFT)
            assert chunks[0].logprobs[0].logprob == -0.5
            assert all(not c.finish_reason for c in chunks[:-1]) and chunks[-1].finish_reason == "length"
            assert all(c.request_id == "mine" for c in chunks)
            last = chunks[-1]
            assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (5, 7)
            m = last.metrics
            assert m.prefill_worker == "p0" and m.decode_worker == "d0" and m.retries == 0
            assert m.ttft_s > 0 and m.kv_transfer_bytes == 123 and m.accept_len == 2.0
            assert not chunks[0].HasField("usage") or chunks[0].usage.completion_tokens == 0
            d = fc.decodes[0]
            await fc.wait_for(lambda: d.pages_free == d.pages_total, what="decode pages freed")
            assert d.aborts == [] and fc.prefills[0].aborts == []
    run(go())


@pytest.mark.parametrize("kw,prompt,reason", [({}, [EOS_TRIGGER, 3], "stop"), ({"max_tokens": 1}, [5, 6], "length"),
                                              ({"stop_token_ids": [10 + 11 % 40]}, [5, 6], "stop")])
def test_first_token_that_ends_the_request_still_frees_the_reservation(kw, prompt, reason):
    async def go():
        async with FakeCluster(1, 1) as fc:
            c = await fc.client.generate(token_ids=prompt, **kw)
            assert c.finish_reason == reason and len(c.token_ids) == 1 and c.usage.completion_tokens == 1
            d = fc.decodes[0]
            await fc.wait_for(lambda: d.pages_free == d.pages_total, what="reservation freed")
    run(go())


def test_reservation_falls_through_to_the_next_decode_worker():
    async def go():
        async with FakeCluster(1, 2, decode_pages=64, health_interval_s=30.0, max_queued=0) as fc:  # stale statuses;
            # no admission queue: all full is refused at once (tests/router/test_admission.py: it waits)
            roomy, other = fc.decodes
            roomy.pages_total = 128
            await fc.registry.poll_once(fc.registry.workers[roomy.key])  # looks like the best choice...
            roomy.reserved = {"squatter": 127}  # ...but is full by the time the request comes
            c = await fc.client.generate(token_ids=list(range(2, 42)), max_tokens=4)
            assert c.metrics.decode_worker == "d1" and c.finish_reason == "length"
            assert len(roomy.calls) == 1 and len(other.calls) == 1  # tried first, refused, then the next one
            other.reserved = {"squatter": 63}  # another prompt: d1 holds the first one now (decode-side reuse)
            e = await rpc_error(fc.client.generate(token_ids=list(range(50, 90)), max_tokens=4))
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "no decode worker has room" in e.details()
            assert "d0" in e.details() and "d1" in e.details()
    run(go())


def test_exhausted_worker_is_skipped():
    async def go():
        async with FakeCluster(1, 2) as fc:
            a, b = fc.decodes
            a.reserved = {"squatter": 63}
            b.reserved = {}
            for _ in range(3):
                c = await fc.client.generate(token_ids=list(range(2, 42)), max_tokens=3)
                assert c.metrics.decode_worker == "d1"
    run(go())


def test_prefill_failure_is_retried_once_on_another_worker():
    async def go():
        async with FakeCluster(2, 1, routing="round_robin") as fc:
            bad, good = fc.prefills
            bad.b.fail_code = grpc.StatusCode.UNAVAILABLE
            bad.status_fail = True  # the confirming probe finds it gone
            c = await fc.client.generate(token_ids=[5, 6, 7], max_tokens=4)
            assert c.token_ids == expected_tokens([5, 6, 7], 4)
            assert c.metrics.retries == 1 and c.metrics.prefill_worker == "p1"
            assert len(bad.calls) + len(good.calls) == 2
            assert not fc.registry.workers[bad.key].healthy  # out of rotation at once
            d = fc.decodes[0]
            await fc.wait_for(lambda: d.pages_free == d.pages_total, what="first reservation freed")
            assert len(d.aborts) >= 1  # the first attempt's reservation was aborted
            # only one retry: when every prefill fails the client sees the error
            good.b.fail_code = grpc.StatusCode.INTERNAL
            bad.status_fail = False
            await fc.wait_for(lambda: fc.registry.workers[bad.key].healthy, what="back in rotation")
            calls = len(bad.calls) + len(good.calls)
            e = await rpc_error(fc.client.generate(token_ids=[5, 6, 7], max_tokens=4))
            assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
            assert len(bad.calls) + len(good.calls) == calls + 2
            await fc.wait_for(lambda: d.pages_free == d.pages_total, what="reservations freed")
    run(go())


def test_prefill_worker_that_dies_mid_request_is_retried():
    async def go():
        async with FakeCluster(2, 1, routing="round_robin") as fc:
            dying, other = fc.prefills
            dying.b.hang = True
            other.b.hang = True
            task = asyncio.ensure_future(fc.client.generate(token_ids=[5, 6, 7], max_tokens=3))
            await fc.wait_for(lambda: dying.calls or other.calls, what="prefill call")
            victim, survivor = (dying, other) if dying.calls else (other, dying)
            survivor.b.hang = False
            await victim.stop(0)  # the worker process is gone
            c = await task
            assert c.token_ids == expected_tokens([5, 6, 7], 3) and c.metrics.retries == 1
            assert c.metrics.prefill_worker == survivor.worker_id
    run(go())


def test_prefill_worker_that_stalls_and_leaves_rotation_is_retried_at_once():
    """A prefill worker that holds the call (its scheduler wedged) and then reports itself unhealthy:
    the router gives up the call as soon as the worker leaves rotation and retries on the other one,
    long before the request's deadline."""
    async def go():
        async with FakeCluster(2, 1, routing="round_robin") as fc:
            for p in fc.prefills:
                p.b.hang = True
            t0 = asyncio.get_running_loop().time()
            task = asyncio.ensure_future(fc.client.generate(token_ids=[5, 6, 7], max_tokens=3, timeout_s=60))
            await fc.wait_for(lambda: any(p.calls for p in fc.prefills), what="prefill call")
            victim, survivor = fc.prefills if fc.prefills[0].calls else fc.prefills[::-1]
            survivor.b.hang = False
            victim.unhealthy = "no scheduler step finished for 61s with work pending"
            c = await task
            assert c.token_ids == expected_tokens([5, 6, 7], 3) and c.metrics.retries == 1
            assert c.metrics.prefill_worker == survivor.worker_id
            assert asyncio.get_running_loop().time() - t0 < 5
            await fc.wait_for(lambda: victim.aborts, what="abort sent to the stalled worker")
    run(go())


def test_client_cancel_mid_stream_aborts_on_both_workers():
    async def go():
        async with FakeCluster(1, 1) as fc:
            d, p = fc.decodes[0], fc.prefills[0]
            d.b.delay_s = 0.05
            call = fc.client.call(token_ids=[5, 6, 7], max_tokens=200, request_id="cx")
            n = 0
            async for _ in call:
                n += 1
                if n == 3:
                    assert d.pages_free < d.pages_total
                    call.cancel()
                    break
            await fc.wait_for(lambda: d.pages_free == d.pages_total and d.streams == 0, what="decode pages freed")
            await fc.wait_for(lambda: d.aborts and p.aborts, what="Abort sent to both workers")
            assert d.aborts[0].startswith("cx.") and p.aborts[0] == d.aborts[0]
    run(go())


def test_client_cancel_during_prefill_aborts_both():
    async def go():
        async with FakeCluster(1, 1) as fc:
            d, p = fc.decodes[0], fc.prefills[0]
            p.b.hang = True
            call = fc.client.call(token_ids=[5, 6, 7], max_tokens=5)
            task = asyncio.ensure_future(call.read())
            await fc.wait_for(lambda: p.calls, what="prefill call")
            call.cancel()
            await fc.wait_for(lambda: d.aborts and p.aborts and d.pages_free == d.pages_total, what="aborts")
            assert p.running == 0
            with pytest.raises(asyncio.CancelledError):
                await task
    run(go())


def test_deadline_is_propagated_and_pages_freed():
    async def go():
        async with FakeCluster(1, 1) as fc:
            d = fc.decodes[0]
            d.b.delay_s = 0.1
            e = await rpc_error(fc.client.generate(token_ids=[5, 6, 7], max_tokens=200, timeout_s=0.5))
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await fc.wait_for(lambda: d.pages_free == d.pages_total and d.streams == 0, what="pages freed")
            await fc.wait_for(lambda: d.aborts and fc.prefills[0].aborts, what="aborts")
    run(go())


def test_request_deadline_during_a_slow_decode_is_deadline_exceeded_not_a_stall():
    """The router's own budget (request_timeout_s) ends while it waits for the next chunk. uvloop's timers
    fire up to ~1 ms early (whole milliseconds), so the clock may still show time left when the wait
    ends: that must still be DEADLINE_EXCEEDED, not a "stalled" decode worker suspended and failed over
    (UNAVAILABLE). Before the fix ~1 in 5 of these requests came back UNAVAILABLE."""
    import uvloop

    async def go():
        async with FakeCluster(1, 1, request_timeout_s=0.1, decode_stall_timeout_s=30.0) as fc:
            d = fc.decodes[0]
            d.b.delay_s = 5.0
            w = fc.registry.workers[f"decode/{d.address}"]
            for i in range(25):
                fc.router.core.cfg = dataclasses.replace(fc.router.core.cfg, request_timeout_s=0.05 + 0.003 * i)
                e = await rpc_error(fc.client.generate(token_ids=[5, 6, 7], max_tokens=50))
                assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, (i, e.code(), e.details())
                assert w.suspended_until == 0.0 and w.failures == 0 and w.healthy, (i, w.last_error)
            await fc.wait_for(lambda: d.pages_free == d.pages_total and d.streams == 0, what="pages freed")
    uvloop.run(asyncio.wait_for(go(), 60))


def test_api_key_health_and_reflection():
    async def go():
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
        from router.client import AsyncGenerationClient
        async with FakeCluster(1, 1, api_key="k-123") as fc:
            assert (await fc.client.generate(token_ids=[5], max_tokens=2)).finish_reason == "length"
            for key in (None, "wrong"):
                async with AsyncGenerationClient(fc.router.address, key) as bad:
                    e = await rpc_error(bad.generate(token_ids=[5], max_tokens=2))
                    assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.details()
                    e = await rpc_error(bad.cluster_status())
                    assert e.code() == grpc.StatusCode.UNAUTHENTICATED
            ch = fc.client.channel  # health and reflection need no key
            h = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert h.status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            resps = [r async for r in stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)]
            names = {s.name for s in resps[0].list_services_response.service}
            assert {"pdserve.v1.Generation", "pdserve.v1.Admin", "grpc.health.v1.Health"} <= names
    run(go())


def test_invalid_arguments_over_grpc():
    async def go():
        async with FakeCluster(1, 1) as fc:
            for kw in ({"token_ids": []}, {"token_ids": [VOCAB]}, {"token_ids": [5] * 300},
                       {"token_ids": [5] * 250, "max_tokens": 10}, {"token_ids": [5], "temperature": -1.0},
                       {"token_ids": [5], "top_p": 0.0}, {"prompt": "text but no tokenizer"}):
                e = await rpc_error(fc.client.generate(**kw))
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (kw, e)
            assert fc.decodes[0].calls == [] and fc.prefills[0].calls == []
    run(go())


def test_admission_limit_and_no_workers():
    async def go():
        async with FakeCluster(1, 1, max_inflight=1) as fc:
            fc.prefills[0].b.hang = True
            call = fc.client.call(token_ids=[5], max_tokens=2)
            first = asyncio.ensure_future(call.read())
            await fc.wait_for(lambda: fc.prefills[0].calls, what="first request in flight")
            e = await rpc_error(fc.client.generate(token_ids=[5], max_tokens=2))
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "in flight" in e.details()
            call.cancel()
            fc.prefills[0].b.hang = False
            with pytest.raises(asyncio.CancelledError):
                await first
            for w in fc.decodes:
                w.status_fail = True
            await fc.wait_for(lambda: not fc.registry.serving(), what="decode out of rotation")
            e = await rpc_error(fc.client.generate(token_ids=[5], max_tokens=2))
            assert e.code() == grpc.StatusCode.UNAVAILABLE and "decode" in e.details()
            h = health_pb2_grpc.HealthStub(fc.client.channel)
            st = await h.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"), timeout=5)
            assert st.status == health_pb2.HealthCheckResponse.NOT_SERVING
            for w in fc.decodes:
                w.status_fail = False
            await fc.wait_for(lambda: fc.registry.serving(), what="decode back in rotation")
            assert (await fc.client.generate(token_ids=[5], max_tokens=2)).finish_reason == "length"
    run(go())


@pytest.mark.parametrize("how", ["no answer", "says unhealthy"])
def test_unhealthy_prefill_leaves_rotation_and_comes_back(how):
    """A worker whose status poll fails, or answers healthy=False (its scheduler thread is stuck or dead
    while gRPC still answers), leaves the rotation; it comes back once its polls are good again."""
    async def go():
        async with FakeCluster(2, 1, routing="round_robin") as fc:
            a, b = fc.prefills
            if how == "no answer":
                a.status_fail = True
            else:
                a.unhealthy = "no scheduler step finished for 61s with work pending"
            await fc.wait_for(lambda: not fc.registry.workers[a.key].healthy, what="a out")
            if how == "says unhealthy":
                assert "no scheduler step finished" in fc.registry.workers[a.key].last_error
            for _ in range(4):
                assert (await fc.client.generate(token_ids=[5], max_tokens=2)).metrics.prefill_worker == "p1"
            a.status_fail, a.unhealthy = False, ""
            await fc.wait_for(lambda: fc.registry.workers[a.key].healthy, what="a back")
            seen = {(await fc.client.generate(token_ids=[5], max_tokens=2)).metrics.prefill_worker for _ in range(4)}
            assert seen == {"p0", "p1"}
            st = await fc.client.cluster_status()
            assert [w.healthy for w in st.workers] == [True, True, True]
    run(go())


def test_cache_aware_routes_a_shared_prefix_to_the_worker_holding_it():
    async def go():
        async with FakeCluster(2, 1) as fc:
            shared = list(range(2, 34))  # 8 pages of 4
            first = await fc.client.generate(token_ids=shared + [40, 41], max_tokens=2)
            holder = first.metrics.prefill_worker
            addr = next(p.key for p in fc.prefills if p.worker_id == holder)
            await fc.wait_for(lambda: fc.registry.index.num_blocks(addr) == 8, what="cache events")
            for tail in ([50, 51, 52], [60], [70, 71, 72, 73, 74]):
                c = await fc.client.generate(token_ids=shared + tail, max_tokens=2)
                assert c.metrics.prefill_worker == holder and c.usage.cached_tokens == 32
            st = await fc.client.cluster_status()
            blocks = {w.worker_id: int(w.info["router_cached_blocks"]) for w in st.workers if w.role == "prefill"}
            assert blocks[holder] == 9 and sum(blocks.values()) == 9  # the 5-token tail filled one more page
    run(go())


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_cache_aware_routes_to_the_worker_holding_the_prefix_in_its_host_or_disk_tier(tier):
    async def go():
        async with FakeCluster(2, 1) as fc:
            shared = list(range(2, 34))  # 8 pages of 4
            p = fc.prefills[0]  # the one a cold prompt's tie-break would not pick first
            await fc.wait_for(lambda: bool(p.queues), what="event stream")
            p.publish(**{f"{tier}_stored": prefix_block_hashes(shared, 4)})
            num = fc.registry.index.num_host_blocks if tier == "host" else fc.registry.index.num_disk_blocks
            await fc.wait_for(lambda: num(p.key) == 8, what=f"{tier} cache events")
            c = await fc.client.generate(token_ids=shared + [50, 51], max_tokens=2)
            assert c.metrics.prefill_worker == p.worker_id
    run(go())


def test_cache_events_resync_after_a_worker_restart():
    async def go():
        async with FakeCluster(1, 1) as fc:
            p = fc.prefills[0]
            await fc.client.generate(token_ids=list(range(2, 18)), max_tokens=2)
            await fc.wait_for(lambda: fc.registry.index.num_blocks(p.key) == 4, what="events")
            await p.stop(0)
            await fc.wait_for(lambda: fc.registry.index.num_blocks(p.key) == 0, what="blocks dropped")
            p.blocks = set(list(p.blocks)[:2])
            await p.start(p.port)
            await fc.wait_for(lambda: fc.registry.index.num_blocks(p.key) == 2, timeout_s=8, what="resync")
    run(go())


def test_local_prefill_on_a_decode_worker_that_supports_it():
    async def go():
        async with FakeCluster(1, 1, local_prefill_below=8) as fc:
            d, p = fc.decodes[0], fc.prefills[0]
            c = await fc.client.generate(token_ids=[5, 6, 7], max_tokens=4)
            assert c.token_ids == expected_tokens([5, 6, 7], 4) and c.metrics.ttft_s > 0
            assert len(d.local_prefills) == 1 and p.calls == [] and d.calls == []  # no Reserve either
            assert c.metrics.prefill_worker == c.metrics.decode_worker == "d0"
            long = list(range(2, 12))
            c = await fc.client.generate(token_ids=long, max_tokens=4)
            assert c.token_ids == expected_tokens(long, 4) and len(p.calls) == 1
            await fc.wait_for(lambda: d.pages_free == d.pages_total, what="pages freed")
            d.b.extra_info = {"local_prefill": "0"}  # a worker that says it cannot
            await fc.wait_for(lambda: not fc.registry.workers[d.key].candidate().supports_local_prefill,
                              what="status poll")
            await fc.client.generate(token_ids=[5, 6, 7], max_tokens=4)
            assert len(d.local_prefills) == 1 and len(p.calls) == 2
    run(go())


def test_text_prompt_and_text_deltas(tmp_path):
    async def go():
        from router.text import TextCodec
        model_dir = write_tokenizer(str(tmp_path))
        codec = TextCodec.from_model_dir(model_dir)
        async with FakeCluster(1, 1, model=model_dir) as fc:
            chunks = [c async for c in fc.client.stream(prompt="hello world", max_tokens=9)]
            ids = [t for c in chunks for t in c.token_ids]
            assert ids == expected_tokens(codec.encode("hello world"), 9)
            assert "".join(c.text for c in chunks) == codec.decode(ids)
            assert chunks[-1].usage.prompt_tokens == len(codec.encode("hello world"))
    run(go())


@pytest.mark.parametrize("max_failovers,needle", [(0, "failover budget (0) is spent"),
                                                  (1, "no healthy decode worker")])
def test_decode_lost_mid_stream_without_a_spare_is_unavailable(max_failovers, needle):
    """A decode worker that dies mid-stream: with no budget, or no other decode worker, the client gets
    UNAVAILABLE with the reason (never a hang), after the tokens already streamed."""
    async def go():
        async with FakeCluster(1, 1, max_failovers=max_failovers) as fc:
            fc.decodes[0].b.delay_s = 0.05
            got = []
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for chunk in fc.client.call(token_ids=[5, 6, 7], max_tokens=60, ignore_eos=True):
                    got += chunk.token_ids
                    if len(got) >= 3 and fc.decodes[0].server is not None:
                        await fc.decodes[0].stop(0)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and needle in e.value.details(), e.value
            assert got == expected_tokens([5, 6, 7], 60, ignore_eos=True)[:len(got)]
    run(go())


@pytest.mark.parametrize("enabled", [False, True])
def test_inject_fault_is_refused_unless_enabled_and_goes_to_the_busiest_prefill_worker(enabled):
    """Admin.InjectFault (``pdserve bench --fault drop-kv``) is off unless the router runs with
    --fault-injection; on, it forwards drop-kv to the prefill worker with the most calls in flight (or the
    one named), and refuses other kinds and unknown workers with the reason."""
    from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc

    async def go():
        async with FakeCluster(2, 1, fault_injection=enabled) as fc:
            async with grpc.aio.insecure_channel(fc.router.address) as ch:
                admin = generation_pb2_grpc.AdminStub(ch)
                req = generation_pb2.InjectFaultRequest(kind="drop-kv", count=2)
                if not enabled:
                    e = await rpc_error(admin.InjectFault(req, timeout=5))
                    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "--fault-injection" in e.details()
                    assert fc.prefills[0].faults == fc.prefills[1].faults == []
                    return
                busy = fc.registry.workers[fc.prefills[1].key]
                busy.inflight += 1
                r = await admin.InjectFault(req, timeout=5)
                busy.inflight -= 1
                assert (r.worker_id, r.armed) == ("p1", 2) and fc.prefills[1].faults == [("drop-kv", 2)]
                r = await admin.InjectFault(generation_pb2.InjectFaultRequest(kind="drop-kv", worker_id="p0"),
                                            timeout=5)
                assert r.worker_id == "p0" and fc.prefills[0].faults == [("drop-kv", 0)]
                for bad, code in ((generation_pb2.InjectFaultRequest(kind="kill-decode"), "INVALID_ARGUMENT"),
                                  (generation_pb2.InjectFaultRequest(kind="drop-kv", worker_id="p9"), "NOT_FOUND")):
                    e = await rpc_error(admin.InjectFault(bad, timeout=5))
                    assert e.code().name == code and e.details(), e
    run(go())


def test_next_turn_goes_to_the_decode_worker_holding_the_session():
    """Decode routing by residency: a session's next turn is reserved on the decode worker whose prefix cache
    holds its last turn (its cache events), which answers the resident tokens (not shipped: the metrics say
    so), at equal load and at a load up to the residency credit above the others; with residency off, least
    load alone decides."""
    async def go():  # a page of resident tokens is worth a request of load: a stale status's one is outweighed
        async with FakeCluster(1, 2, decode_residency_tokens=PAGE) as fc:
            prompt = list(range(3, 3 + 40))
            first = [c async for c in fc.client.stream(token_ids=prompt, max_tokens=9)]
            home = first[-1].metrics.decode_worker
            holder = next(d for d in fc.decodes if d.worker_id == home)
            turn2 = prompt + [t for c in first for t in c.token_ids] + [7] * 5
            await fc.wait_for(lambda: fc.registry.decode_index.num_blocks(holder.key) > 0, what="decode cache events")
            for i in range(3):  # the other worker is just as idle: residency decides
                chunks = [c async for c in fc.client.stream(token_ids=turn2, max_tokens=4)]
                m = chunks[-1].metrics
                held = 40 + 9 if i == 0 else len(turn2)  # the last turn's tokens (then the same prompt's)
                assert m.decode_worker == home and m.decode_resident_tokens == (held - 1) // PAGE * PAGE
            other = next(d for d in fc.decodes if d is not holder)
            order = [c.worker_id for c in _order(fc, turn2, loads={holder.key: 2})]
            assert order[0] == holder.key  # 52 resident tokens are worth 2 requests of load at most ...
            order = [c.worker_id for c in _order(fc, turn2, loads={holder.key: 3})]
            assert order[0] == other.key  # ... not 3
            order = [c.worker_id for c in _order(fc, turn2, loads={other.key: 1}, tokens_per_load=0)]
            assert order[0] == holder.key  # residency off: least load alone (the holder has none here)
    run(go())


def _order(fc, prompt, loads, tokens_per_load=PAGE):
    reg = fc.registry
    keys = [d.key for d in fc.decodes]
    resident = {k: n * PAGE for k, n in reg.decode_index.match(PromptHashes(prompt, PAGE), keys).items()}
    cands = [Candidate(k, loads.get(k, 0), pages_free=64, pages_total=64) for k in keys]
    return order_decode(cands, 4, resident, tokens_per_load, 2.0)
