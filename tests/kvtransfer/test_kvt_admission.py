"""Connections that never authenticate cannot lock senders out of the KV port (issue 25, item 3).

Over real sockets: more slow connections than the old 64-connection limit (silent ones and ones
dribbling a HELLO a byte at a time), a flood of connect/close attempts, a full authenticated budget.
Each test ends with every page, connection and file descriptor back.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from typing import Iterator

import pytest

from kvt_helpers import SECRET, RawPeer, assert_landed, make_layout, make_pool, receiver, write_layer
from kvtransfer import FailReason, KVSender, KVSenderConfig, TransferError, TransportKind
from kvtransfer.admission import RateLimitedLog, TokenBucket
from kvtransfer.protocol import PDSERVE_KV_PROTOCOL_VERSION, FrameType, encode_frame

pytestmark = pytest.mark.timeout(120)

HANDSHAKE_TIMEOUT_S = 3.0


def num_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class LogCount(logging.Handler):
    """Every kvtransfer WARNING (and above) record while installed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def counted_logs() -> Iterator[LogCount]:
    handler, logger = LogCount(), logging.getLogger("kvtransfer")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


class Slowloris:
    """``n`` connections that never finish a handshake: half silent, half dribbling a HELLO frame one byte
    every ``dribble_s`` (it is never complete before the receiver's handshake timeout)."""

    def __init__(self, address: tuple[str, int], n: int, dribble_s: float = 0.2) -> None:
        self.socks: list[socket.socket] = []
        for _ in range(n):
            s = socket.create_connection(address, timeout=5.0)
            self.socks.append(s)
        self.opened_at = time.monotonic()
        self._stop = threading.Event()
        hello = encode_frame(FrameType.HELLO, {"v": PDSERVE_KV_PROTOCOL_VERSION, "n": b"x" * 32})
        self._thread = threading.Thread(target=self._dribble, args=(self.socks[::2], hello, dribble_s), daemon=True)
        self._thread.start()

    def _dribble(self, socks: list[socket.socket], hello: bytes, dribble_s: float) -> None:
        for i in range(len(hello) - 1):  # never the last byte
            if self._stop.wait(dribble_s):
                return
            for s in socks:
                with contextlib.suppress(OSError):
                    s.send(hello[i:i + 1])

    def wait_all_closed_by_peer(self, timeout_s: float) -> None:
        """The receiver closes every one of them within ``timeout_s`` of their opening."""
        deadline = self.opened_at + timeout_s
        for s in self.socks:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                while s.recv(65536):
                    pass
            except ConnectionError:
                pass  # reset: closed too
            except socket.timeout:
                raise AssertionError(f"a slow connection is still open {timeout_s}s after it was opened") from None

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for s in self.socks:
            s.close()


def deliver(sender: KVSender, h, src, dst, name: str, n: int = 24, seed: int = 0) -> None:
    """One real transfer (reserve, every layer, finish): it arrives bit-identical; pages released again."""
    ticket = h.rx.reserve(name, n)
    pages = src.allocator.alloc(src.pages_for(n), "req")
    for layer in range(src.layout.num_layers):
        write_layer(src, layer, pages, 0, n, seed=seed)
        sender.send_layer(ticket, layer, pages, 0, n)
    try:
        sender.finish(ticket).result(timeout=60)
        res = h.wait(name)
        assert_landed(src, pages, dst, res, n)
        dst.allocator.decref(list(res.page_ids))
    finally:
        src.allocator.decref(pages)


def make_sender(src) -> KVSender:
    return KVSender(src, KVSenderConfig(cluster_secret=SECRET, transport=TransportKind.TCP))


@pytest.fixture(scope="module", autouse=True)
def warmed() -> None:
    """One transfer first: the first use of the machinery opens a process-lifetime pipe, not a leak."""
    lay = make_layout(num_layers=2)
    dst, src = make_pool(lay, 16), make_pool(lay, 16)
    with receiver(dst) as h:
        sender = make_sender(src)
        try:
            deliver(sender, h, src, dst, "warm-up")
        finally:
            sender.close()


