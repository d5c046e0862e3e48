"""``FrameWriter`` on its own, over a real socket pair: frames arrive whole and in order, inline or through
the send thread, a payload followed by its checksum trailer; a closed writer refuses to send and closes its
socket."""
import asyncio
import socket

import pytest

from kvtransfer.config import ChecksumKind
from kvtransfer.frame_writer import INLINE_SEND_BYTES, SEND_PIECE_BYTES, FrameWriter
from kvtransfer.protocol import TRAILER, checksum


def read_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "peer closed early"
        out += chunk
    return bytes(out)


def test_frames_arrive_whole_in_order_with_their_trailers():
    a, b = socket.socketpair()
    a.setblocking(False)
    big = memoryview(bytes(range(256)) * ((3 * SEND_PIECE_BYTES + 17) // 256))  # pieces and a remainder
    frames = [(b"head-1", (), ChecksumKind.NONE),  # small and idle: written inline by the loop thread
              (b"head-2", (big,), ChecksumKind.XXH3),  # large: the send thread, hashed piece by piece
              (b"head-3", (memoryview(b"tiny"),), ChecksumKind.CRC32C),
              (b"x" * (INLINE_SEND_BYTES + 1), (), ChecksumKind.NONE)]
    expected = b"".join(h + b"".join(bytes(v) for v in p) + (TRAILER.pack(checksum(k, p)) if p and
                        k is not ChecksumKind.NONE else b"") for h, p, k in frames)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        w = FrameWriter(loop, a, send_timeout_s=10.0)
        reading = loop.run_in_executor(None, read_exactly, b, len(expected))
        for head, payload, kind in frames:
            await w.send(head, payload=payload, kind=kind)
        dropped = []
        w.after_writes(lambda: dropped.append(1))
        await w.drain()
        # the callback runs in a loop iteration of its own: a callback added to a future already done is scheduled,
        # not called, and drain() awaits done futures without yielding; when the last write finished before
        # after_writes() (a CI failure; reproduced with a 0.3 s sleep before it) the check came first
        await asyncio.sleep(0)
        assert not w.pending and dropped == [1]
        assert await reading == expected
        w.close()
        with pytest.raises(ConnectionError):
            await w.send(b"late")
        await loop.run_in_executor(None, w._io.shutdown, True)  # the close ran on the send thread
        assert w.wsock.fileno() == -1 and a.fileno() != -1  # its own twin closed; the owner's socket left
    try:
        asyncio.run(main())
    finally:
        a.close()
        b.close()


def test_a_write_to_a_closed_peer_raises_from_send():
    a, b = socket.socketpair()
    a.setblocking(False)
    b.close()

    async def main() -> None:
        w = FrameWriter(asyncio.get_running_loop(), a, send_timeout_s=10.0)
        with pytest.raises(OSError):
            for _ in range(8):  # the first write may only fail on a later frame
                await w.send(b"y" * (INLINE_SEND_BYTES + 1))
            await w.drain()
        w.close()
    try:
        asyncio.run(main())
    finally:
        a.close()
