"""Issue 25, item 2: one big request must not freeze the router. Over real gRPC against in-process fakes.

A text prompt is bounded in bytes by the context before it is tokenized, the public port's message limit
follows from the same bound, tokenization runs off the event loop, and stop conditions are capped.
"""
import asyncio
import functools
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import rpc
from router.validate import (MAX_STOP_STRING_LEN, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TEXT_BYTES_PER_TOKEN,
                             REQUEST_OVERHEAD_BYTES)
from router_fakes import MAX_CONTEXT, FakeCluster, rpc_error, run_bounded, write_tokenizer


run = functools.partial(run_bounded, timeout_s=60.0)



class EncodeSpy:
    """Wraps the router's real tokenizer: counts calls and says whether one is running."""

    def __init__(self, codec) -> None:
        self.real, self.calls = codec.encode, 0
        self.started, self.finished = threading.Event(), threading.Event()
        codec.encode = self

    def __call__(self, text: str) -> list[int]:
        self.calls += 1
        self.started.set()
        try:
            return self.real(text)
        finally:
            self.finished.set()


def limited_cluster(tmp_path, max_context: int = MAX_CONTEXT) -> FakeCluster:
    fc = FakeCluster(1, 1, model=write_tokenizer(str(tmp_path)))
    for w in fc.prefills + fc.decodes:
        w.b.extra_info["max_context"] = str(max_context)
    return fc


def test_text_over_the_context_bound_is_refused_without_tokenizing(tmp_path):
    async def go():
        async with limited_cluster(tmp_path) as fc:
            bound = MAX_CONTEXT * MAX_TEXT_BYTES_PER_TOKEN
            assert fc.router.max_request_bytes == bound + REQUEST_OVERHEAD_BYTES
            spy = EncodeSpy(fc.router.core.codec)
            e = await rpc_error(fc.client.generate(prompt="é" * (bound // 2 + 1)))  # 2 bytes a character
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and f"at most {bound} UTF-8 bytes" in e.details()
            # beyond the message limit gRPC itself refuses the message: no handler, no tokenizer
            e = await rpc_error(fc.client.generate(prompt="a" * (bound + REQUEST_OVERHEAD_BYTES + 1)))
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in e.details(), e.details()
            assert spy.calls == 0
            e = await rpc_error(fc.client.generate(prompt="hello " * (bound // 6)))  # within the bound: tokenized
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "longer than the context" in e.details()
            assert spy.calls == 1
            ok = await fc.client.generate(prompt="hello world", max_tokens=3)
            assert ok.finish_reason == "length"
            d = fc.decodes[0]
            await fc.wait_for(lambda: d.pages_free == d.pages_total, what="decode pages freed")
    run(go())


def test_tokenizing_a_long_text_does_not_stall_the_event_loop(tmp_path):
    """The old router tokenized on its event loop: a 16 MiB text froze health checks and every stream."""
    async def go():
        async with limited_cluster(tmp_path, max_context=1_000_000) as fc:
            spy = EncodeSpy(fc.router.core.codec)
            text = "hello world, the water of time " * ((1 << 20) // 31) # 1 MiB, ~0.5M tokens, ~1 s to tokenize
            big = asyncio.ensure_future(fc.client.generate(prompt=text, max_tokens=4))
            while not spy.started.is_set():
                await asyncio.sleep(0.001)
            async with grpc.aio.insecure_channel(fc.router.address) as ch:
                r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            answered_while_tokenizing = not spy.finished.is_set()
            assert r.status == health_pb2.HealthCheckResponse.SERVING
            assert answered_while_tokenizing, "the health check waited for the tokenizer"
            e = await rpc_error(big)  # ~135k pages wanted, 64 in the fake pool
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            d = fc.decodes[0]
            await fc.wait_for(lambda: d.pages_free == d.pages_total, what="decode pages freed")
    run(go())


@pytest.mark.parametrize("kw,needle", [
    ({"stop_token_ids": [7] * (MAX_STOP_TOKEN_IDS + 1)}, f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, f"at most {MAX_STOP_STRINGS} stop strings"),
    ({"stop": ["x" * (MAX_STOP_STRING_LEN + 1)]}, f"1..{MAX_STOP_STRING_LEN} characters"),
])
def test_stop_conditions_are_capped(kw, needle):
    async def go():
        async with FakeCluster(1, 1) as fc:
            for w in fc.prefills + fc.decodes:
                w.b.extra_info["has_tokenizer"] = "1"  # stop strings need the workers' tokenizer
            await fc.wait_for(lambda: fc.registry.model_info().has_tokenizer, what="the next health poll")
            e = await rpc_error(fc.client.generate(token_ids=[5, 6], max_tokens=3, **kw))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.details(), e.details()
            assert fc.decodes[0].calls == []
            n = MAX_STOP_TOKEN_IDS  # at the cap: served
            ok = await fc.client.generate(token_ids=[5, 6], max_tokens=3, stop_token_ids=[300] * n)
            assert ok.finish_reason == "length"
    run(go())


def test_the_message_limit_comes_from_the_model_dir_when_no_worker_answers(tmp_path):
    """A router with discovery (pdserve launch) starts before its workers: --model's config.json sizes it."""
    async def go():
        from router.config import RouterConfig
        from router.server import RouterServer
        (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
        for model, want in ((str(tmp_path), 4096 * MAX_TEXT_BYTES_PER_TOKEN + REQUEST_OVERHEAD_BYTES),
                            (None, rpc.MAX_MESSAGE_BYTES)):
            srv = RouterServer(RouterConfig(port=0, prefill=("127.0.0.1:9",), decode=("127.0.0.1:9",), model=model,
                                            health_timeout_s=0.2))
            await srv.start()
            try:
                assert srv.max_request_bytes == want
            finally:
                await srv.stop()
    run(go())
