"""In-process fake prefill/decode workers for the router's unit tests (real gRPC on loopback, fake model).

The fake model: first token = 10 + sum(prompt) % 40, then each token is the previous + 1 (wrapping in
[10, 90)); a prompt starting with ``EOS_TRIGGER`` makes the first token EOS (1). Prefill publishes its
blocks as cache events with the real ``engine.kvcache.radix`` block hashes, and reports cached tokens for blocks
it already held. Decode pages are tracked per request so tests can check every page comes back.
"""
from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass, field

import grpc
import pytest

from engine.kvcache.radix import prefix_block_hashes
from protos import rpc
from protos.pdserve.v1 import generation_pb2, worker_pb2, worker_pb2_grpc

VOCAB, MAX_CONTEXT, PAGE, EOS, EOS_TRIGGER = 400, 256, 4, 1, 99


def run_bounded(coro, timeout_s: float):
    """Run ``coro`` in a fresh event loop and fail it after ``timeout_s``: a router test never hangs."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def rpc_error(awaitable) -> grpc.aio.AioRpcError:
    """The ``AioRpcError`` that ``awaitable`` must raise."""
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await awaitable
    return e.value

def info(**extra) -> dict[str, str]:
    return {"vocab_size": str(VOCAB), "max_context": str(MAX_CONTEXT), "page_size": str(PAGE),
            "eos_token_ids": str(EOS), "model_dir": "", "has_tokenizer": "0", **extra}


def expected_tokens(prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
    out = [first_token(prompt)]
    while len(out) < max_tokens and (ignore_eos or out[-1] != EOS):
        out.append(next_token(out[-1]))
    return out


def first_token(prompt: list[int]) -> int:
    return EOS if prompt[0] == EOS_TRIGGER else 10 + sum(prompt) % 40


def next_token(t: int) -> int:
    return 10 if t == EOS else 10 + (t - 10 + 1) % 80


@dataclass
class Behaviour:
    delay_s: float = 0.0
    """Prefill: time per request; decode: time per chunk."""
    fail_code: grpc.StatusCode | None = None
    """Answer every data call (Reserve/Prefill) with this status."""
    hang: bool = False
    """Prefill never answers (until cancelled)."""
    decode_code: grpc.StatusCode | None = None
    """Decode: refuse the stream with this status (after the reservation was granted)."""
    decode_error: str = ""
    """Decode: end the stream after the first chunk with finish_reason "error" and this message."""
    extra_info: dict = field(default_factory=dict)
    local_full: str = ""
    """Decode: refuse a local prefill with RESOURCE_EXHAUSTED and this message, before any token (a full worker)."""


class FakeWorker:
    role = ""

    def __init__(self, worker_id: str, secret: str | None = None) -> None:
        self.worker_id, self.secret = worker_id, secret
        self.b = Behaviour()
        self.aborts: list[str] = []
        self.calls: list[str] = []
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.status_fail = False
        self.unhealthy = ""
        """Answer GetStatus with healthy=False and this reason (a worker whose scheduler is stuck)."""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def key(self) -> str:
        """The router's key for this worker."""
        return f"{self.role}/{self.address}"

    async def start(self, port: int = 0) -> str:
        self.server = rpc.make_server(self.secret)
        self._add(self.server)
        hs = rpc.add_health_and_reflection(self.server, [self.service])
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port or self.port}")
        await self.server.start()
        await rpc.set_serving(hs, [self.service])
        return self.address

    async def stop(self, grace: float | None = None) -> None:
        if self.server is not None:
            await self.server.stop(grace)
            self.server = None

    async def GetStatus(self, request, context):
        if self.status_fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake: status down")
        st = self.status()
        if self.unhealthy:
            st.healthy = False
            st.info["unhealthy"] = self.unhealthy
        return st


class CacheEventsFake:
    """A worker's prefix-cache event stream (``StreamCacheEvents``, as ``worker.cache_events`` serves it): the
    current ``blocks`` as a reset, then what ``publish`` sends to every subscriber."""
    blocks: set[int]
    queues: set[asyncio.Queue]

    def publish(self, stored=(), evicted=(), reset=False, host_stored=(), disk_stored=()):
        for q in self.queues:
            q.put_nowait(worker_pb2.CacheEvent(stored=stored, evicted=evicted, reset=reset, host_stored=host_stored,
                                               disk_stored=disk_stored))

    async def StreamCacheEvents(self, request, context):
        q: asyncio.Queue = asyncio.Queue()
        self.queues.add(q)
        try:
            yield worker_pb2.CacheEvent(reset=True, stored=sorted(self.blocks))
            while True:
                yield await q.get()
        finally:
            self.queues.discard(q)


