"""The prefill side's frame writer: whole frames onto one connected socket, in order, never interleaved.

A ``tx_peer.TxPeer`` owns one per connection, made once its handshake is done. Every frame of the
connection goes through ``send``: a small one while nothing is queued is written by the loop thread itself
(``_send_inline``); the rest go, FIFO, to one send thread that writes through a blocking twin of the socket
(``_blocking_send``), so ``sendall`` loops in C without the GIL while the loop thread prepares the next frame.
``send`` returns once at most ``MAX_QUEUED_FRAMES`` frames are still unwritten (that is the batching: one on
the wire, one ready behind it) and raises the error of any write that failed. The writer knows frames as
bytes; what they say, and what a failed write means for the transfers, is the connection's business.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import socket
from collections.abc import Callable
from typing import Any

from kvtransfer.config import ChecksumKind
from kvtransfer.protocol import TRAILER, checksum, new_digest

MAX_QUEUED_FRAMES = 2
"""Frames handed to the send thread but not yet written (one on the wire, one ready behind it)."""
INLINE_SEND_BYTES = 64 << 10
"""Frames up to this size are written by the loop thread itself when the send thread is idle."""
SEND_PIECE_BYTES = 256 << 10
"""A checksummed payload goes out in pieces this large, each hashed just before its ``sendall``: half a
Zen core's L2, so the kernel's copy reads what the hash just read from cache."""


def _set_started(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # a write failed after we gave up on the connection: nothing left to tell


class FrameWriter:
    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, send_timeout_s: float) -> None:
        """``sock``: the connection's non-blocking socket (the loop's; the owner closes it). The writer
        writes through a blocking duplicate of it, which it closes itself."""
        self.loop, self.sock = loop, sock
        self.wsock = sock.dup()
        self.wsock.settimeout(send_timeout_s)  # a stalled receiver surfaces as TimeoutError
        self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtransfer-send")
        self._writes: collections.deque[asyncio.Future] = collections.deque()
        """The send thread's writes not yet collected, oldest first."""
        self.closed = False

    async def send(self, *bufs: bytes | memoryview, payload: tuple[memoryview, ...] = (),
                   kind: ChecksumKind = ChecksumKind.NONE) -> None:
        """Queue one whole frame: ``bufs``, then ``payload`` followed by its ``kind`` checksum as the
        ``TRAILER`` (unless NONE); returns once at most one earlier frame is still unsent (raising the error
        of any write that failed)."""
        if self.closed:
            raise ConnectionError("connection closed")
        while self._writes and self._writes[0].done():
            await self._writes.popleft()
        size = sum(len(b) for b in bufs) + sum(v.nbytes for v in payload)
        idle = not self._writes
        if idle and size <= INLINE_SEND_BYTES:
            self._send_inline(bufs, payload, kind)
            return
        # An idle send thread has to take the GIL before its first write; while this (loop) thread goes on
        # preparing the next frame it would wait for it (~0.2 ms, the first layer's head start). So wait
        # here until it has begun: one loop wakeup, and the next frame is prepared while this one moves.
        started = self.loop.create_future() if idle else None
        self._writes.append(self.loop.run_in_executor(self._io, self._blocking_send, bufs, payload, kind, started))
        if started is not None:
            await asyncio.wait((started, self._writes[-1]), return_when=asyncio.FIRST_COMPLETED)
        while len(self._writes) > MAX_QUEUED_FRAMES or (self._writes and self._writes[0].done()):
            await self._writes.popleft()

    def run_in_order(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Run ``fn(*args)`` on the send thread, after the frames queued so far (a one-sided network write
        that must keep its place among them)."""
        return self.loop.run_in_executor(self._io, fn, *args)

    def after_writes(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the send thread is past every frame queued so far (one FIFO thread: the
        last write done means all of them are), or now when none is queued."""
        if self._writes:
            self._writes[-1].add_done_callback(lambda _: callback())
        else:
            callback()

    async def drain(self) -> None:
        """Wait until every frame queued so far is written (raising the error of a write that failed)."""
        while self._writes:
            await self._writes.popleft()

    @property
    def pending(self) -> tuple[asyncio.Future, ...]:
        """The writes still queued (``TxPeer.flush`` waits for them)."""
        return tuple(self._writes)

    def close(self) -> None:
        """Stop writing: the blocking socket closes after the write in progress, the thread ends, and the
        errors of writes still queued are collected unseen (the owner has failed the connection)."""
        if self.closed:
            return
        self.closed = True
        self._io.submit(self.wsock.close)  # after the write in progress
        self._io.shutdown(wait=False)
        for fut in self._writes:
            fut.add_done_callback(_consume)
        self._writes.clear()

    def _blocking_send(self, bufs: tuple[bytes | memoryview, ...], payload: tuple[memoryview, ...] = (),
                       kind: ChecksumKind = ChecksumKind.NONE, started: asyncio.Future | None = None) -> None:
        """On the send thread: each piece of the payload is hashed just before its ``sendall``, so the
        kernel's copy reads it from cache. ``started`` is resolved (on the loop) as this thread begins,
        before its first write."""
        if started is not None:
            self.loop.call_soon_threadsafe(_set_started, started)
        for b in bufs:
            self.wsock.sendall(b)
        digest = new_digest(kind) if payload else None
        for view in payload:
            if digest is None:
                self.wsock.sendall(view)
                continue
            for i in range(0, view.nbytes, SEND_PIECE_BYTES):
                piece = view[i:i + SEND_PIECE_BYTES]
                digest.update(piece)
                self.wsock.sendall(piece)
        if digest is not None:
            self.wsock.sendall(TRAILER.pack(digest.intdigest()))

    def _send_inline(self, bufs: tuple[bytes | memoryview, ...], payload: tuple[memoryview, ...],
                     kind: ChecksumKind) -> None:
        """A small frame while the send thread is idle: one non-blocking ``send`` from the loop thread, which
        saves the thread handoff (~0.1 ms there and back, most of a small transfer's latency); whatever
        the socket buffer does not take goes to the send thread as usual."""
        parts = [*bufs, *payload]
        if payload and kind is not ChecksumKind.NONE:
            parts.append(TRAILER.pack(checksum(kind, payload)))  # type: ignore[arg-type]
        data = b"".join(parts)
        try:
            sent = self.sock.send(data)  # non-blocking (the loop's socket)
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent < len(data):
            self._writes.append(self.loop.run_in_executor(self._io, self._blocking_send,
                                                          (memoryview(data)[sent:],)))
