"""An in-process fake of the public API (grpc.aio, its own event loop in a thread) for the bench's tests.

It streams ``max_tokens`` tokens with controlled delays, keeps a page-granular prefix cache so
``usage.cached_tokens`` behaves like a real prefill worker's, and fails chosen requests: every
``fail_every``-th one (by the bench's request index) with RESOURCE_EXHAUSTED before any token, every
``error_every``-th one with a stream that ends in finish_reason "error". With ``slots`` it serves that many
requests at a time and queues the rest (a server with a capacity: past it, TTFT grows with the queue).
The tokens it returns vary with the request and the position (``fake_token``), so a client that sends them back
(the agentic workload) can be checked; with ``metrics`` its prefill worker serves the prefix cache's counters
on a ``/metrics`` port, as a real one does.
"""
from __future__ import annotations

import asyncio
import socket
import threading
from dataclasses import dataclass, field

import grpc
from aiohttp import web

from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc


@dataclass
class FakeBehaviour:
    ttft_s: float = 0.02
    """Fixed time before the first token."""
    prefill_s_per_token: float = 0.0
    """Extra time before the first token per uncached prompt token."""
    itl_s: float = 0.005
    """Gap between chunks."""
    tokens_per_chunk: int = 1
    """> 1 imitates speculative decoding (reported as accept_len)."""
    fail_every: int = 0
    """Request index i with i % fail_every == fail_every - 1 is refused with RESOURCE_EXHAUSTED (0: never)."""
    error_every: int = 0
    """Request index i with i % error_every == error_every - 1 ends with finish_reason 'error' (0: never)."""
    slots: int = 0
    """Requests served at once, each holding its slot from before its TTFT to its last token; the rest
    wait in FIFO order (0: no limit). Capacity: slots / (ttft_s + (max_tokens - 1) * itl_s) requests/s."""
    vocab_size: int = 512
    max_context: int = 65536
    page_size: int = 16
    kv_bytes_per_token: int = 1000
    api_key: str | None = None
    decode_reuse: bool = False
    """Imitate decode-side prefix reuse: a finished request's prompt + output but its last token stay resident
    (whole pages); the next prompt's resident prefix (at least one token short) is reported in
    ``metrics.decode_resident_tokens`` and left out of ``kv_transfer_bytes``."""
    metrics: bool = False
    """Serve a prefill worker's /metrics (prefix cache queries and hit tokens by tier, as ``prefill/server.py``
    names them) on a loopback port the fake prefill worker lists as its ``metrics_port``."""


@dataclass
class FakeLog:
    seen: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    errored: list[str] = field(default_factory=list)
    prompts: dict[str, list[int]] = field(default_factory=dict)


class PageCache:
    """Longest cached page-aligned prefix; every full page of a prompt is cached after it is seen."""

    def __init__(self, page: int) -> None:
        self.page, self.keys = page, set()
        self.query_tokens = self.hit_tokens = 0

    def match(self, ids: list[int]) -> int:
        """The cached prefix of ``ids`` in tokens (nothing inserted, nothing counted)."""
        hit = 0
        while hit < len(ids) // self.page and tuple(ids[:(hit + 1) * self.page]) in self.keys:
            hit += 1
        return hit * self.page

    def match_and_insert(self, ids: list[int]) -> int:
        pages = len(ids) // self.page
        hit = 0
        while hit < pages and tuple(ids[:(hit + 1) * self.page]) in self.keys:
            hit += 1
        for k in range(hit + 1, pages + 1):
            self.keys.add(tuple(ids[:k * self.page]))
        self.query_tokens += len(ids)
        self.hit_tokens += hit * self.page
        return hit * self.page

    def exposition(self) -> str:
        """What a prefill worker with a host tier exports (``prefill/tier_metrics.py``); this cache has none."""
        w = 'worker="fake-prefill"'
        return (f"# TYPE pdserve:prefix_cache_queries_total counter\n"
                f"pdserve:prefix_cache_queries_total{{{w}}} {self.query_tokens}\n"
                f"# TYPE pdserve:prefix_cache_hit_tokens_total counter\n"
                f'pdserve:prefix_cache_hit_tokens_total{{{w},tier="device"}} {self.hit_tokens}\n'
                f'pdserve:prefix_cache_hit_tokens_total{{{w},tier="host"}} 0\n')


def fake_token(index: int, position: int, vocab_size: int = 512) -> int:
    """The token the fake returns at ``position`` of request ``index``'s output (it varies, as an answer does)."""
    return 2 + (index * 31 + position * 7) % (vocab_size - 2)


def _index(req_id: str) -> int:
    tail = req_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