def test_more_slow_connections_than_the_limit_do_not_lock_out_an_authenticated_sender():
    """70 connections that never authenticate (more than the 64 the old shared limit allowed): a real
    transfer still goes through at once, every slow connection is closed by the handshake timeout, and
    the receiver logs a handful of lines, not one per connection."""
    lay = make_layout(num_layers=3)
    dst, src = make_pool(lay, 64), make_pool(lay, 64)
    d0, s0, fds0 = dst.allocator.num_used, src.allocator.num_used, num_fds()
    with counted_logs() as logs, receiver(dst, handshake_timeout_s=HANDSHAKE_TIMEOUT_S) as h:
        slow = Slowloris(h.rx.address, 70)
        sender = make_sender(src)
        try:
            t0 = time.monotonic()
            deliver(sender, h, src, dst, "through-the-crowd")
            took_s = time.monotonic() - t0
            # it did not wait for the slow connections to time out
            assert took_s < HANDSHAKE_TIMEOUT_S, f"transfer took {took_s:.2f}s"
            slow.wait_all_closed_by_peer(HANDSHAKE_TIMEOUT_S + 5)
            deliver(sender, h, src, dst, "after-the-crowd", seed=1)  # the authenticated connection stayed up
            st = h.rx.stats()
            assert st.num_unauthenticated == 0 and st.num_connections == 1, st
        finally:
            slow.close()
            sender.close()
        h.wait_until(lambda: h.rx.stats().num_connections == 0)
    assert len(logs.records) <= 6, [r.getMessage() for r in logs.records]
    assert (dst.allocator.num_used, src.allocator.num_used) == (d0, s0)
    assert num_fds() == fds0


def test_connect_flood_is_rate_limited_with_a_bounded_log_and_a_sender_still_gets_in():
    """300 connect-and-close attempts as fast as one thread can make them: beyond the per-host rate (burst
    10, then 20/s) they are closed at once (counted, one log line per interval), and a sender that meets the empty bucket
    backs off and retries until it is let in."""
    lay = make_layout(num_layers=2)
    dst, src = make_pool(lay, 32), make_pool(lay, 32)
    d0, s0, fds0 = dst.allocator.num_used, src.allocator.num_used, num_fds()
    with counted_logs() as logs, receiver(dst, unauth_rate_per_s=20.0, unauth_burst=10) as h:
        t0 = time.monotonic()
        for _ in range(300):
            with contextlib.suppress(OSError):
                socket.create_connection(h.rx.address, timeout=5.0).close()
        admitted_at_most = 10 + 20.0 * (time.monotonic() - t0) + 1  # burst + rate x how long the flood took
        sender = make_sender(src)
        try:
            deliver(sender, h, src, dst, "after-the-flood")
        finally:
            sender.close()
        st = h.rx.stats()
        assert st.num_rate_limited >= 300 - admitted_at_most, st
        h.wait_until(lambda: h.rx.stats().num_connections == 0)
    assert len(logs.records) <= 6, [r.getMessage() for r in logs.records]
    assert (dst.allocator.num_used, src.allocator.num_used) == (d0, s0)
    assert num_fds() == fds0


def test_full_authenticated_budget_refuses_busy_and_a_sender_retries_until_a_slot_frees():
    """``max_connections`` counts authenticated peers only. With it full a newly authenticated peer gets
    ERROR busy; a sender retries with backoff and gets through once the slot frees."""
    lay = make_layout(num_layers=2)
    dst, src = make_pool(lay, 32), make_pool(lay, 32)
    d0, s0, fds0 = dst.allocator.num_used, src.allocator.num_used, num_fds()
    with receiver(dst, max_connections=1) as h:
        holder = RawPeer(h.rx.address)
        holder.handshake(lay)
        second = RawPeer(h.rx.address)
        with pytest.raises(AssertionError, match="busy"):
            second.handshake(lay)
        second.close()
        sender = make_sender(src)
        try:
            threading.Timer(0.5, holder.close).start()  # the slot frees while the sender is backing off
            deliver(sender, h, src, dst, "waited-for-a-slot")
        finally:
            sender.close()
        h.wait_until(lambda: h.rx.stats().num_connections == 0)
    assert (dst.allocator.num_used, src.allocator.num_used) == (d0, s0)
    assert num_fds() == fds0


