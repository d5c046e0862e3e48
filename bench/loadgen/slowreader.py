"""Clients that open ``Generate`` streams and never read them: HTTP/2 with a zero flow-control window.

A gRPC client library reads whatever arrives into its own buffers, so it cannot be made to stop reading;
this speaks HTTP/2 on a raw socket instead (RFC 9113: the preface, SETTINGS with
``SETTINGS_INITIAL_WINDOW_SIZE = 0``, one HEADERS + DATA per stream, HPACK literals only, RFC 7541
§6.2.2) and never sends WINDOW_UPDATE, so the server cannot send a single byte of any response message.
It acknowledges SETTINGS and PING (a peer that does not may be dropped as dead, which is not the attack)
and records how each stream ended (trailers, RST_STREAM or GOAWAY) so a test or the bench can tell when the
server gave up on it. Used by ``pdserve bench --fault slow-readers@S`` and tests/router.
"""
from __future__ import annotations

import socket
import struct
import threading
import time

from protos.pdserve.v1 import generation_pb2

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
SETTINGS_ENABLE_PUSH, SETTINGS_INITIAL_WINDOW_SIZE = 0x2, 0x4


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream_id) + payload


def _hpack_int(value: int, prefix_bits: int) -> bytes:
    """RFC 7541 §5.1 integer with a ``prefix_bits`` prefix (first byte's high bits 0: no Huffman)."""
    top = (1 << prefix_bits) - 1
    if value < top:
        return bytes([value])
    out, value = [top], value - top
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    return bytes(out + [value])


def hpack_literal(name: str, value: str) -> bytes:
    """Literal header field without indexing, new name (RFC 7541 §6.2.2), raw strings."""
    n, v = name.encode(), value.encode()
    return b"\x00" + _hpack_int(len(n), 7) + n + _hpack_int(len(v), 7) + v


class SlowReaders:
    """``num_streams`` ``Generate`` calls on one connection to ``address`` whose responses are never read.

    ``start()`` sends them all; ``ended`` maps a stream id to how the server ended it; ``close()`` drops
    the connection. The request is the same for every stream (``request``)."""

    def __init__(self, address: str, num_streams: int, request: generation_pb2.GenerateRequest,
                 api_key: str | None = None, timeout_s: float | None = None, reopen_s: float | None = None) -> None:
        self.address, self.num_streams, self.request = address, num_streams, request
        self.api_key, self.timeout_s = api_key, timeout_s
        self.reopen_s = reopen_s
        """When set, a stream the server ends (refused, finished) is replaced by a new one after this pause,
        so ``num_streams`` stay open however many the server turns away (the attack is sustained)."""
        self.stream_ids = [1 + 2 * i for i in range(num_streams)]
        self._next_id = 1 + 2 * num_streams
        self.num_opened = num_streams
        self.ended: dict[int, str] = {}
        """stream id -> "trailers", "rst" or "goaway" (how the server ended it)."""
        self.goaway = False
        self._sock: socket.socket | None = None
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> "SlowReaders":
        host, _, port = self.address.rpartition(":")
        self._sock = socket.create_connection((host.strip("[]"), int(port)), timeout=10)
        self._sock.settimeout(None)
        settings = struct.pack(">HI", SETTINGS_ENABLE_PUSH, 0) + struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, 0)
        body = self.request.SerializeToString()
        self._message = b"\x00" + struct.pack(">I", len(body)) + body  # gRPC length-prefixed, uncompressed
        self._header_block = self._headers(host)
        self._send(PREFACE + frame(SETTINGS, 0, 0, settings) + b"".join(self._open(sid) for sid in self.stream_ids))
        self._reader = threading.Thread(target=self._read_loop, name="slow-readers", daemon=True)
        self._reader.start()
        return self

    def _open(self, sid: int) -> bytes:
        return frame(HEADERS, END_HEADERS, sid, self._header_block) + frame(DATA, END_STREAM, sid, self._message)

    def _ended(self, sid: int, how: str) -> None:
        if sid in self.ended:
            return
        self.ended[sid] = how
        if self.reopen_s is not None:
            time.sleep(self.reopen_s)  # on the reader thread: bounds the rate of new streams
            sid, self._next_id = self._next_id, self._next_id + 2
            self.num_opened += 1
            self._send(self._open(sid))

    def _headers(self, host: str) -> bytes:
        fields = [(":method", "POST"), (":scheme", "http"), (":path", "/pdserve.v1.Generation/Generate"),
                  (":authority", self.address), ("content-type", "application/grpc"), ("te", "trailers")]
        if self.api_key:
            fields.append(("authorization", f"Bearer {self.api_key}"))
        if self.timeout_s is not None:
            fields.append(("grpc-timeout", f"{max(1, int(self.timeout_s * 1000))}m"))
        return b"".join(hpack_literal(n, v) for n, v in fields)

    def _send(self, data: bytes) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.sendall(data)

    @staticmethod
    def _read_exact(sock: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf

    def _read_loop(self) -> None:
        sock = self._sock
        try:
            while True:
                head = self._read_exact(sock, 9)
                length = int.from_bytes(head[:3], "big")
                kind, flags, sid = head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                payload = self._read_exact(sock, length) if length else b""
                if kind == SETTINGS and not flags & ACK:
                    self._send(frame(SETTINGS, ACK, 0))
                elif kind == PING and not flags & ACK:
                    self._send(frame(PING, ACK, 0, payload))
                elif kind == HEADERS and flags & END_STREAM:
                    self._ended(sid, "trailers")
                elif kind == RST_STREAM:
                    self._ended(sid, "rst")
                elif kind == GOAWAY:
                    self.goaway = True
        except (OSError, ConnectionError):
            pass
        for sid in self.stream_ids:  # the connection is gone: so is every stream on it
            self.ended.setdefault(sid, "goaway" if self.goaway else "closed")

    def num_ended(self) -> int:
        return len(self.ended)

    def wait_ended(self, timeout_s: float) -> bool:
        """Wait until the server ended every stream (without ``reopen_s``); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while len(self.ended) < self.num_streams:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def close(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        if self._reader is not None:
            self._reader.join(5)
