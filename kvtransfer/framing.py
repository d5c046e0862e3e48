"""Frame I/O on sockets: a zero-copy receiving protocol (decode side) and plain helpers (prefill side).

``FrameReader`` is an ``asyncio.BufferedProtocol``: the event loop calls ``recv_into`` on
whatever buffer ``get_buffer`` returns. Prefix and header land in a small scratch buffer;
while a payload is due it returns the next destination view (page tensor memory or
staging), so the kernel copies the payload straight into place. A destination can be
switched to a discard buffer at any moment (``PayloadSink.discard``) when its request is
aborted mid-frame: after that no byte of the frame reaches the pages.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any, Callable, Protocol

from kvtransfer.errors import FailReason, ProtocolError
from kvtransfer.protocol import PREFIX, FrameType, Header, decode_header, decode_prefix, encode_frame

log = logging.getLogger(__name__)

SCRATCH_BYTES = 128 * 1024
"""Holds one prefix plus the largest header (``MAX_HEADER_BYTES``) with room to spare."""
_DISCARD = memoryview(bytearray(1 << 20))


RCVLOWAT_MAX_BYTES = 512 << 10
"""While a payload is due the socket wakes the loop only once this much (or the payload's rest) has
arrived (``SO_RCVLOWAT``): a large payload then lands in reads of ~this size instead of ~150 KB ones, so
the Python work per read (``get_buffer`` / ``buffer_updated``) stops competing with the copy. At
10 us of Python per read, 27 MB x 4 layers over loopback: 700 -> 93 reads, 2.5-3.1 -> 3.3-3.5 GiB/s
(with 1 MiB)."""
HASHED_READ_BYTES = 512 << 10
"""A checksummed payload is read at most this much at a time, and each read is hashed right after it
lands. The kernel's copy streams the socket's bytes and the destination through L2 (2 MiB a core here):
at 512 KiB the hash still finds the bytes there. With 1 MiB reads it hashed 34 MiB in 1.96 ms (~17 GiB/s);
at 512 KiB in 1.52 ms, and the transfer's p50 fell from 8.00 to 7.21 ms (scratch loopback driver, 4 x 8.96
MB, 20 rotated rounds). 256 KiB hashed faster still, but twice the reads gave the time back."""

KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 30, 10, 3
"""A peer host that vanished without closing (power loss, partition) is detected within ~60 s even
on an idle connection: its slot and socket are released (its transfers fail sooner, by their own
stall timeouts)."""


def tune_socket(sock: socket.socket, buffer_bytes: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                       ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        if hasattr(socket, opt):  # Linux; macOS has only some of them
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
    if buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


class PayloadSink:
    """Destinations for one frame's payload, filled in order; ``on_done`` runs once when full.

    With ``digest`` (``protocol.new_digest``) the checksum is continued over each piece as it lands: the
    bytes are still in cache from the kernel's copy, and no pass over the whole payload is left for after
    its last byte. ``trailer`` receives the payload's last bytes (the sender's checksum), not hashed."""

    def __init__(self, views: list[memoryview], on_done: Callable[[], None], digest: Any = None,
                 trailer: memoryview | None = None) -> None:
        self._views = [v for v in views if v.nbytes]
        self._hashed = len(self._views) if digest is not None else 0  # views before this index are hashed
        if trailer is not None:
            self._views.append(trailer)
        self._idx = 0
        self._pos = 0
        self.remaining = sum(v.nbytes for v in self._views)
        self.on_done = on_done
        self.discarded = False
        self.digest = digest

    @classmethod
    def trash(cls, num_bytes: int) -> "PayloadSink":
        sink = cls([], lambda: None)
        sink.remaining = num_bytes
        sink.discarded = True
        return sink

    @property
    def done(self) -> bool:
        return self.remaining == 0

    def current(self) -> memoryview:
        if self.discarded:
            return _DISCARD[:min(self.remaining, _DISCARD.nbytes)]
        if self._idx < self._hashed:
            return self._views[self._idx][self._pos:self._pos + HASHED_READ_BYTES]
        return self._views[self._idx][self._pos:]

    def advance(self, n: int) -> None:
        """``n`` bytes landed at the start of ``current()`` (never past the end of one view)."""
        self.remaining -= n
        if self.discarded:
            return
        if self._idx < self._hashed:
            self.digest.update(self._views[self._idx][self._pos:self._pos + n])
        self._pos += n
        while self._idx < len(self._views) and self._pos == self._views[self._idx].nbytes:
            self._idx += 1
            self._pos = 0

    def feed(self, data: memoryview) -> None:
        """Copy read-ahead bytes (that arrived with the header) into the destinations."""
        while data.nbytes:
            dst = self.current()
            n = min(dst.nbytes, data.nbytes)
            if not self.discarded:
                dst[:n] = data[:n]
            self.advance(n)
            data = data[n:]

    def discard(self) -> None:
        """Send the rest of this payload to the bit bucket (its request was aborted)."""
        self.discarded = True
        self._views = []


class FrameHandler(Protocol):
    """What a ``FrameReader`` drives (implemented by the receiver's connection)."""

    max_header: int
    max_payload: int

    def on_frame(self, header: Header, payload_len: int) -> PayloadSink | None: ...

    def on_bad_header(self, err: ProtocolError, payload_len: int) -> bool:
        """A header failed validation; return True to skip its payload and go on, False to close."""

    def on_fatal(self, err: ProtocolError) -> None: ...

    def on_connected(self, transport: asyncio.Transport) -> None: ...

    def on_lost(self, exc: Exception | None) -> None: ...


class FrameReader(asyncio.BufferedProtocol):
    def __init__(self, handler: FrameHandler) -> None:
        self.handler = handler
        self._buf = bytearray(SCRATCH_BYTES)
        self._mv = memoryview(self._buf)
        self._len = 0
        self._prefix = None
        self._sink: PayloadSink | None = None
        self._paused = False
        self._closed = False
        self.transport: asyncio.Transport | None = None
        self._sock = None
        self._lowat = 1

    # --- asyncio callbacks -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._sock = transport.get_extra_info("socket") if hasattr(socket, "SO_RCVLOWAT") else None
        self.handler.on_connected(self.transport)  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        try:
            self.handler.on_lost(exc)
        finally:
            # A lost connection keeps nothing big alive: this reader, its handler and the handler's owner form
            # reference cycles that only the cyclic collector frees, and a worker's full collection can be
            # minutes away; 80 slowloris connections every few seconds then held ~260 MB of scratch buffers.
            self._sink = None
            self._mv = memoryview(b"")
            self._buf = bytearray()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._sink is not None:
            return self._sink.current()
        return self._mv[self._len:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._closed:
            return
        if self._sink is not None:
            self._sink.advance(nbytes)
            if self._sink.done:
                sink, self._sink = self._sink, None
                self._set_lowat(1)  # headers are small: wake on any byte
                sink.on_done()
                if not self._paused:
                    self._parse()
            elif self._sink.remaining < self._lowat:
                self._set_lowat(self._sink.remaining)
            return
        self._len += nbytes
        self._parse()

    def eof_received(self) -> bool:
        return False  # close our side too

    # --- flow control used by the handler --------------------------------------------------------
    def pause(self) -> None:
        """Stop reading (a payload is being verified); frames already buffered wait too."""
        self._paused = True
        if self.transport is not None and not self._closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if not self._paused or self._closed:
            return
        self._paused = False
        self.transport.resume_reading()  # type: ignore[union-attr]
        self._parse()

    def close(self) -> None:
        if not self._closed and self.transport is not None:
            self._closed = True
            self.transport.close()

    def discard_current(self) -> None:
        if self._sink is not None:
            self._sink.discard()

    def _set_lowat(self, nbytes: int) -> None:
        """Wake for reads once ``nbytes`` (capped) are queued; the kernel signals at once if they already are."""
        n = max(1, min(nbytes, RCVLOWAT_MAX_BYTES))
        if n == self._lowat or self._sock is None or self._closed:
            return
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)
        except OSError as e:  # a platform without it: plain wakeups from now on
            log.debug("kvtransfer: SO_RCVLOWAT unavailable (%s)", e)
            self._sock = None
        else:
            self._lowat = n

    # --- parsing ---------------------------------------------------------------------------------
    def _parse(self) -> None:
        pos = 0
        try:
            while not self._paused and not self._closed and self._sink is None:
                if self._prefix is None:
                    if self._len - pos < PREFIX.size:
                        break
                    self._prefix = decode_prefix(self._mv[pos:pos + PREFIX.size], self.handler.max_header,
                                                 self.handler.max_payload)
                    pos += PREFIX.size
                header_len, payload_len = self._prefix
                if self._len - pos < header_len:
                    break
                raw = self._mv[pos:pos + header_len]
                pos += header_len
                self._prefix = None
                try:
                    header = decode_header(raw, payload_len)
                except ProtocolError as err:
                    if not self.handler.on_bad_header(err, payload_len):
                        raise
                    sink = PayloadSink.trash(payload_len) if payload_len else None
                else:
                    sink = self.handler.on_frame(header, payload_len)
                if payload_len:
                    if sink is None or sink.remaining != payload_len:
                        raise ProtocolError(FailReason.BAD_FRAME, "internal: payload sink does not match payload")
                    take = min(self._len - pos, payload_len)
                    sink.feed(self._mv[pos:pos + take])
                    pos += take
                    if sink.done:
                        sink.on_done()
                    else:
                        self._sink = sink
                        self._set_lowat(sink.remaining)
        except ProtocolError as err:
            self.handler.on_fatal(err)
            self.close()
            return
        if pos:
            rest = self._len - pos
            self._buf[:rest] = self._buf[pos:self._len]
            self._len = rest


# --- the sending side: plain sockets on an event loop ---------------------------------------------

async def recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return bytes(buf)


async def read_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, max_header: int) -> Header:
    """Read one control frame (no payload allowed) from ``sock``."""
    prefix = decode_prefix(await recv_exactly(loop, sock, PREFIX.size), max_header, 0)
    return decode_header(await recv_exactly(loop, sock, prefix.header_len), 0)


async def send_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, ftype: FrameType, fields: dict) -> None:
    await loop.sock_sendall(sock, encode_frame(ftype, fields))