class FakeGeneration(generation_pb2_grpc.GenerationServicer):
    def __init__(self, b: FakeBehaviour, log: FakeLog) -> None:
        self.b, self.log, self.cache = b, log, PageCache(b.page_size)
        self.decode_cache = PageCache(b.page_size)  # decode_reuse: what the decode worker keeps
        self.slots = asyncio.Semaphore(b.slots) if b.slots else None

    async def Generate(self, request, context):
        if self.slots is None:
            async for resp in self._generate(request, context):
                yield resp
            return
        async with self.slots:
            async for resp in self._generate(request, context):
                yield resp

    async def _generate(self, request, context):
        b, req_id = self.b, request.request_id
        if b.api_key and dict(context.invocation_metadata()).get("authorization") != f"Bearer {b.api_key}":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "fake: wrong API key")
        self.log.seen.append(req_id)
        i = _index(req_id)
        if b.fail_every and i % b.fail_every == b.fail_every - 1:
            self.log.rejected.append(req_id)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "fake: queue full")
        ids = list(request.token_ids.ids) if request.HasField("token_ids") else \
            [hash(w) % b.vocab_size for w in request.text.split()]
        self.log.prompts[req_id] = ids
        cached = self.cache.match_and_insert(ids)
        resident = self.decode_cache.match(ids[:-1]) if b.decode_reuse else 0
        await asyncio.sleep(b.ttft_s + b.prefill_s_per_token * (len(ids) - cached))
        n_out, sent = request.sampling.max_tokens, 0
        errors = b.error_every and i % b.error_every == b.error_every - 1
        while sent < n_out:
            k = min(b.tokens_per_chunk, n_out - sent)
            sent += k
            resp = generation_pb2.GenerateResponse(request_id=req_id, token_ids=[fake_token(i, j) for j in
                                                                                 range(sent - k, sent)])
            if errors and sent >= 2:
                self.log.errored.append(req_id)
                resp.finish_reason = "error"
                yield resp
                return
            if sent == n_out:
                resp.finish_reason = "length"
                resp.usage.prompt_tokens, resp.usage.cached_tokens = len(ids), cached
                resp.usage.completion_tokens = n_out
                m = resp.metrics
                m.ttft_s, m.prefill_s, m.kv_transfer_s = b.ttft_s, b.ttft_s, 0.001
                m.kv_transfer_bytes = b.kv_bytes_per_token * (len(ids) - resident)
                m.decode_resident_tokens = resident
                if b.decode_reuse:
                    self.decode_cache.match_and_insert((ids + [fake_token(i, j) for j in range(n_out)])[:-1])
                m.accept_len = float(b.tokens_per_chunk) if b.tokens_per_chunk > 1 else 0.0
            yield resp
            if sent < n_out:
                await asyncio.sleep(b.itl_s)


class FakeAdmin(generation_pb2_grpc.AdminServicer):
    def __init__(self, b: FakeBehaviour) -> None:
        self.b = b
        self.metrics_port = 0

    async def GetClusterStatus(self, request, context):
        info = {"vocab_size": str(self.b.vocab_size), "max_context": str(self.b.max_context), "page_size": str(self.b.page_size)}
        prefill_info = {**info, "metrics_port": str(self.metrics_port)} if self.metrics_port else info
        return generation_pb2.ClusterStatus(model="fake", workers=[
            generation_pb2.WorkerStatus(worker_id="fake-prefill", role="prefill", healthy=True, info=prefill_info,
                                        address="127.0.0.1:1"),
            generation_pb2.WorkerStatus(worker_id="fake-decode", role="decode", healthy=True, info=info)])


class FakeServer:
    """``with FakeServer(FakeBehaviour(...)) as srv: srv.address`` - a live server on loopback."""

    def __init__(self, behaviour: FakeBehaviour | None = None) -> None:
        self.behaviour = behaviour or FakeBehaviour()
        self.log = FakeLog()
        self.address = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: grpc.aio.Server | None = None
        self._metrics: web.AppRunner | None = None

    async def _start(self) -> str:
        self._server = grpc.aio.server()
        gen, admin = FakeGeneration(self.behaviour, self.log), FakeAdmin(self.behaviour)
        generation_pb2_grpc.add_GenerationServicer_to_server(gen, self._server)
        generation_pb2_grpc.add_AdminServicer_to_server(admin, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        if self.behaviour.metrics:
            app = web.Application()
            app.router.add_get("/metrics", lambda _: web.Response(text=gen.cache.exposition()))
            self._metrics = web.AppRunner(app)
            await self._metrics.setup()
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            await web.SockSite(self._metrics, sock).start()  # the site owns the socket from here
            admin.metrics_port = sock.getsockname()[1]
        return f"127.0.0.1:{port}"

    async def _stop(self) -> None:
        await self._server.stop(grace=0.5)
        if self._metrics is not None:
            await self._metrics.cleanup()

    def __enter__(self) -> "FakeServer":
        self._thread.start()
        self.address = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