class FakePrefill(FakeWorker, CacheEventsFake, worker_pb2_grpc.PrefillWorkerServicer):
    role, service = "prefill", "pdserve.v1.PrefillWorker"

    def __init__(self, worker_id: str, decoders: dict[str, "FakeDecode"], secret: str | None = None) -> None:
        super().__init__(worker_id, secret)
        self.decoders = decoders
        """decode worker id -> fake, to fill reservations named in tickets."""
        self.blocks: set[int] = set()
        self.queues: set[asyncio.Queue] = set()
        self.running = 0
        self.faults: list[tuple[str, int]] = []

    def _add(self, server):
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(self, server)

    def status(self):
        return generation_pb2.WorkerStatus(worker_id=self.worker_id, role="prefill", healthy=True,
                                           running=self.running, pages_total=64, pages_free=64, model_hash="m",
                                           info={**info(), "pages_owned_by_requests": str(self.running),
                                                 **self.b.extra_info})

    async def InjectFault(self, request, context):
        self.faults.append((request.kind, request.count))
        return generation_pb2.InjectFaultResponse(worker_id=self.worker_id, address=self.address,
                                                  armed=sum(n or 1 for _, n in self.faults))

    async def Prefill(self, request, context):
        self.calls.append(request.request_id)
        if self.b.fail_code is not None:
            await context.abort(self.b.fail_code, f"fake prefill {self.worker_id} fails")
        ticket = json.loads(request.ticket.ticket)
        dec = self.decoders[ticket["worker"]]
        self.running += 1
        try:
            if self.b.hang:
                await asyncio.sleep(3600)
            await asyncio.sleep(self.b.delay_s)
        finally:
            self.running -= 1
        ids = list(request.token_ids)
        hashes = prefix_block_hashes(ids, PAGE)
        cached = 0
        for h in hashes:
            if h not in self.blocks:
                break
            cached += PAGE
        new = [h for h in hashes if h not in self.blocks]
        self.blocks.update(new)
        if new:
            self.publish(stored=new)
        dec.filled.add(request.request_id)
        return worker_pb2.PrefillResponse(request_id=request.request_id, first_token=first_token(ids),
                                          cached_tokens=cached, prefill_s=0.001, transfer_bytes=123,
                                          first_logprob=generation_pb2.TokenLogprob(token_id=first_token(ids),
                                                                                    logprob=-0.5))

    async def Abort(self, request, context):
        self.aborts.append(request.request_id)
        return worker_pb2.AbortResponse(found=False)


