"""bench.loadgen.openai_backend against a server that behaves as llama.cpp's ``llama-server`` does (a real
socket server on 127.0.0.1): usage on the finishing choice's event, and the connection closed after every
streamed response although the headers announce keep-alive."""
from __future__ import annotations

import asyncio
import json

import aiohttp

from bench.loadgen.openai_backend import OpenAIGeneration, connector
from protos.pdserve.v1 import generation_pb2

COMPLETION_TOKENS = 5


def sse(obj) -> bytes:
    data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One request per connection, answered as llama-server streams, then the socket is closed."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(ln.split(b":")[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length"))
    await reader.readexactly(length)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                 b"Keep-Alive: timeout=5, max=100\r\n\r\n")
    for i in range(COMPLETION_TOKENS - 1):  # one empty-text token (its text not out yet) among the texts
        writer.write(sse({"choices": [{"text": "" if i == 2 else "a", "index": 0, "finish_reason": None}]}))
    writer.write(sse({"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                      "usage": {"completion_tokens": COMPLETION_TOKENS, "prompt_tokens": 3,
                                "prompt_tokens_details": {"cached_tokens": 0}}}))
    writer.write(sse(b"[DONE]") + b"0\r\n\r\n")
    await writer.drain()
    await reader.read(1)  # llama-server closes once the next request on this connection starts to arrive
    writer.transport.abort()


async def run_requests(n: int) -> list[list[generation_pb2.GenerateResponse]]:
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    out = []
    try:
        async with aiohttp.ClientSession(connector=connector()) as session:
            gen = OpenAIGeneration(session, f"http://127.0.0.1:{port}/v1", "m", None)
            for i in range(n):
                req = generation_pb2.GenerateRequest(request_id=f"r{i}")
                req.token_ids.ids.extend([5, 6, 7])
                req.sampling.max_tokens = COMPLETION_TOKENS
                out.append([chunk async for chunk in gen.Generate(req, timeout=10)])
    finally:
        server.close()
        await server.wait_closed()
    return out


def test_every_request_succeeds_and_counts_the_usage_on_the_finishing_event():
    results = asyncio.run(asyncio.wait_for(run_requests(6), 60))
    assert len(results) == 6
    for chunks in results:
        assert sum(len(c.token_ids) for c in chunks) == COMPLETION_TOKENS
        # every token event is one arrival, the empty-text one included (as vLLM's bench counts them); the
        # finishing event's empty text is not a token: it carries the one token the count lacks
        assert [len(c.token_ids) for c in chunks] == [1] * COMPLETION_TOKENS
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == COMPLETION_TOKENS