def test_retries_stop_at_the_ticket_expiry():
    """A receiver that stays busy: the sender gives up when no queued transfer can use a connection any
    more (the ticket's expiry), with the receiver's reason, and unpins its pages."""
    lay = make_layout(num_layers=2)
    dst, src = make_pool(lay, 32), make_pool(lay, 32)
    s0 = src.allocator.num_used
    with receiver(dst, max_connections=1, ticket_ttl_s=1.5) as h:
        holder = RawPeer(h.rx.address)
        holder.handshake(lay)
        sender = make_sender(src)
        try:
            ticket = h.rx.reserve("never-let-in", 8)
            pages = src.allocator.alloc(2, "req")
            sender.send_layer(ticket, 0, pages, 0, 8)
            t0 = time.monotonic()
            with pytest.raises(TransferError) as exc:
                sender.finish(ticket).result(timeout=30)
            assert exc.value.reason is FailReason.BUSY, exc.value
            assert time.monotonic() - t0 < 5.0
            src.allocator.decref(pages)
        finally:
            sender.close()
            holder.close()
    assert src.allocator.num_used == s0


def test_token_bucket_and_rate_limited_log():
    b = TokenBucket(rate_per_s=10.0, burst=3, now=0.0)
    assert [b.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert b.take(0.1) and not b.take(0.1)
    logger = logging.getLogger("test-rate-limited-log")
    with counted_logs():
        handler = LogCount()
        logger.addHandler(handler)
        try:
            rl = RateLimitedLog(logger, interval_s=0.2)
            for _ in range(50):
                rl.warning("k", "refused %s", "x")
            time.sleep(0.25)
            rl.warning("k", "refused %s", "y")
        finally:
            logger.removeHandler(handler)
    msgs = [r.getMessage() for r in handler.records]
    assert len(msgs) == 2 and "49 more" in msgs[1], msgs


def test_nothing_listening_fails_at_once_without_retries():
    """ECONNREFUSED: the decode worker is gone; retrying would only delay the router's failover."""
    lay = make_layout(num_layers=2)
    dst, src = make_pool(lay, 16), make_pool(lay, 16)
    s0 = src.allocator.num_used
    with receiver(dst) as h:
        ticket = h.rx.reserve("orphan", 8)
    sender = make_sender(src)  # the receiver has stopped: its port is closed
    try:
        pages = src.allocator.alloc(2, "req")
        t0 = time.monotonic()
        sender.send_layer(ticket, 0, pages, 0, 8)
        with pytest.raises(TransferError) as exc:
            sender.finish(ticket).result(timeout=30)
        assert exc.value.reason is FailReason.PEER_DIED and "ConnectionRefused" in str(exc.value), exc.value
        assert time.monotonic() - t0 < 1.0
        src.allocator.decref(pages)
    finally:
        sender.close()
    assert src.allocator.num_used == s0


def test_closed_connections_hold_no_buffers_until_the_cyclic_collector_runs():
    """A connection's reader, handler and receiver form reference cycles: with the collector idle (a worker's
    full collections can be minutes apart) 200 closed slowloris connections must not keep their 128 KiB
    scratch buffers (a 10-minute chaos soak's decode worker grew 630 -> 887 MB in 40 s of slowloris before)."""
    import gc
    import tracemalloc
    pool = make_pool(make_layout(), 16)
    with receiver(pool, handshake_timeout_s=0.2) as h:
        gc.collect()
        gc.disable()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            for _ in range(10):
                socks = [socket.create_connection(h.rx.address) for _ in range(20)]
                h.wait_until(lambda: not h.rx.gate.unauthenticated, timeout_s=10)  # the receiver closed them
                for s in socks:
                    s.close()
            held = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
            gc.enable()
        assert held < 4 << 20, f"{held / 2**20:.1f} MiB held by 200 closed connections"
