"""A worker's prefix cache events for the router (``StreamCacheEvents``), shared by prefill and decode workers.

The caches publish from their own threads (the scheduler's, a disk writer's); each subscriber (a router's stream)
gets every event in order on the worker's event loop, starting with a snapshot; a subscriber that falls 10,000
events behind is resynchronised from a fresh snapshot instead of buffering without bound."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from protos.pdserve.v1 import worker_pb2

MAX_BEHIND = 10_000
"""Events queued for one subscriber before it is resynchronised from a snapshot."""


class CacheEventHub:
    def __init__(self, loop: asyncio.AbstractEventLoop, snapshot: Callable[[], worker_pb2.CacheEvent]) -> None:
        self.loop, self.snapshot = loop, snapshot
        """The worker's event loop; ``snapshot()``: everything the caches hold, as a reset event."""
        self.subscribers: set[asyncio.Queue] = set()

    def publish(self, ev: worker_pb2.CacheEvent) -> None:
        """From any thread."""
        for q in list(self.subscribers):
            self.loop.call_soon_threadsafe(_put_nowait, q, ev)

    async def stream(self) -> AsyncIterator[worker_pb2.CacheEvent]:
        """A subscriber's events (the servicer's ``StreamCacheEvents`` yields them), a snapshot first."""
        q: asyncio.Queue = asyncio.Queue(maxsize=MAX_BEHIND)
        self.subscribers.add(q)
        try:
            yield self.snapshot()
            while True:
                ev = await q.get()
                yield self.snapshot() if ev is None else ev  # None: it overflowed, resync
        finally:
            self.subscribers.discard(q)


def _put_nowait(q: asyncio.Queue, ev) -> None:
    try:
        q.put_nowait(ev)
    except asyncio.QueueFull:
        while not q.empty():
            q.get_nowait()
        q.put_nowait(None)
