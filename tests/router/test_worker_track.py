"""``Worker.track(call)`` over real gRPC against a fake prefill worker: the in-flight count is taken with the
call and is back to 0 the moment the call's outcome reaches its caller, whether it answered, failed, ran past
its deadline or was cancelled by the client; a ``Span`` of calls releases its count once, when it ends."""
import asyncio
import json

import grpc
import pytest

from common.reasons import Role
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from router.registry import Span, Worker
from router_fakes import FakeDecode, FakePrefill, run_bounded, rpc_error


async def with_worker(test) -> None:
    """Run ``test(fake, worker)`` with a fake prefill worker (no secret) and the router's ``Worker`` for it."""
    dec = FakeDecode("d0", None)
    fake = FakePrefill("p0", {"d0": dec}, None)
    await fake.start()
    channel = grpc.aio.insecure_channel(fake.address)
    try:
        await test(fake, Worker(Role.PREFILL, fake.address, channel, worker_pb2_grpc.PrefillWorkerStub(channel)))
    finally:
        await channel.close()
        await fake.stop(0)


def prefill(w: Worker, timeout_s: float = 10.0):
    req = worker_pb2.PrefillRequest(request_id="r1", token_ids=[2, 3, 4], ticket=worker_pb2.TransferTicket(
        request_id="r1", target="fake", ticket=json.dumps({"worker": "d0"}).encode()))
    return w.track(w.stub.Prefill(req, timeout=timeout_s))


def test_the_count_is_back_when_the_call_answers_or_fails():
    async def test(fake: FakePrefill, w: Worker) -> None:
        call = prefill(w)
        assert w.inflight == 1
        assert (await call).first_token > 0
        assert w.inflight == 0
        fake.b.fail_code = grpc.StatusCode.INVALID_ARGUMENT
        calls = [prefill(w) for _ in range(3)]
        assert w.inflight == 3
        for call in calls:
            assert (await rpc_error(call)).code() == grpc.StatusCode.INVALID_ARGUMENT
        assert w.inflight == 0
    run_bounded(with_worker(test), 30)


def test_the_count_is_back_after_a_deadline_and_a_client_cancel():
    async def test(fake: FakePrefill, w: Worker) -> None:
        fake.b.hang = True
        assert (await rpc_error(prefill(w, timeout_s=0.05))).code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert w.inflight == 0
        while fake.running:  # the worker's side of that call ends too
            await asyncio.sleep(0.01)
        call = prefill(w)
        waiting = asyncio.ensure_future(call)
        while not fake.running:  # the worker has the call
            await asyncio.sleep(0.01)
        assert w.inflight == 1
        waiting.cancel()  # the client gives up: the awaiting task is cancelled
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert w.inflight == 0 and call.cancelled()
        cancelled_early = prefill(w)
        cancelled_early.cancel()  # before the worker saw it
        assert w.inflight == 0
        while fake.running:  # the worker's side of the call ends too
            await asyncio.sleep(0.01)
    run_bounded(with_worker(test), 30)


def test_a_span_releases_its_count_once_when_it_ends():
    w = Worker(Role.DECODE, "127.0.0.1:1", channel=None, stub=None)
    spans = [w.track(Span()) for _ in range(2)]
    assert w.inflight == 2
    spans[0].end()
    spans[0].end()
    assert w.inflight == 1
    spans[1].end()
    assert w.inflight == 0
    w.track(spans[1])  # tracking a span that already ended counts nothing
    assert w.inflight == 0