class FakeDecode(FakeWorker, CacheEventsFake, worker_pb2_grpc.DecodeWorkerServicer):
    role, service = "decode", "pdserve.v1.DecodeWorker"

    def __init__(self, worker_id: str, secret: str | None = None, pages_total: int = 64) -> None:
        super().__init__(worker_id, secret)
        self.pages_total = pages_total
        self.reserved: dict[str, int] = {}
        """request id -> pages held (reservation, then decoding)"""
        self.filled: set[str] = set()
        self.streams = 0
        self.local_prefills: list[str] = []
        self.blocks: set[int] = set()
        """Its prefix cache (decode-side reuse): block hashes of finished requests' full pages (prompt + output
        but the last token), published as cache events like ``decode.server``'s."""
        self.queues: set[asyncio.Queue] = set()
        self.resident: dict[str, int] = {}
        """request id -> the resident tokens its reservation answered"""

    def _add(self, server):
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(self, server)

    @property
    def pages_free(self) -> int:
        # never below 0: a test's squatter (``reserved``) can come while the streams' grown reservations
        # already fill the pool (the status field is unsigned: -3 broke GetStatus and took d0 out of rotation)
        return max(0, self.pages_total - sum(self.reserved.values()))

    def status(self):
        return generation_pb2.WorkerStatus(worker_id=self.worker_id, role="decode", healthy=True,
                                           running=self.streams, pages_total=self.pages_total,
                                           pages_free=self.pages_free, model_hash="m",
                                           info={**info(), **self.b.extra_info})

    async def Reserve(self, request, context):
        self.calls.append(request.request_id)
        if self.b.fail_code is not None:
            await context.abort(self.b.fail_code, f"fake decode {self.worker_id} fails")
        resident = 0  # the longest cached prefix, whole pages, at least one token short (as decode.admission)
        for h in prefix_block_hashes(list(request.prompt_ids)[:request.num_tokens - 1], PAGE):
            if h not in self.blocks:
                break
            resident += PAGE
        need = math.ceil((request.num_tokens - resident) / PAGE)
        if need > self.pages_free:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"need {need} pages, {self.pages_free} free")
        self.reserved[request.request_id] = need
        self.resident[request.request_id] = resident
        t = json.dumps({"worker": self.worker_id, "rid": request.request_id}).encode()
        return worker_pb2.ReserveResponse(ticket=worker_pb2.TransferTicket(request_id=request.request_id,
                                                                           target="fake", ticket=t,
                                                                           resident_tokens=resident))

    def keep(self, seq: list[int]) -> None:
        """A finished request's pages into the prefix cache (published)."""
        new = [h for h in prefix_block_hashes(seq[:-1], PAGE) if h not in self.blocks]
        self.blocks.update(new)
        self.publish(stored=new)

    async def Decode(self, request, context):
        req_id, sp = request.request_id, request.sampling
        out = list(request.output_prefix)
        if request.local_prefill and self.b.local_full:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.b.local_full)
        if request.local_prefill:  # conditional disaggregation: no reservation, prefill here
            need = math.ceil((len(request.prompt_ids) + 1) / PAGE)
            if need > self.pages_free:  # as decode.server: refused before any token, nothing held
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"need {need} pages, {self.pages_free} free")
            self.local_prefills.append(req_id)
            self.reserved[req_id] = need
            out = [first_token(list(request.prompt_ids))]
            yield worker_pb2.DecodeChunk(token_ids=out)
        elif req_id not in self.reserved:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no reservation for {req_id}")
        elif req_id not in self.filled:
            self.reserved.pop(req_id, None)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV for {req_id} never arrived")
        if self.b.decode_code is not None:
            self.reserved.pop(req_id, None)
            await context.abort(self.b.decode_code, f"fake decode {self.worker_id} refuses the stream")
        self.streams += 1
        try:
            if self.b.decode_error:
                yield worker_pb2.DecodeChunk(token_ids=[next_token(out[-1])])
                yield worker_pb2.DecodeChunk(finish_reason="error", message=self.b.decode_error)
                return
            while True:
                last = out[-1]
                if last in sp.stop_token_ids or (last == EOS and not sp.ignore_eos):
                    yield worker_pb2.DecodeChunk(finish_reason="stop")
                    return
                if len(out) >= sp.max_tokens:
                    self.keep(list(request.prompt_ids) + out)
                    yield worker_pb2.DecodeChunk(finish_reason="length")
                    return
                await asyncio.sleep(self.b.delay_s)
                new: list[int] = []
                while len(new) < 2 and len(out) < sp.max_tokens and out[-1] not in sp.stop_token_ids:
                    out.append(next_token(out[-1]))
                    new.append(out[-1])
                self.reserved[req_id] = math.ceil((len(request.prompt_ids) + len(out)) / PAGE)
                yield worker_pb2.DecodeChunk(token_ids=new, accept_len=float(len(new)))
        finally:
            self.streams -= 1
            self.reserved.pop(req_id, None)
            self.filled.discard(req_id)

    async def Abort(self, request, context):
        self.aborts.append(request.request_id)
        found = self.reserved.pop(request.request_id, None) is not None
        return worker_pb2.AbortResponse(found=found)


class FakeCluster:
    """``async with FakeCluster(2, 1) as fc:`` fake workers + a real ``RouterServer`` + an async client."""

    def __init__(self, num_prefill: int = 1, num_decode: int = 1, secret: str | None = "fake-secret",
                 api_key: str | None = None, decode_pages: int = 64, **cfg) -> None:
        self.decodes = [FakeDecode(f"d{i}", secret, decode_pages) for i in range(num_decode)]
        by_id = {d.worker_id: d for d in self.decodes}
        self.prefills = [FakePrefill(f"p{i}", by_id, secret) for i in range(num_prefill)]
        self.secret, self.api_key, self.cfg_overrides = secret, api_key, cfg

    async def __aenter__(self) -> "FakeCluster":
        from router.client import AsyncGenerationClient
        from router.config import RouterConfig
        from router.server import RouterServer
        for w in self.decodes + self.prefills:
            await w.start()
        cfg = RouterConfig(**{"port": 0, "prefill": tuple(p.address for p in self.prefills),
                              "decode": tuple(d.address for d in self.decodes), "cluster_secret": self.secret,
                              "api_key": self.api_key, "health_interval_s": 0.1, "health_timeout_s": 0.5,
                              "rpc_timeout_s": 2.0, **self.cfg_overrides})
        self.router = RouterServer(cfg)
        await self.router.start()
        await self.router.core.registry.wait_first_poll(5.0)
        self.client = AsyncGenerationClient(self.router.address, self.api_key, timeout_s=20)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()
        await self.router.stop()
        for w in self.decodes + self.prefills:
            await w.stop(0)

    @property
    def registry(self):
        return self.router.core.registry

    async def wait_for(self, cond, timeout_s: float = 5.0, what: str = "condition") -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not cond():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.02)


TOKENIZER_TEXT = ["héllo wörld, 日本語 text ✓ done", "the quick brown fox jumps over the lazy dog",
                  "hello hello world world text text"] * 20


def write_tokenizer(model_dir: str, vocab_size: int = 300) -> str:
    """A small byte-level BPE ``tokenizer.json`` (ids < ``vocab_size``) in ``model_dir``; returns the dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TOKENIZER_TEXT, trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(f"{model_dir}/tokenizer.json")
    return model_dir
