"""Python clients of the public API (what ``pdserve generate`` uses)::

    with GenerationClient("127.0.0.1:50051", api_key=KEY) as c:
        for chunk in c.stream(prompt="Hello", max_tokens=32):
            print(chunk.text, end="", flush=True)
        done = c.generate(token_ids=[1, 2, 3], max_tokens=8)     # -> Completion

    async with AsyncGenerationClient("127.0.0.1:50051") as c:
        async for chunk in c.stream(token_ids=[1, 2, 3]): ...

Server errors arrive as ``grpc.RpcError`` (``.code()``, ``.details()``); arguments the wire cannot carry
(``max_tokens < 1``, no or two prompts) raise ``ValueError`` before anything is sent.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Sequence

import grpc

from protos import rpc
from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc


@dataclass(slots=True)
class Completion:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    usage: generation_pb2.Usage = field(default_factory=generation_pb2.Usage)
    metrics: generation_pb2.RequestMetrics = field(default_factory=generation_pb2.RequestMetrics)
    logprobs: list[generation_pb2.TokenLogprob] = field(default_factory=list)
    ttft_s: float = 0.0
    """Client-side: call start -> first chunk with a token."""
    num_chunks: int = 0

    def add(self, chunk: generation_pb2.GenerateResponse, t0: float) -> None:
        if chunk.token_ids and not self.token_ids:
            self.ttft_s = time.perf_counter() - t0
        self.request_id = chunk.request_id
        self.token_ids += chunk.token_ids
        self.text += chunk.text
        self.logprobs += chunk.logprobs
        self.num_chunks += 1
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason
            self.usage, self.metrics = chunk.usage, chunk.metrics


def make_request(prompt: str | None = None, token_ids: Sequence[int] | None = None, *, max_tokens: int = 16,
                 temperature: float | None = None, top_p: float | None = None, top_k: int = 0, min_p: float = 0.0,
                 seed: int | None = None, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                 ignore_eos: bool = False, logprobs: int = 0, repetition_penalty: float | None = None,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, request_id: str = "",
                 priority: int = 0) -> generation_pb2.GenerateRequest:
    if (prompt is None) == (token_ids is None):
        raise ValueError("give exactly one of prompt and token_ids")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sp = generation_pb2.SamplingParams(max_tokens=max_tokens, top_k=top_k, min_p=min_p, stop=list(stop),
                                       stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos, logprobs=logprobs,
                                       frequency_penalty=frequency_penalty, presence_penalty=presence_penalty)
    for name, v in (("temperature", temperature), ("top_p", top_p), ("seed", seed),
                    ("repetition_penalty", repetition_penalty)):
        if v is not None:
            setattr(sp, name, v)
    req = generation_pb2.GenerateRequest(request_id=request_id, sampling=sp, priority=priority)
    if prompt is not None:
        req.text = prompt
    else:
        req.token_ids.ids.extend(token_ids)
    return req


class _Base:
    def __init__(self, target: str, api_key: str | None = None, timeout_s: float | None = 600.0) -> None:
        self.target, self.timeout_s = target, timeout_s
        self.metadata = rpc.auth_metadata(api_key)


def _tls_credentials(tls_ca: str) -> grpc.ChannelCredentials:
    with open(tls_ca, "rb") as f:
        return grpc.ssl_channel_credentials(root_certificates=f.read())


class GenerationClient(_Base):
    """Blocking client (one channel; thread-safe like any grpc channel). ``tls_ca``: dial over TLS, trusting
    this PEM bundle (a router started with --tls-cert)."""

    def __init__(self, target: str, api_key: str | None = None, timeout_s: float | None = 600.0,
                 tls_ca: str | None = None) -> None:
        super().__init__(target, api_key, timeout_s)
        self.channel = grpc.insecure_channel(target, options=rpc.CHANNEL_OPTIONS) if tls_ca is None else \
            grpc.secure_channel(target, _tls_credentials(tls_ca), options=rpc.CHANNEL_OPTIONS)
        self.gen = generation_pb2_grpc.GenerationStub(self.channel)
        self.admin = generation_pb2_grpc.AdminStub(self.channel)

    def stream(self, prompt: str | None = None, token_ids: Sequence[int] | None = None, *,
               timeout_s: float | None = None, **sampling) -> Iterator[generation_pb2.GenerateResponse]:
        req = make_request(prompt, token_ids, **sampling)
        return self.gen.Generate(req, metadata=self.metadata, timeout=timeout_s or self.timeout_s)

    def generate(self, prompt: str | None = None, token_ids: Sequence[int] | None = None, **kw) -> Completion:
        out, t0 = Completion(), time.perf_counter()
        for chunk in self.stream(prompt, token_ids, **kw):
            out.add(chunk, t0)
        return out

    def cluster_status(self, timeout_s: float = 10.0) -> generation_pb2.ClusterStatus:
        return self.admin.GetClusterStatus(generation_pb2.GetClusterStatusRequest(), metadata=self.metadata,
                                           timeout=timeout_s)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "GenerationClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncGenerationClient(_Base):
    """asyncio client; create and use it inside one running event loop."""

    def __init__(self, target: str, api_key: str | None = None, timeout_s: float | None = 600.0,
                 tls_ca: str | None = None) -> None:
        super().__init__(target, api_key, timeout_s)
        self.channel = grpc.aio.insecure_channel(target, options=rpc.CHANNEL_OPTIONS) if tls_ca is None else \
            grpc.aio.secure_channel(target, _tls_credentials(tls_ca), options=rpc.CHANNEL_OPTIONS)
        self.gen = generation_pb2_grpc.GenerationStub(self.channel)
        self.admin = generation_pb2_grpc.AdminStub(self.channel)

    def call(self, prompt: str | None = None, token_ids: Sequence[int] | None = None, *,
             timeout_s: float | None = None, **sampling):
        """The raw streaming call (``async for`` over it; ``.cancel()`` to cancel)."""
        req = make_request(prompt, token_ids, **sampling)
        return self.gen.Generate(req, metadata=self.metadata, timeout=timeout_s or self.timeout_s)

    async def stream(self, prompt: str | None = None, token_ids: Sequence[int] | None = None,
                     **kw) -> AsyncIterator[generation_pb2.GenerateResponse]:
        async for chunk in self.call(prompt, token_ids, **kw):
            yield chunk

    async def generate(self, prompt: str | None = None, token_ids: Sequence[int] | None = None, **kw) -> Completion:
        out, t0 = Completion(), time.perf_counter()
        async for chunk in self.call(prompt, token_ids, **kw):
            out.add(chunk, t0)
        return out

    async def cluster_status(self, timeout_s: float = 10.0) -> generation_pb2.ClusterStatus:
        return await self.admin.GetClusterStatus(generation_pb2.GetClusterStatusRequest(), metadata=self.metadata,
                                                 timeout=timeout_s)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncGenerationClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
