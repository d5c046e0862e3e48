"""Writing a request's responses to its client without letting a slow reader hold the cluster.

The responses are produced (reservation, prefill, decode stream: ``GenerateRun.stream()``) by a task
into a bounded buffer and written to the client by the RPC handler. The two are decoupled on purpose:

- A client that reads slowly, or not at all (an HTTP/2 flow-control window of 0), does not hold the
  decode worker: its stream is read at the worker's pace, the worker finishes the request and frees its
  pages and batch slot, and the router stops counting the request at that worker when the stream ends.
  A blocked writer is not decode work.
- The buffer is bounded (``RESPONSE_BUFFER`` responses). When the client falls behind, the writer
  sends what queued up as one response (tokens, text and logprobs concatenated), as the decode worker
  does for its own reader. When the buffer is full the producer waits and HTTP/2 flow control pushes
  back on the decode stream: the worker's own per-request queue then holds at most the request's
  remaining ``max_tokens`` tokens.
- One write may block at most ``RouterConfig.stream_write_timeout_s``: a client that takes no response
  for that long has its request cancelled (DEADLINE_EXCEEDED, saying why), the producer is cancelled,
  every worker that saw the request is told to abort, and the router's in-flight slot is released.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Awaitable, Callable

import grpc

from protos.pdserve.v1 import generation_pb2
from router.request import GenerateRun
from router.validate import RequestError

RESPONSE_BUFFER = 256
"""Responses buffered between the request's producer and a client that reads slower than it."""
_END = object()


async def relay(run: GenerateRun, responses: AsyncIterator[generation_pb2.GenerateResponse],
                write: Callable[[generation_pb2.GenerateResponse], Awaitable[None]], write_timeout_s: float) -> None:
    """Consume ``responses`` (``run``'s stream, closed at the end) and ``write`` each one; raises
    ``RequestError`` for the request's own errors and for a client that did not take a response within
    ``write_timeout_s``."""
    buf: asyncio.Queue = asyncio.Queue(RESPONSE_BUFFER)

    async def produce() -> None:
        try:
            async with contextlib.aclosing(responses) as stream:
                async for resp in stream:
                    await buf.put(resp)
            last: object = _END
        except Exception as e:  # noqa: BLE001 - the request's RequestError, or a bug: the writer raises it
            last = e
        await buf.put(last)  # always the producer's last word (unless the writer cancelled it)

    producer = asyncio.get_running_loop().create_task(produce(), name=f"produce {run.client_req_id}")
    try:
        pending = None
        while True:
            item = pending if pending is not None else await buf.get()
            pending = None
            while isinstance(item, generation_pb2.GenerateResponse) and not item.finish_reason and not buf.empty():
                nxt = buf.get_nowait()  # the client fell behind: one message carries what queued up
                if not isinstance(nxt, generation_pb2.GenerateResponse):
                    pending = nxt
                    break
                item = merged(item, nxt)
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            await _write_one(run, write, item, write_timeout_s)
    finally:
        producer.cancel()  # a no-op once it finished; else it aborts the request on every worker
        await asyncio.gather(producer, return_exceptions=True)


def merged(a: generation_pb2.GenerateResponse, b: generation_pb2.GenerateResponse) -> generation_pb2.GenerateResponse:
    """``a`` then ``b`` as one response: tokens, text and logprobs concatenated, ``b``'s finish, usage,
    metrics and message (``a`` is never a finishing response)."""
    out = generation_pb2.GenerateResponse()
    out.CopyFrom(a)
    out.MergeFrom(b)  # repeated fields concatenate; b's set scalars and messages win
    out.text = a.text + b.text
    return out


async def _write_one(run: GenerateRun, write, resp, write_timeout_s: float) -> None:
    left = run.remaining()
    try:
        async with asyncio.timeout(min(write_timeout_s, left)):
            await write(resp)
    except TimeoutError:
        if left <= write_timeout_s:
            run.abort("deadline exceeded while the client was not reading")
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               "deadline exceeded while the client was not reading the stream") from None
        run.abort("client stopped reading")
        raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"the client took no response for {write_timeout_s:g}s (stream_write_timeout_s): "
                           "request cancelled") from None
